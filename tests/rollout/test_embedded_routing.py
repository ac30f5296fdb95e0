"""The embedded engine returns each sample's MoE routing (its ``routing`` shape, for
``actor.routing_replay: r3``): the experts its HF model's routers chose for every prompt and
response position but the last, through left padding, the prefill and the KV-cached decode steps --
the same experts a plain forward of the whole sequence chooses."""
import pytest
import torch

from megatron_tepo.batch import RolloutBatch
from megatron_tepo.rollout.embedded import EmbeddedEngine
from megatron_tepo.routing import RoutingShape
from tests.megatron.helpers import make_hf_model, tiny_hf_config
from tests.rollout.helpers import tiny_qwen3

PROMPTS = [[5, 17, 33], [9], [100, 101, 102, 103, 104, 7]]
LAYERS, TOPK = 3, 2
SHAPE = RoutingShape(LAYERS, tuple(range(LAYERS)), TOPK, 8)  # (the family config's: models/)


@pytest.fixture(scope="module")
def moe():
    cfg = tiny_hf_config("qwen3_moe", num_experts=8, num_experts_per_tok=TOPK, num_hidden_layers=LAYERS)
    return make_hf_model(cfg, seed=3).eval()


def _whole_sequence_routing(model, seq):
    """Each router's top-k (and the gap between its k-th and k+1-th logit) in one forward of ``seq``."""
    seen = []

    def hook(module, args, output):
        logits, _, ids = output
        top = logits.float().topk(TOPK + 1, dim=-1).values
        seen.append((ids.sort(-1).values, top[:, TOPK - 1] - top[:, TOPK]))

    gates = [layer.mlp.gate for layer in model.model.layers]
    handles = [g.register_forward_hook(hook) for g in gates]
    with torch.no_grad():
        model(input_ids=torch.tensor([seq]))
    for h in handles:
        h.remove()
    return torch.stack([s[0] for s in seen], 1), torch.stack([s[1] for s in seen], 1)  # [T, M, k], [T, M]


def test_samples_carry_the_routing_of_every_position_but_the_last(moe):
    hooks = [len(layer.mlp.gate._forward_hooks) for layer in moe.model.layers]
    eng = EmbeddedEngine(moe, seed=1, routing=SHAPE)
    groups = eng.generate(PROMPTS, n=2, temperature=1.0, max_new_tokens=6, stop_token_ids=[3, 4, 5, 6])
    eng.close()  # its hooks go with it
    assert [len(layer.mlp.gate._forward_hooks) for layer in moe.model.layers] == hooks
    checked = 0
    for prompt, group in zip(PROMPTS, groups):
        for s in group:
            seq = prompt + s.token_ids
            assert s.routed_experts.shape == (len(seq) - 1, LAYERS, TOPK) and s.routed_experts.dtype == torch.int8
            ref, gap = _whole_sequence_routing(moe, seq)
            clear = gap[:-1] > 1e-4  # (no near tie between the k-th and the next expert)
            got = s.routed_experts.long().sort(-1).values
            assert torch.equal(got[clear], ref[:-1][clear])
            checked += int(clear.sum())
    assert checked > 50
    batch = RolloutBatch.from_groups(PROMPTS, groups, pad_id=0)
    assert batch.routed_experts.shape[:3] == (6, batch.input_ids.shape[1], LAYERS)


def test_no_routing_no_hooks_and_a_dense_model_refuses_it(moe):
    hooks = [len(layer.mlp.gate._forward_hooks) for layer in moe.model.layers]
    eng = EmbeddedEngine(moe, seed=1)
    assert [len(layer.mlp.gate._forward_hooks) for layer in moe.model.layers] == hooks
    assert all(s.routed_experts is None for g in eng.generate(PROMPTS, n=1, max_new_tokens=2) for s in g)
    with pytest.raises(ValueError, match="^return_routing: .* has no MoE router"):
        EmbeddedEngine(tiny_qwen3(seed=0), routing=SHAPE)
    with pytest.raises(ValueError, match="^return_routing: .* has 3 MoE routers of \\[8\\] experts, the model "
                                         "family's routing shape says 2 MoE layers of 8"):
        EmbeddedEngine(moe, routing=RoutingShape(LAYERS, (0, 2), TOPK, 8))
    assert [len(layer.mlp.gate._forward_hooks) for layer in moe.model.layers] == hooks  # (none left behind)


def test_an_moe_weight_update_fills_the_fused_experts(moe):
    """The actor's export names one tensor per expert; transformers keeps them fused in memory."""
    from tests.megatron.helpers import hf_state

    other = make_hf_model(moe.config, seed=9).eval()
    eng = EmbeddedEngine(make_hf_model(moe.config, seed=4), seed=1)
    state = hf_state(other)
    assert any(".mlp.experts.3.up_proj.weight" in n for n in state)
    eng.update_weights(state.items())
    for name, p in other.state_dict().items():
        assert torch.equal(eng.model.state_dict()[name], p), name
    partial = {n: t for n, t in state.items() if ".experts.5.down_proj" not in n}
    with pytest.raises(ValueError, match="were not in the stream"):
        eng.update_weights(partial.items())
