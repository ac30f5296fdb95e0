"""Choose the megatron layer spec: Transformer Engine when importable, megatron's local one else.

The spec name ("te" / "local") is also what the HF mapping needs (:attr:`GPTFamilyConfig.spec`):
TE folds the pre-norms into the following linear's ``layer_norm_weight``.
Left out: inference / kitchen / MLA specs.
"""
from __future__ import annotations

import importlib.util
from typing import Optional

from .common import GPTFamilyConfig


def te_available() -> bool:
    """True when ``transformer_engine`` can be imported (never on a CPU-only torch)."""
    if importlib.util.find_spec("transformer_engine") is None:
        return False
    try:
        import transformer_engine.pytorch  # noqa: F401
    except Exception:  # a broken/CUDA-less install counts as absent
        return False
    return True


def default_spec() -> str:
    return "te" if te_available() else "local"


def get_layer_spec(cfg: GPTFamilyConfig, num_experts: Optional[int] = None,
                   moe_grouped_gemm: bool = False):
    """The ``ModuleSpec`` of one decoder layer for ``cfg.spec``."""
    from megatron.core.models.gpt import gpt_layer_specs as specs

    if cfg.spec == "te":
        if not te_available():
            raise ValueError("spec='te' needs transformer_engine, which is not importable here")
        return specs.get_gpt_layer_with_transformer_engine_spec(
            num_experts=num_experts, moe_grouped_gemm=moe_grouped_gemm,
            qk_layernorm=cfg.qk_layernorm)
    return specs.get_gpt_layer_local_spec(
        num_experts=num_experts, moe_grouped_gemm=moe_grouped_gemm,
        qk_layernorm=cfg.qk_layernorm, normalization="RMSNorm")
