"""Qwen3-MoE family (Qwen3MoeForCausalLM): config translation and state-dict adapter."""
from .config import from_hf_config
from .state_dict_adapter import layer_mapping

FAMILY = "qwen3_moe"
MODEL_TYPES = ("qwen3_moe",)
ARCHITECTURES = ("Qwen3MoeForCausalLM",)
__all__ = ["FAMILY", "MODEL_TYPES", "ARCHITECTURES", "from_hf_config", "layer_mapping"]
