"""Llama HF <-> Megatron per-layer name table (dense attention + SwiGLU, no biases, no QK-norm)."""
from __future__ import annotations

from ..family import GPTFamilyConfig
from ..names import LayerMapping, dense_layer_mapping


def layer_mapping(cfg: GPTFamilyConfig) -> LayerMapping:
    return dense_layer_mapping(cfg)
