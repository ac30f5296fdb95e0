"""Qwen2 HF config -> :class:`GPTFamilyConfig`.

Qwen2 always has q/k/v biases (o_proj none) and no QK-norm. Left out: sliding-window attention
(``use_sliding_window=True``) -> NotImplementedError.
"""
from __future__ import annotations

from ..family import GPTFamilyConfig, base_family_config


def from_hf_config(hf_config, spec: str = "local") -> GPTFamilyConfig:
    return base_family_config(hf_config, "qwen2", spec, qkv_bias=True)
