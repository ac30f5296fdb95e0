"""Qwen2 / Qwen2.5 family (Qwen2ForCausalLM): config translation and state-dict adapter."""
from ..names import FamilySpec
from .config import from_hf_config
from .state_dict_adapter import layer_mapping

SPEC = FamilySpec(name="qwen2", model_types=("qwen2",), architectures=("Qwen2ForCausalLM",),
                  from_hf_config=from_hf_config, layer_mapping=layer_mapping)
__all__ = ["SPEC", "from_hf_config", "layer_mapping"]
