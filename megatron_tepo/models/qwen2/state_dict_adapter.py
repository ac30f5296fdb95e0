"""Qwen2 HF <-> Megatron per-layer name table: dense layer + fused q/k/v bias (``linear_qkv.bias``)."""
from __future__ import annotations

from ..family import GPTFamilyConfig
from ..names import LayerMapping, dense_layer_mapping


def layer_mapping(cfg: GPTFamilyConfig) -> LayerMapping:
    assert cfg.qkv_bias, "qwen2 always has q/k/v biases"
    return dense_layer_mapping(cfg)
