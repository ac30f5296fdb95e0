"""Qwen2 / Qwen2.5 family (Qwen2ForCausalLM): config translation and state-dict adapter."""
from .config import from_hf_config
from .state_dict_adapter import layer_mapping

FAMILY = "qwen2"
MODEL_TYPES = ("qwen2",)
ARCHITECTURES = ("Qwen2ForCausalLM",)
__all__ = ["FAMILY", "MODEL_TYPES", "ARCHITECTURES", "from_hf_config", "layer_mapping"]
