"""The model's shape as the memory arithmetic sees it (:class:`ModelShape`), read from a Hugging
Face ``config.json`` through :func:`megatron_tepo.models.family_config_from_hf`, the project's one
reading of HF configs (:func:`model_shape`). The letters (``h``, ``F``, ``nh``, ...) are those of
docs/LAUNCH.md. Left out: anything of ranks or bytes (:mod:`megatron_tepo.launch.memory`)."""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Dict, Union

from megatron_tepo.layout import ModelDims

__all__ = ["ModelShape", "model_shape"]


@dataclass(frozen=True)
class ModelShape:
    """The numbers the memory arithmetic needs (from :class:`GPTFamilyConfig`)."""

    num_layers: int
    hidden: int
    ffn: int
    heads: int
    kv_groups: int
    head_dim: int
    vocab: int
    tied: bool
    qkv_bias: bool = False
    qk_norm: bool = False
    num_experts: int = 0
    topk: int = 0
    moe_ffn: int = 0
    family: str = ""

    @property
    def is_moe(self) -> bool:
        return self.num_experts > 0

    def dims(self) -> ModelDims:
        """The sizes the layout rules read (:func:`megatron_tepo.layout.validate_layout`)."""
        return ModelDims(num_attention_heads=self.heads, num_key_value_heads=self.kv_groups, vocab_size=self.vocab,
                         intermediate_size=self.ffn, num_hidden_layers=self.num_layers,
                         num_experts=self.num_experts)


def model_shape(hf_config: Union[Dict[str, Any], str, Path]) -> ModelShape:
    """Read an HF config (dict or ``config.json`` path) through ``family_config_from_hf``."""
    if not isinstance(hf_config, dict):
        hf_config = json.loads(Path(hf_config).read_text(encoding="utf-8"))
    from megatron_tepo.models import family_config_from_hf

    fam = family_config_from_hf(hf_config, spec="local")
    moe = fam.moe
    return ModelShape(
        num_layers=fam.num_layers, hidden=fam.hidden_size, ffn=fam.ffn_hidden_size,
        heads=fam.num_attention_heads, kv_groups=fam.num_query_groups, head_dim=fam.head_dim,
        vocab=fam.vocab_size, tied=fam.tie_word_embeddings, qkv_bias=fam.qkv_bias,
        qk_norm=fam.qk_layernorm, num_experts=fam.num_experts, topk=moe.router_topk if moe else 0,
        moe_ffn=moe.ffn_hidden_size if moe else 0, family=fam.family)
