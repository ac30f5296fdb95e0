"""Qwen3.5 HF <-> Megatron per-layer name tables: a table per decoder layer (:class:`LayerMapping`'s
``by_layer``), its token mixer by its ``layer_types`` entry, then its MLP.

Gated DeltaNet layer (megatron's ``GatedDeltaNet`` in ``self_attention``)::

  input_layernorm.weight            <-> input_layernorm.weight (te: self_attention.in_proj.layer_norm_weight)
  linear_attn.in_proj_qkv / _z / _b / _a.weight
                                    <-> self_attention.in_proj.weight  (rows: q, k, v, z, b, a)
  linear_attn.conv1d.weight         <-> self_attention.conv1d.weight   ([q; k; v] channels, [d, 1, w])
  linear_attn.A_log, .dt_bias       <-> self_attention.A_log, .dt_bias
  linear_attn.norm.weight           <-> self_attention.out_norm.weight (a plain RMSNorm: weight 1 at init)
  linear_attn.out_proj.weight       <-> self_attention.out_proj.weight

Tensor parallelism splits ``in_proj`` and ``conv1d`` section by section (each rank holds its heads'
share of each of q, k, v, ...: ``tp_sections``), ``A_log`` / ``dt_bias`` by value head.

Gated attention layer: Qwen3's names (:func:`~..names.attention_mapping`), but ``q_proj`` holds each
head's query then its output gate: ``linear_qkv`` is a ``qgkv`` group (per query group: its
queries, their gates, its key, its value: megatron's ``attention_output_gate`` layout).

MLP: dense (Qwen3's SwiGLU names), or MoE: Qwen3-MoE's router and per-expert names (one tensor per
expert, as ``save_pretrained`` writes them; ``{e}`` the global expert index -- a checkpoint that
stores them stacked, as the published ones do, is read and written in these names by its
:class:`~..names.CheckpointNaming`, ``stacked_experts``) and the shared expert::

  mlp.shared_expert.gate_proj / up_proj.weight <-> mlp.shared_experts.linear_fc1.weight
  mlp.shared_expert.down_proj.weight           <-> mlp.shared_experts.linear_fc2.weight
  mlp.shared_expert_gate.weight                <-> mlp.shared_experts.gate_weight ([1, hidden])

Every norm but the Gated DeltaNet's output norm stores ``w - 1`` on both sides (zero-centred):
names only, no arithmetic, so the round trip is bit for bit.
"""
from __future__ import annotations

from megatron_tepo.layer_kinds import ATTENTION, GATED_DELTANET

from ..family import GPTFamilyConfig
from ..names import FusedGroup, LayerMapping, attention_mapping, norm_names


def gdn_mapping(cfg: GPTFamilyConfig) -> LayerMapping:
    la = cfg.linear_attention
    in_norm = "self_attention.in_proj.layer_norm_weight" if cfg.spec == "te" else "input_layernorm.weight"
    renames = {"input_layernorm.weight": in_norm,
               "linear_attn.conv1d.weight": "self_attention.conv1d.weight",
               "linear_attn.A_log": "self_attention.A_log",
               "linear_attn.dt_bias": "self_attention.dt_bias",
               "linear_attn.norm.weight": "self_attention.out_norm.weight",
               "linear_attn.out_proj.weight": "self_attention.out_proj.weight"}
    fused = (FusedGroup("self_attention.in_proj.weight",
                        tuple(f"linear_attn.in_proj_{p}.weight" for p in ("qkv", "z", "b", "a")), "gdn_in_proj"),)
    sections = {"self_attention.in_proj.weight": la.in_proj_sections(),
                "self_attention.conv1d.weight": la.conv_sections()}
    return LayerMapping(renames, fused, sections)


def gated_attention_mapping(cfg: GPTFamilyConfig) -> LayerMapping:
    renames, fused = attention_mapping(cfg)
    fused = tuple(FusedGroup(g.megatron, g.hf, "qgkv") if g.kind == "qkv" else g for g in fused)
    return LayerMapping(renames, fused)


#: each token mixer of the layer-kind table (:mod:`megatron_tepo.layer_kinds`, by name) -> its name table
MIXER_MAPPINGS = {GATED_DELTANET.name: gdn_mapping, ATTENTION.name: gated_attention_mapping}


def mlp_mapping(cfg: GPTFamilyConfig) -> LayerMapping:
    if cfg.moe is None:
        _, post = norm_names(cfg.spec)
        return LayerMapping({"post_attention_layernorm.weight": post, "mlp.down_proj.weight": "mlp.linear_fc2.weight"},
                            (FusedGroup("mlp.linear_fc1.weight", ("mlp.gate_proj.weight", "mlp.up_proj.weight"),
                                        "gate_up"),))
    renames = {"post_attention_layernorm.weight": "pre_mlp_layernorm.weight", "mlp.gate.weight": "mlp.router.weight"}
    fused = []
    for e in range(cfg.moe.num_experts):
        renames[f"mlp.experts.{e}.down_proj.weight"] = f"mlp.experts.local_experts.{e}.linear_fc2.weight"
        fused.append(FusedGroup(f"mlp.experts.local_experts.{e}.linear_fc1.weight",
                                (f"mlp.experts.{e}.gate_proj.weight", f"mlp.experts.{e}.up_proj.weight"), "gate_up"))
    if cfg.moe.shared_expert_ffn_hidden_size:
        renames["mlp.shared_expert.down_proj.weight"] = "mlp.shared_experts.linear_fc2.weight"
        fused.append(FusedGroup("mlp.shared_experts.linear_fc1.weight",
                                ("mlp.shared_expert.gate_proj.weight", "mlp.shared_expert.up_proj.weight"), "gate_up"))
        if cfg.moe.shared_expert_gate:
            renames["mlp.shared_expert_gate.weight"] = "mlp.shared_experts.gate_weight"
    return LayerMapping(renames, tuple(fused))


def _join(*tables: LayerMapping) -> LayerMapping:
    renames, fused, sections = {}, (), {}
    for t in tables:
        renames.update(t.renames)
        fused += t.fused
        sections.update(t.tp_sections)
    return LayerMapping(renames, fused, sections)


def layer_mapping(cfg: GPTFamilyConfig) -> LayerMapping:
    if cfg.layer_types is None or cfg.linear_attention is None:
        raise ValueError(f"{cfg.family}: the Qwen3.5 mapping needs a family config with layer_types and "
                         f"linear_attention set")
    mlp = mlp_mapping(cfg)
    tables = {kind: _join(mixer(cfg), mlp) for kind, mixer in MIXER_MAPPINGS.items()}
    return LayerMapping({}, (), by_layer=tuple(tables[cfg.layer_kind(i).name] for i in range(cfg.num_layers)))
