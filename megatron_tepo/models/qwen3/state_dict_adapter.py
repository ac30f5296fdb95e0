"""Qwen3 HF <-> Megatron per-layer name table: dense layer + QK-norm weights."""
from __future__ import annotations

from ..family import GPTFamilyConfig
from ..names import LayerMapping, dense_layer_mapping


def layer_mapping(cfg: GPTFamilyConfig) -> LayerMapping:
    assert cfg.qk_layernorm, "qwen3 always has QK-norm"
    return dense_layer_mapping(cfg)
