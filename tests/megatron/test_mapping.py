"""HF <-> Megatron mapping: round trips bit for bit, fused layouts, registry and error messages."""
import pytest
import torch

from megatron_tepo.models import (
    FAMILIES,
    GPTFamilyConfig,
    MoEConfig,
    family_config_from_hf,
    hf_to_megatron,
    layer_mapping,
    megatron_to_hf,
    resolve_family,
)
from megatron_tepo.models.fused import fuse_gate_up, fuse_qkv, split_gate_up, split_qkv
from megatron_tepo.models.qwen3_moe.config import moe_config_from_hf
from megatron_tepo.megatron.family_kwargs import gpt_model_kwargs, layer_spec_kwargs, transformer_config_kwargs
from megatron_tepo.megatron.sharding import shard_tensor, unshard_tensors
from tests.megatron.helpers import hf_state, make_hf_model, tiny_hf_config


@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3", "qwen3_moe"])
@pytest.mark.parametrize("tie", [False, True])
@pytest.mark.parametrize("spec", ["local", "te"])
def test_round_trip_bit_exact(family, tie, spec):
    hf_cfg = tiny_hf_config(family, tie=tie)
    state = hf_state(make_hf_model(hf_cfg))
    cfg = family_config_from_hf(hf_cfg, spec=spec)
    mg = dict(hf_to_megatron(state, cfg))
    back = dict(megatron_to_hf(mg, cfg))
    assert set(back) == set(state)
    for name, tensor in state.items():
        assert torch.equal(back[name], tensor), name
    # names depend on the spec; exactly one Megatron tensor per fused group
    n = cfg.num_layers
    assert ("output_layer.weight" in mg) == (not tie)
    if family == "qwen3_moe":
        assert "decoder.layers.0.mlp.router.weight" in mg
        assert "decoder.layers.3.mlp.experts.local_experts.3.linear_fc1.weight" in mg
        assert "decoder.layers.0.pre_mlp_layernorm.weight" in mg  # never fused for MoE
    elif spec == "te":
        assert "decoder.layers.0.self_attention.linear_qkv.layer_norm_weight" in mg
        assert "decoder.layers.0.mlp.linear_fc1.layer_norm_weight" in mg
        assert not any("pre_mlp_layernorm" in k for k in mg)
    else:
        assert "decoder.layers.0.input_layernorm.weight" in mg
        assert "decoder.layers.0.pre_mlp_layernorm.weight" in mg
    if spec == "te":
        assert not any("input_layernorm" in k for k in mg)
    assert ("decoder.layers.0.self_attention.linear_qkv.bias" in mg) == (family == "qwen2")
    assert ("decoder.layers.0.self_attention.q_layernorm.weight" in mg) == family.startswith("qwen3")
    per_layer = sum(1 for k in mg if k.startswith("decoder.layers.0."))
    assert sum(1 for k in mg if k.startswith("decoder.layers.")) == n * per_layer


def test_tied_lm_head_alias_accepted_and_checked():
    hf_cfg = tiny_hf_config("qwen3", tie=True)
    model = make_hf_model(hf_cfg)
    cfg = family_config_from_hf(hf_cfg, spec="local")
    full = {k: v for k, v in model.state_dict().items()}  # includes the tied lm_head.weight
    assert "lm_head.weight" in full
    mg = dict(hf_to_megatron(full, cfg))
    assert "output_layer.weight" not in mg
    bad = dict(full)
    bad["lm_head.weight"] = bad["lm_head.weight"] + 1
    with pytest.raises(ValueError, match="lm_head.weight"):
        dict(hf_to_megatron(bad, cfg))


def test_errors_name_the_tensor():
    hf_cfg = tiny_hf_config("qwen2")
    cfg = family_config_from_hf(hf_cfg, spec="local")
    state = hf_state(make_hf_model(hf_cfg))
    extra = dict(state, **{"model.layers.0.self_attn.rotary.weight": torch.zeros(1)})
    with pytest.raises(ValueError, match=r"model\.layers\.0\.self_attn\.rotary\.weight"):
        dict(hf_to_megatron(extra, cfg))
    missing = dict(state)
    del missing["model.layers.3.self_attn.k_proj.bias"]
    with pytest.raises(ValueError, match=r"model\.layers\.3\.self_attn\.k_proj\.bias"):
        dict(hf_to_megatron(missing, cfg))
    twice = list(state.items()) + [("model.norm.weight", state["model.norm.weight"])]
    with pytest.raises(ValueError, match=r"model\.norm\.weight.*twice"):
        dict(hf_to_megatron(twice, cfg))
    with pytest.raises(ValueError, match="decoder.layers.0.foo"):
        dict(megatron_to_hf({"decoder.layers.0.foo": torch.zeros(1)}, cfg))


def test_qkv_layout_is_grouped_per_query_group():
    nh, ng, hd, h = 4, 2, 3, 5
    q = torch.arange(nh * hd * h, dtype=torch.float32).reshape(nh * hd, h)
    k = -torch.arange(1, ng * hd * h + 1, dtype=torch.float32).reshape(ng * hd, h)
    v = 1000 + torch.arange(ng * hd * h, dtype=torch.float32).reshape(ng * hd, h)
    qkv = fuse_qkv(q, k, v, ng, hd)
    rows = qkv.reshape(ng, (nh // ng + 2) * hd, h)
    # group 0 = query heads 0,1, key head 0, value head 0
    assert torch.equal(rows[0, : 2 * hd], q[: 2 * hd])
    assert torch.equal(rows[0, 2 * hd: 3 * hd], k[:hd])
    assert torch.equal(rows[0, 3 * hd:], v[:hd])
    assert torch.equal(rows[1, : 2 * hd], q[2 * hd:])
    for a, b in zip(split_qkv(qkv, nh, ng, hd), (q, k, v)):
        assert torch.equal(a, b)
    bias = fuse_qkv(q[:, 0], k[:, 0], v[:, 0], ng, hd)
    assert torch.equal(bias, qkv[:, 0])
    gate, up = torch.randn(6, 5), torch.randn(6, 5)
    assert all(torch.equal(a, b) for a, b in zip(split_gate_up(fuse_gate_up(gate, up)), (gate, up)))


@pytest.mark.parametrize("stride", [1, 2])
def test_shard_unshard_with_stride(stride):
    full = torch.arange(48.0).reshape(12, 4)
    shards = [shard_tensor(full, 0, stride, r, 3) for r in range(3)]
    if stride == 2:  # fc1 = [gate; up]: rank r holds [gate_r; up_r]
        gate, up = full[:6], full[6:]
        assert torch.equal(shards[1], torch.cat([gate[2:4], up[2:4]]))
    assert torch.equal(unshard_tensors(shards, 0, stride), full)
    cols = [shard_tensor(full, 1, 1, r, 2) for r in range(2)]
    assert torch.equal(unshard_tensors(cols, 1, 1), full)


def test_qwen3_moe_config_translation():
    cfg = family_config_from_hf(tiny_hf_config("qwen3_moe"), spec="local")
    assert cfg.moe == MoEConfig(num_experts=4, router_topk=2, ffn_hidden_size=32, router_pre_softmax=False)
    assert cfg.num_experts == 4 and cfg.dims().num_experts == 4
    kw = transformer_config_kwargs(cfg)
    assert (kw["num_moe_experts"], kw["moe_router_topk"], kw["moe_ffn_hidden_size"]) == (4, 2, 32)
    assert kw["moe_router_pre_softmax"] is False and kw["moe_router_load_balancing_type"] == "none"
    assert "moe_token_dispatcher_type" not in kw  # the machine's choice: megatron.gpt
    assert layer_spec_kwargs(cfg) == {"num_experts": 4, "qk_layernorm": True}
    with pytest.raises(NotImplementedError, match="mlp_only_layers"):
        family_config_from_hf(tiny_hf_config("qwen3_moe", mlp_only_layers=[1]), spec="local")


def test_dense_config_has_no_moe():
    cfg = family_config_from_hf(tiny_hf_config("qwen3"), spec="local")
    assert cfg.moe is None and cfg.num_experts == 0 and cfg.dims().num_experts == 0
    assert not any(k.startswith(("moe_", "num_moe")) for k in transformer_config_kwargs(cfg))
    assert layer_spec_kwargs(cfg) == {"num_experts": None, "qk_layernorm": True}


def test_moe_config_from_a_raw_hf_dict():
    """config.json as the hub writes it (``num_experts``) or as transformers >= 5 saves it
    (``num_local_experts``); ``norm_topk_prob=false`` is softmax over all experts before top-k."""
    raw = {"num_local_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 48, "norm_topk_prob": False}
    assert moe_config_from_hf(raw) == MoEConfig(8, 2, 48, router_pre_softmax=True)
    hub = dict(raw, num_experts=8, norm_topk_prob=True)
    del hub["num_local_experts"]
    assert moe_config_from_hf(hub).router_pre_softmax is False
    with pytest.raises(ValueError, match="neither num_experts nor num_local_experts"):
        moe_config_from_hf({"num_experts_per_tok": 2, "moe_intermediate_size": 48})
    with pytest.raises(ValueError, match="router_topk=9 > num_experts=8"):
        moe_config_from_hf(dict(raw, num_experts_per_tok=9))


@pytest.mark.parametrize("bad, match", [
    (dict(num_experts=0), r"num_experts=0 must be integers >= 1"),
    (dict(ffn_hidden_size=None), r"ffn_hidden_size=None must be integers >= 1"),
    (dict(router_score_function="softmax_topk"), r"router_score_function must be one of"),
])
def test_moe_config_refuses_what_megatron_cannot_build(bad, match):
    with pytest.raises(ValueError, match=match):
        MoEConfig(**{**dict(num_experts=4, router_topk=2, ffn_hidden_size=8), **bad})


@pytest.mark.parametrize("family", ["qwen3", "qwen3_moe"])
def test_family_config_as_dict_round_trip(family):
    """What checkpoint sidecars record (``family_config``) reads back to the same config."""
    import json

    cfg = family_config_from_hf(tiny_hf_config(family), spec="te")
    d = json.loads(json.dumps(cfg.as_dict()))
    assert ("moe" in d) and (d["moe"] is None) == (family == "qwen3")
    assert GPTFamilyConfig.from_dict(d) == cfg
    with pytest.raises(ValueError, match=r"unknown field\(s\) \['extra'\]"):
        GPTFamilyConfig.from_dict(dict(d, extra={}))


def test_registry_by_model_type_and_architecture():
    assert resolve_family({"model_type": "qwen3"}).name == "qwen3"
    assert resolve_family({"model_type": "x", "architectures": ["LlamaForCausalLM"]}).name == "llama"
    assert all(FAMILIES[name].name == name for name in FAMILIES)
    with pytest.raises(ValueError, match=r"GPT2LMHeadModel.*supported.*Qwen3ForCausalLM"):
        resolve_family({"model_type": "gpt2", "architectures": ["GPT2LMHeadModel"]})


def test_config_translation():
    cfg = family_config_from_hf(tiny_hf_config("qwen3", tie=True), spec="local")
    assert (cfg.head_dim, cfg.qk_layernorm, cfg.qkv_bias, cfg.tie_word_embeddings) == (32, True, False, True)
    kw = transformer_config_kwargs(cfg)
    assert kw["kv_channels"] == 32 and kw["num_query_groups"] == 2 and kw["qk_layernorm"]
    assert gpt_model_kwargs(cfg)["rotary_base"] == 1000000
    q2 = family_config_from_hf(tiny_hf_config("qwen2"), spec="local")
    assert q2.qkv_bias and not q2.qk_layernorm and q2.head_dim == 16
    rope = {"rope_type": "llama3", "rope_theta": 5e5, "factor": 8.0, "low_freq_factor": 1.0,
            "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}
    ll = family_config_from_hf(tiny_hf_config("llama", rope_parameters=rope), spec="local")
    assert gpt_model_kwargs(ll)["rope_scaling"] and gpt_model_kwargs(ll)["rope_scaling_factor"] == 8.0
    with pytest.raises(NotImplementedError, match="low_freq_factor"):
        family_config_from_hf(tiny_hf_config("llama", rope_parameters=dict(rope, low_freq_factor=2.0)),
                              spec="local")
    with pytest.raises(NotImplementedError, match="attention_bias"):
        family_config_from_hf(tiny_hf_config("llama", attention_bias=True), spec="local")


def test_layer_mapping_tables_differ_per_family():
    q3 = layer_mapping(family_config_from_hf(tiny_hf_config("qwen3"), spec="local"))
    ll = layer_mapping(family_config_from_hf(tiny_hf_config("llama"), spec="local"))
    assert "self_attn.q_norm.weight" in q3.renames and "self_attn.q_norm.weight" not in ll.renames
