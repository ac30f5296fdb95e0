"""Qwen3 dense family (Qwen3ForCausalLM): config translation and state-dict adapter."""
from .config import from_hf_config
from .state_dict_adapter import layer_mapping

FAMILY = "qwen3"
MODEL_TYPES = ("qwen3",)
ARCHITECTURES = ("Qwen3ForCausalLM",)
__all__ = ["FAMILY", "MODEL_TYPES", "ARCHITECTURES", "from_hf_config", "layer_mapping"]
