"""Qwen3-MoE HF <-> Megatron per-layer name table (HF checkpoint names, one tensor per expert).

  mlp.gate.weight                               <-> mlp.router.weight
  mlp.experts.{e}.gate_proj / up_proj.weight    <-> mlp.experts.local_experts.{e}.linear_fc1.weight
  mlp.experts.{e}.down_proj.weight              <-> mlp.experts.local_experts.{e}.linear_fc2.weight
  post_attention_layernorm.weight               <-> pre_mlp_layernorm.weight (a separate norm in
                                                    both specs: MoE layers do not fuse it)

``{e}`` is the GLOBAL expert index; :mod:`..sharding` maps megatron's per-rank ``local_experts``
index through the MoE layer's ``local_expert_indices`` (expert parallelism). transformers >= 5
keeps experts fused in memory (``mlp.experts.gate_up_proj`` [E, 2I, H]); the names here are the
checkpoint's (what safetensors files and SGLang use).
"""
from __future__ import annotations

from ..family import GPTFamilyConfig
from ..names import FusedGroup, LayerMapping, attention_mapping


def layer_mapping(cfg: GPTFamilyConfig) -> LayerMapping:
    renames, fused = attention_mapping(cfg)
    renames = {**renames,
               "post_attention_layernorm.weight": "pre_mlp_layernorm.weight",
               "mlp.gate.weight": "mlp.router.weight"}
    experts = []
    if cfg.moe is None:
        raise ValueError(f"{cfg.family}: the MoE layer mapping needs a family config with moe set")
    for e in range(cfg.moe.num_experts):
        renames[f"mlp.experts.{e}.down_proj.weight"] = f"mlp.experts.local_experts.{e}.linear_fc2.weight"
        experts.append(FusedGroup(f"mlp.experts.local_experts.{e}.linear_fc1.weight",
                                  (f"mlp.experts.{e}.gate_proj.weight", f"mlp.experts.{e}.up_proj.weight"),
                                  "gate_up"))
    return LayerMapping(renames, fused + tuple(experts))
