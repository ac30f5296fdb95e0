"""Llama family (LlamaForCausalLM): config translation and HF <-> Megatron state-dict adapter."""
from ..names import FamilySpec
from .config import from_hf_config
from .state_dict_adapter import layer_mapping

SPEC = FamilySpec(name="llama", model_types=("llama",), architectures=("LlamaForCausalLM",),
                  from_hf_config=from_hf_config, layer_mapping=layer_mapping)
__all__ = ["SPEC", "from_hf_config", "layer_mapping"]
