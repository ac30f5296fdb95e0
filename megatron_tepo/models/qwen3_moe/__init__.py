"""Qwen3-MoE family (Qwen3MoeForCausalLM): config translation and state-dict adapter."""
from ..names import FamilySpec
from .config import from_hf_config
from .state_dict_adapter import layer_mapping

SPEC = FamilySpec(name="qwen3_moe", model_types=("qwen3_moe",), architectures=("Qwen3MoeForCausalLM",),
                  from_hf_config=from_hf_config, layer_mapping=layer_mapping)
__all__ = ["SPEC", "from_hf_config", "layer_mapping"]
