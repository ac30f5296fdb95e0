"""Llama family (LlamaForCausalLM): config translation and HF <-> Megatron state-dict adapter."""
from .config import from_hf_config
from .state_dict_adapter import layer_mapping

FAMILY = "llama"
MODEL_TYPES = ("llama",)
ARCHITECTURES = ("LlamaForCausalLM",)
__all__ = ["FAMILY", "MODEL_TYPES", "ARCHITECTURES", "from_hf_config", "layer_mapping"]
