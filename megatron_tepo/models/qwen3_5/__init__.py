"""Qwen3.5 families, dense (``qwen3_5``) and MoE (``qwen3_5_moe``): Gated DeltaNet and gated
attention layers (see config.py, state_dict_adapter.py). The megatron backend builds them as
megatron's ``HybridModel`` only (megatron/hybrid.py)."""
from ..names import FamilySpec
from .config import checkpoint_naming, from_hf_config, moe_from_hf_config
from .state_dict_adapter import layer_mapping

SPEC = FamilySpec(name="qwen3_5", model_types=("qwen3_5", "qwen3_5_text"),
                  architectures=("Qwen3_5ForCausalLM", "Qwen3_5ForConditionalGeneration"),
                  from_hf_config=from_hf_config, layer_mapping=layer_mapping, checkpoint_naming=checkpoint_naming)
MOE_SPEC = FamilySpec(name="qwen3_5_moe", model_types=("qwen3_5_moe", "qwen3_5_moe_text"),
                      architectures=("Qwen3_5MoeForCausalLM", "Qwen3_5MoeForConditionalGeneration"),
                      from_hf_config=moe_from_hf_config, layer_mapping=layer_mapping,
                      checkpoint_naming=checkpoint_naming)
__all__ = ["SPEC", "MOE_SPEC", "from_hf_config", "moe_from_hf_config", "layer_mapping", "checkpoint_naming"]
