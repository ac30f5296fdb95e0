"""Qwen3 HF config -> :class:`GPTFamilyConfig`.

Qwen3: per-head RMS QK-norm (``q_norm``/``k_norm`` -> ``q_layernorm``/``k_layernorm``), an
explicit ``head_dim`` (may differ from hidden/heads), no biases. Left out: ``attention_bias=True``
(it also biases o_proj) and sliding windows -> NotImplementedError.
"""
from __future__ import annotations

from ..family import GPTFamilyConfig, _get, base_family_config


def from_hf_config(hf_config, spec: str = "local", family: str = "qwen3") -> GPTFamilyConfig:
    if _get(hf_config, "attention_bias", False):
        raise NotImplementedError(f"{family}: attention_bias=True is not supported (o_proj bias)")
    return base_family_config(hf_config, family, spec, qk_layernorm=True)
