"""The fit check with context parallelism (``parallel.cp``; docs/LAUNCH.md, "The fit-check arithmetic",
context parallelism): each CP rank's share of a micro-batch's tokens (the actor's own rule), its
activations, LM head and routing at that share, the CP attention's keys, values and mask, the optimizer
sharded over DP x CP."""
import pytest
import torch

from megatron_tepo.launch import check_fit
from megatron_tepo.launch.memory import actor_memory, context_tokens, cp_attention_bytes
from tests.launch.test_fit import tiny


@pytest.mark.parametrize("tokens,cp,multiple", [(1, 2, 1), (7, 2, 1), (100, 3, 1), (100, 3, 2), (100, 3, 4),
                                                (14, 2, 3), (34816, 2, 4), (34817, 4, 4), (4096, 8, 2)])
def test_rank_share_is_the_actors(tokens, cp, multiple):
    """A CP rank's share of one packed sequence of ``tokens`` tokens is what the actor gives it
    (``MicroBatch.with_context_tokens`` then ``context_tokens``: 2 x cp chunks, two a rank, padded for
    the sequence-parallel split)."""
    from megatron_tepo.actor.micro_batch import build_micro_batch
    from megatron_tepo.batch import RolloutBatch

    ids = torch.arange(10, 10 + tokens + 1).unsqueeze(0)  # one row: 1 prompt token + `tokens` response tokens
    batch = RolloutBatch(input_ids=ids, prompt_lens=torch.tensor([1]), response_mask=torch.ones(1, tokens))
    mb = build_micro_batch(batch, [0], packed=True)
    actor = mb.with_context_tokens(cp, multiple=multiple).context_tokens(cp)
    assert context_tokens(tokens + 1, cp, multiple) == actor
    assert context_tokens(tokens + 1, 1, multiple) == tokens + 1  # CP 1: the micro-batch, unpadded, as before


def test_tiny_context_parallel_by_hand(tmp_path):
    """The tiny layout of test_fit.py (TP 2 on 4 GPUs, s = 256 tokens, no recompute, 1256 B a token a
    layer, 2 layers) at CP 2: DP 1, each rank 128 tokens."""
    base = actor_memory(*(lambda s: (s.shape(), s.cfg, s.launch))(tiny(tmp_path)))
    spec = tiny(tmp_path, parallel={"cp": 2}, actor={"pack_sequences": True})
    a = actor_memory(spec.shape(), spec.cfg, spec.launch)
    assert (a.cp, a.dp, a.tokens, a.rank_tokens) == (2, 1, 256, 128)
    assert a.activations == 2 * 1256 * 128 == base.activations / 2
    assert a.logits == 2 * 2 * 128 * 128 + (2 * 2 + 4) * 64 * 128  # the fused head at 128 tokens
    # no recompute, no TE: every layer keeps its gathered K and V (2 x 2 groups / TP 2 x 16 x 2 B x 256
    # tokens) and its causal mask (bool + bf16 bias, 128 local queries x 128 keys: the longest sequence)
    per_layer = 2 * 1 * 16 * 2 * 256 + 3 * 128 * 128
    assert cp_attention_bytes(spec.shape(), 2, 128, 2, 128) == per_layer == 65_536
    assert a.cp_attention == 2 * per_layer
    assert a.total == a.weights + a.grads + a.optimizer + a.activations + a.logits + a.cp_attention + a.reserve
    assert (a.weights, a.grads, a.optimizer) == (base.weights, base.grads, base.optimizer)  # replicated over CP
    # TE's ring: two ranks' blocks of K and V, no mask, passing (one layer)
    te = tiny(tmp_path, parallel={"cp": 2}, actor={"pack_sequences": True, "attention": "te"})
    assert actor_memory(te.shape(), te.cfg, te.launch).cp_attention == 2 * 1 * 16 * 2 * 2 * 128
    # full recompute: the re-run block's, then freed
    full = tiny(tmp_path, parallel={"cp": 2}, actor={"pack_sequences": True, "recompute": "full",
                                                     "recompute_num_layers": 2})
    f = actor_memory(full.shape(), full.cfg, full.launch)
    assert f.cp_attention == 2 * per_layer and f.activations == 2 * 128 * 128 + 2 * 1256 * 128
    sel = tiny(tmp_path, parallel={"cp": 2}, actor={"pack_sequences": True, "recompute": "selective"})
    assert actor_memory(sel.shape(), sel.cfg, sel.launch).cp_attention == per_layer
    # the distributed optimizer shards over DP x CP = 2 (as at CP 1 over DP 2)
    dist = tiny(tmp_path, parallel={"cp": 2}, actor={"pack_sequences": True},
                optim={"use_distributed_optimizer": True})
    assert actor_memory(dist.shape(), dist.cfg, dist.launch).optimizer == 12 * 53632 / 2


def test_context_parallel_report_says_what_it_assumed(tmp_path):
    spec = tiny(tmp_path, parallel={"cp": 2}, actor={"pack_sequences": True}, launch={"gpu_mem_gib": 80},
                optim={"use_distributed_optimizer": True})
    text = check_fit(spec.shape(), spec.cfg, spec.launch).render()
    assert "tp=2 pp=1 ep=1 dp=1 cp=2 " in text
    assert ("micro-batch tokens=256 (128 a CP rank: each sequence in 2 x cp=2 chunks, two a rank; the optimizer "
            "sharded over dp x cp = 2)") in text
    assert "CP attention 0.0 GiB" in text
    one = tiny(tmp_path, launch={"gpu_mem_gib": 80})
    text = check_fit(one.shape(), one.cfg, one.launch).render()
    assert "dp=2 cp=1 " in text and "a CP rank" not in text and "CP attention" not in text
