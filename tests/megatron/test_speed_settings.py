"""The actor's speed settings (#22 row 11) resolve per machine and reach megatron's configs.

Gradient-accumulation fusion and grouped GEMM need Transformer Engine (and, for the fusion, apex's
``fused_weight_gradient_mlp_cuda``), which cannot be installed on a CPU torch: here TE is
monkeypatched as present and the tests check that the settings reach ``TransformerConfig``
(not that the kernels run). Packed attention: varlen on CUDA in bf16, flex on CUDA in fp32, the
loop on CPU. Overlap defaults: on (``tests/megatron/test_overlap.py`` runs them over gloo).
"""
import pytest

from megatron_tepo.config import ActorConfig
from megatron_tepo.megatron import gpt, resolve
from megatron_tepo.models import family_config_from_hf
from tests.megatron.helpers import tiny_hf_config


@pytest.fixture
def with_te(monkeypatch):
    """TE as present, to megatron's config checks as well: its fused RoPE (which the te spec
    always uses) stands in rope_utils, so ``TransformerConfig`` accepts ``apply_rope_fusion``."""
    from megatron.core.models.common.embeddings import rope_utils

    monkeypatch.setattr(resolve, "te_available", lambda: True)
    monkeypatch.setattr(resolve, "grad_accum_fusion_available", lambda: True)
    for name in ("fused_apply_rotary_pos_emb", "fused_apply_rotary_pos_emb_thd"):
        monkeypatch.setattr(rope_utils, name, lambda *a, **k: None)


def test_defaults_are_on():
    a = ActorConfig()
    assert a.overlap_grad_reduce and a.overlap_param_gather
    assert (a.gradient_accumulation_fusion, a.moe_grouped_gemm, a.packed_attention) == ("auto",) * 3


def test_auto_resolution_per_machine(monkeypatch):
    monkeypatch.setattr(resolve, "grad_accum_fusion_available", lambda: True)
    cpu = resolve.resolve_actor_config(ActorConfig(), cuda=False, te=False)
    assert (cpu.gradient_accumulation_fusion, cpu.moe_grouped_gemm, cpu.packed_attention) == ("off", "off", "loop")
    te = resolve.resolve_actor_config(ActorConfig(), cuda=True, te=True)
    assert (te.gradient_accumulation_fusion, te.moe_grouped_gemm) == ("on", "on")
    assert te.packed_attention == ("varlen" if resolve.varlen_available() else "flex")
    assert resolve.resolve_actor_config(ActorConfig(precision="fp32"), cuda=True, te=False).packed_attention == "flex"
    monkeypatch.setattr(resolve, "grad_accum_fusion_available", lambda: False)  # TE without apex
    assert resolve.resolve_actor_config(ActorConfig(), cuda=True, te=True).gradient_accumulation_fusion == "off"


@pytest.mark.parametrize("field, value, match", [
    ("gradient_accumulation_fusion", "on", "actor.gradient_accumulation_fusion"),
    ("moe_grouped_gemm", "on", "actor.moe_grouped_gemm"),
])
def test_on_without_te_is_refused(field, value, match):
    import dataclasses

    with pytest.raises(ValueError, match=match):
        resolve.resolve_actor_config(dataclasses.replace(ActorConfig(), **{field: value}), cuda=True, te=False)


def test_grad_accum_fusion_reaches_transformer_config(with_te):
    fam = family_config_from_hf(tiny_hf_config("qwen3"), spec="te")
    cfg = gpt.transformer_config(fam, tp=1, pp=1,
                                 actor=resolve.resolve_actor_config(ActorConfig(precision="fp32", attention="te")))
    assert cfg.gradient_accumulation_fusion is True
    off = gpt.transformer_config(fam, tp=1, pp=1, actor=resolve.resolve_actor_config(ActorConfig(
        precision="fp32", attention="te", gradient_accumulation_fusion="off")))
    assert off.gradient_accumulation_fusion is False


def test_grouped_gemm_reaches_transformer_config(with_te):
    fam = family_config_from_hf(tiny_hf_config("qwen3_moe"), spec="te")
    cfg = gpt.transformer_config(fam, tp=1, pp=1,
                                 actor=resolve.resolve_actor_config(ActorConfig(precision="fp32", attention="te")))
    assert cfg.moe_grouped_gemm is True
    off = gpt.transformer_config(fam, tp=1, pp=1, actor=resolve.resolve_actor_config(ActorConfig(
        precision="fp32", attention="te", moe_grouped_gemm="off")))
    assert off.moe_grouped_gemm is False


def test_cpu_transformer_config_keeps_them_off():
    fam = family_config_from_hf(tiny_hf_config("qwen3_moe"), spec="local")
    cfg = gpt.transformer_config(fam, tp=1, pp=1,
                                 actor=resolve.resolve_actor_config(ActorConfig(precision="fp32", attention="sdpa")))
    assert cfg.gradient_accumulation_fusion is False and cfg.moe_grouped_gemm is False


def test_moe_sizes_and_the_machines_dispatcher_reach_transformer_config():
    """The sizes and router settings come from the family's MoEConfig, the token dispatcher from
    the machine (allgather on CPU: alltoall needs CUDA streams); a dense model keeps alltoall,
    which lets TransformerConfig take variable_seq_lengths."""
    actor = resolve.resolve_actor_config(ActorConfig(precision="fp32", attention="sdpa"))
    fam = family_config_from_hf(tiny_hf_config("qwen3_moe"), spec="local")
    cfg = gpt.transformer_config(fam, tp=1, pp=1, actor=actor)
    assert (cfg.num_moe_experts, cfg.moe_router_topk, cfg.moe_ffn_hidden_size) == (4, 2, 32)
    assert cfg.moe_token_dispatcher_type == "allgather" and cfg.moe_permute_fusion is False
    assert resolve.moe_token_dispatcher(cuda=True) == "alltoall" and resolve.moe_token_dispatcher(cuda=False) == "allgather"
    dense = gpt.transformer_config(family_config_from_hf(tiny_hf_config("qwen3"), spec="local"), tp=1, pp=1,
                                   actor=actor)
    assert dense.num_moe_experts is None and dense.moe_token_dispatcher_type == "alltoall"


def test_grouped_expert_names_map_to_sequential_names():
    from megatron_tepo.megatron.sharding import to_global_name

    offsets, experts = {0: 2}, {0: [4, 5]}
    assert to_global_name("decoder.layers.0.mlp.experts.linear_fc1.weight1", offsets, experts) == \
        "decoder.layers.2.mlp.experts.local_experts.5.linear_fc1.weight"
    assert to_global_name("decoder.layers.0.mlp.experts.local_experts.0.linear_fc2.weight", offsets, experts) == \
        "decoder.layers.2.mlp.experts.local_experts.4.linear_fc2.weight"


def test_bad_value_names_the_field():
    from megatron_tepo.config import ConfigError, from_dict

    with pytest.raises(ConfigError, match="actor.packed_attention"):
        from_dict({"actor": {"packed_attention": "fast"}})


def test_auto_is_decided_once_before_anything_is_built():
    fam = family_config_from_hf(tiny_hf_config("qwen3"), spec="local")
    with pytest.raises(ValueError, match=r"actor.attention, .*actor.packed_attention, actor.model_builder: still 'auto'"):
        gpt.transformer_config(fam, tp=1, pp=1, actor=ActorConfig(precision="fp32"))
    assert resolve.require_resolved(resolve.FP32_ACTOR) is resolve.FP32_ACTOR


def test_the_layer_spec_answers_the_attention():
    """sdpa: the core-attention slot holds SDPACoreAttention with its packed mode as a constructor
    argument (nothing is set on the TransformerConfig); unfused: megatron's own; te: refused here."""
    from megatron.core.transformer.dot_product_attention import DotProductAttention

    from megatron_tepo.megatron.attention import SDPACoreAttention
    from megatron_tepo.megatron.spec import layer_spec

    fam = family_config_from_hf(tiny_hf_config("qwen3"), spec="local")
    core = layer_spec(fam, "sdpa", packed_attention="flex").submodules.self_attention.submodules.core_attention
    assert core.module is SDPACoreAttention and core.params == {"packed_attention": "flex"}
    assert layer_spec(fam, "unfused").submodules.self_attention.submodules.core_attention is DotProductAttention
    with pytest.raises(ValueError, match="does not match the family config's spec 'local'"):
        layer_spec(fam, "te")
    with pytest.raises(ValueError, match="actor.attention: 'flash'"):
        layer_spec(fam, "flash")


def test_te_rope_fusion_follows_te_and_an_empty_fusion_is_not_used(with_te):
    """TE's fused RoPE is on with the te spec whatever ``fusions`` says, never without TE;
    ``fusions: on`` fuses SwiGLU but not bias-dropout-add, which without a bias or dropout would be
    a compiled plain add."""
    fam_te = family_config_from_hf(tiny_hf_config("qwen3"), spec="te")
    te_off = gpt.transformer_config(fam_te, tp=1, pp=1, actor=resolve.resolve_actor_config(
        ActorConfig(precision="fp32", attention="te", fusions="off"), cuda=True))
    assert te_off.apply_rope_fusion is True and te_off.bias_activation_fusion is False
    fam = family_config_from_hf(tiny_hf_config("qwen2"), spec="local")  # Qwen2: a QKV bias, none after
    on = gpt.transformer_config(fam, tp=1, pp=1, actor=resolve.resolve_actor_config(
        ActorConfig(precision="fp32", attention="sdpa", fusions="on"), cuda=True))
    assert on.apply_rope_fusion is False
    assert on.bias_activation_fusion is True and on.bias_dropout_fusion is False


def test_weights_to_load_on_a_gpu_are_made_there():
    """Issue #32 row 6: with ``use_cpu_initialization`` on, megatron-core's TE wrappers build every
    linear's full fp32 master on the host even with the init off (about 50 GB per rank for a 14B).
    The actor on a GPU with weights to load makes its parameters there; a random init stays on the
    CPU (the same init at every TP size), and so does everything on a CPU and the converter's
    skeletons (``on_gpu`` off)."""
    from megatron_tepo.actor.actor import actor_transformer_config
    from megatron_tepo.layout import ParallelLayout

    fam = family_config_from_hf(tiny_hf_config("qwen3"), spec="local")
    actor = resolve.resolve_actor_config(ActorConfig(precision="fp32", attention="sdpa"), cuda=False)

    def flags(**kw):
        c = actor_transformer_config(fam, ParallelLayout(), actor, **kw)
        return c.use_cpu_initialization, c.perform_initialization

    assert flags(initialize=False, on_gpu=True) == (False, False)
    assert flags(initialize=True, on_gpu=True) == (True, True)
    assert flags(initialize=False, on_gpu=False) == (True, False)
    assert gpt.transformer_config(fam, tp=1, pp=1, actor=actor, initialize=False).use_cpu_initialization is True
