"""Qwen3 dense family (Qwen3ForCausalLM): config translation and state-dict adapter."""
from ..names import FamilySpec
from .config import from_hf_config
from .state_dict_adapter import layer_mapping

SPEC = FamilySpec(name="qwen3", model_types=("qwen3",), architectures=("Qwen3ForCausalLM",),
                  from_hf_config=from_hf_config, layer_mapping=layer_mapping)
__all__ = ["SPEC", "from_hf_config", "layer_mapping"]
