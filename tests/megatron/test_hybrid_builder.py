"""megatron's ``HybridModel`` as the actor's second builder (``actor.model_builder``, megatron/hybrid.py).

* The choice: ``auto`` is ``hybrid`` wherever megatron-core has ``HybridModel`` and ``gpt`` where it
  has not; ``hybrid`` where it has not is refused naming the setting.
* The stack: two layers per HF decoder layer (token mixer, then MLP or MoE), ``|`` between pipeline
  stages; the names the mapping knows (the HF layers' GPT names) from the stack's.
* The same actor built both ways (workers/builder_worker.py, torchrun with gloo): log-probs, entropy,
  loss, every gradient and the parameters after one optimizer step equal bit for bit -- tensor
  parallelism with sequence parallelism and full recompute, pipeline parallelism with tied
  embeddings and selective recompute, bf16, and Qwen3-MoE at EP 2 with routing replay (r2).
"""
import json
from pathlib import Path

import pytest

from tests.dist_utils import torchrun
from tests.megatron.helpers import tiny_hf_config

WORKER = Path(__file__).parent / "workers" / "builder_worker.py"


def _hybrid_available():
    from megatron_tepo.megatron.compat import hybrid_model_available

    return hybrid_model_available()


def test_auto_takes_hybrid_where_megatron_core_has_it(monkeypatch):
    from megatron_tepo.megatron import compat, resolve

    assert resolve.resolve_model_builder("auto") == ("hybrid" if _hybrid_available() else "gpt")
    assert resolve.resolve_model_builder("gpt") == "gpt"
    monkeypatch.setattr(compat, "hybrid_model_available", lambda: False)
    assert resolve.resolve_model_builder("auto") == "gpt"
    with pytest.raises(ValueError, match=r"actor.model_builder: hybrid needs megatron-core's HybridModel"):
        resolve.resolve_model_builder("hybrid")
    monkeypatch.setattr(compat, "hybrid_model_available", lambda: True)
    assert resolve.resolve_model_builder("auto") == "hybrid"


def test_a_bad_builder_names_the_field():
    from megatron_tepo.config import ConfigError, from_dict

    with pytest.raises(ConfigError, match="actor.model_builder"):
        from_dict({"actor": {"model_builder": "mamba"}})


def test_the_pattern_holds_each_hf_layer_as_two_stack_layers():
    import dataclasses

    from megatron_tepo.megatron.hybrid import layer_pattern
    from megatron_tepo.models import family_config_from_hf

    dense = family_config_from_hf(tiny_hf_config("qwen3"), spec="local")
    assert layer_pattern(dense) == "*-*-*-*-"
    assert layer_pattern(dense, pp=2) == "*-*-|*-*-"
    moe = family_config_from_hf(tiny_hf_config("qwen3_moe"), spec="local")
    assert layer_pattern(moe, pp=4) == "*E|*E|*E|*E"
    with pytest.raises(ValueError, match="parallel.pp: 4 layers"):
        layer_pattern(dataclasses.replace(dense), pp=3)


def test_the_stack_layers_are_named_by_their_hf_layers():
    """Stack layer k of a HybridModel is HF layer k // 2; its final norm is the GPT one's name."""
    import torch

    from megatron_tepo.megatron.sharding import global_named_parameters, hf_layer_of, layer_offsets

    class Layer(torch.nn.Module):
        def __init__(self, number, part):
            super().__init__()
            self.layer_number = number
            setattr(self, part, torch.nn.Linear(2, 2, bias=False))

    decoder = torch.nn.Module()
    decoder.layers = torch.nn.ModuleList([Layer(5, "self_attention"), Layer(6, "mlp")])  # a 2nd pipeline stage
    decoder.final_norm = torch.nn.RMSNorm(2)
    decoder.sublayers_per_hf_layer = 2
    model = torch.nn.Module()
    model.decoder = decoder
    assert layer_offsets(model) == {0: 2, 1: 2}
    assert hf_layer_of(model, 6) == 2
    assert [n for n, _ in global_named_parameters(model)] == [
        "decoder.layers.2.self_attention.weight", "decoder.layers.2.mlp.weight", "decoder.final_layernorm.weight"]
    del decoder.sublayers_per_hf_layer  # a GPTModel's decoder: one layer per HF layer
    assert layer_offsets(model) == {0: 4, 1: 5}


@pytest.mark.skipif(not _hybrid_available(), reason="this megatron-core has no HybridModel")
def test_the_hybrid_spec_is_the_gpt_spec_cut_in_two():
    """The attention sublayer keeps the GPT layer's input norm and attention (the sdpa core
    attention, the QK norms), the MLP sublayer its pre-MLP norm and MLP; without fusions the
    output gate of gated attention and the Gated DeltaNet's helpers run eagerly; without
    Transformer Engine the final norm is the local one."""
    import dataclasses

    from megatron_tepo.config import ActorConfig
    from megatron_tepo.megatron.attention import SDPACoreAttention
    from megatron_tepo.megatron.resolve import resolve_actor_config
    from megatron_tepo.megatron.hybrid import eager_fusers, hybrid_stack_spec, local_hybrid_stack
    from megatron_tepo.megatron.spec import layer_spec
    from megatron_tepo.models import family_config_from_hf

    actor = resolve_actor_config(ActorConfig(precision="fp32", attention="sdpa"), cuda=False, te=False)
    fam = family_config_from_hf(tiny_hf_config("qwen3_moe"), spec="local")
    stack = hybrid_stack_spec(fam, actor)
    gpt = layer_spec(fam, "sdpa").submodules
    att, mlp, moe = (stack.submodules.attention_layer.submodules, stack.submodules.mlp_layer.submodules,
                     stack.submodules.moe_layer.submodules)
    assert stack.module is local_hybrid_stack() and stack.params["final_norm"] is gpt.input_layernorm
    assert att.input_layernorm is gpt.input_layernorm and att.self_attention.submodules.core_attention.module is \
        SDPACoreAttention
    assert att.self_attention.submodules.q_layernorm is gpt.self_attention.submodules.q_layernorm
    from megatron.core.transformer.attention import SelfAttention

    assert att.self_attention.module is SelfAttention  # (no output gate: megatron's own class)
    gated = hybrid_stack_spec(family_config_from_hf(tiny_hf_config("qwen3_5"), spec="local"), actor)
    assert gated.submodules.attention_layer.submodules.self_attention.module is eager_fusers()[SelfAttention]
    assert gated.submodules.gdn_layer.submodules.self_attention.module in eager_fusers().values()

    def kind(m):  # a ModuleSpec's module, or the function a partial calls
        return getattr(m, "module", None) or getattr(m, "func", None)

    assert moe.pre_mlp_layernorm is gpt.pre_mlp_layernorm and kind(moe.mlp) == kind(gpt.mlp)
    dense = layer_spec(dataclasses.replace(fam, moe=None), "sdpa").submodules
    assert kind(mlp.mlp) == kind(dense.mlp) != kind(gpt.mlp)  # the dense MLP beside the MoE one


@pytest.mark.distributed
@pytest.mark.timeout(400)
@pytest.mark.skipif(not _hybrid_available(), reason="this megatron-core has no HybridModel")
def test_hybrid_model_equals_gpt_model_bit_for_bit(tmp_path):
    cases = [
        {"family": "qwen3", "tp": 2, "actor": {"sequence_parallel": True, "recompute": "full"}},
        {"family": "qwen3", "tie": True, "pp": 2, "actor": {"recompute": "selective", "pack_sequences": False}},
        {"family": "llama", "tp": 2, "actor": {"precision": "bf16"}},
        {"family": "qwen3_moe", "ep": 2, "actor": {"routing_replay": "r2"}},
    ]
    per_rank = [r["cases"] for r in torchrun(WORKER, 2, json.dumps(cases), tmp_path=tmp_path, timeout=380)]
    for rank, results in enumerate(per_rank):
        for c in results:
            where = (rank, c["case"])
            assert c["models"] == ["GPTModel", "HybridModel"], where
            assert c["names"][0] == c["names"][1] and c["names"][0], where
            assert (c["lp"], c["ent"], c["loss"], c["grads"], c["params"]) == (0.0, 0.0, 0.0, 0.0, 0.0), where
            assert c["grad_scale"] > 0 and c["loss_value"] != 0, where  # (something was compared)
            if c["case"]["family"] == "qwen3_moe":  # the replay ran on both: every token x layer covered
                assert c["routing"][0] == c["routing"][1] and c["routing"][1]["routing_coverage"] == 1.0, where
