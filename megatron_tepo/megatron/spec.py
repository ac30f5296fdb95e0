"""The layer spec of the actor's decoder layers, chosen the way megatron-core chooses one: by a
backend that answers which module fills each slot of megatron's own spec functions.

* ``te`` -- Transformer Engine's spec (``get_gpt_layer_with_transformer_engine_spec``); TE folds the
  pre-norms into the following linear's ``layer_norm_weight``, so the HF mapping's norm names follow
  it (:attr:`GPTFamilyConfig.spec` is ``"te"``).
* ``sdpa`` -- megatron's local spec with :class:`SDPABackend`, whose core attention is
  :class:`~megatron_tepo.megatron.attention.SDPACoreAttention` (its packed mode given as the
  module's own constructor argument, through the ``ModuleSpec``'s params).
* ``unfused`` -- megatron's local spec as it ships (``DotProductAttention``).

:func:`layer_spec` builds a fresh spec per call: nothing is changed after the model is built.
Left out: inference / kitchen / MLA specs.
"""
from __future__ import annotations

import importlib.util
from megatron_tepo.models.common import GPTFamilyConfig

__all__ = ["ATTENTIONS", "te_available", "family_spec_name", "layer_spec", "SDPABackend"]

#: the actor's attention implementations (``actor.attention`` once ``auto`` is resolved)
ATTENTIONS = ("te", "sdpa", "unfused")


def te_available() -> bool:
    """True when ``transformer_engine`` can be imported (never on a CPU-only torch)."""
    if importlib.util.find_spec("transformer_engine") is None:
        return False
    try:
        import transformer_engine.pytorch  # noqa: F401
    except Exception:  # a broken/CUDA-less install counts as absent
        return False
    return True


def family_spec_name(attention: str) -> str:
    """The HF mapping's spec name (``te`` / ``local``) for a resolved ``actor.attention``."""
    if attention not in ATTENTIONS:
        raise ValueError(f"actor.attention: {attention!r} (resolved) must be one of {list(ATTENTIONS)}")
    return "te" if attention == "te" else "local"


class SDPABackend:
    """The core-attention answer of megatron's local backend (``LocalSpecProvider.core_attention``),
    with torch SDPA in place of ``DotProductAttention``; every other slot stays the local one."""

    def __init__(self, packed_attention: str = "loop"):
        self.packed_attention = packed_attention

    def core_attention(self):
        from megatron.core.transformer.spec_utils import ModuleSpec

        from megatron_tepo.megatron.attention import SDPACoreAttention

        return ModuleSpec(module=SDPACoreAttention, params={"packed_attention": self.packed_attention})


def layer_spec(cfg: GPTFamilyConfig, attention: str, *, packed_attention: str = "loop",
               moe_grouped_gemm: bool = False):
    """The ``ModuleSpec`` of one decoder layer for the resolved ``attention`` (te / sdpa / unfused);
    the family's part (experts, QK-norm) from :meth:`GPTFamilyConfig.layer_spec_kwargs`;
    ``packed_attention`` (varlen / flex / loop): how the sdpa attention runs packed (THD) input."""
    from megatron.core.models.gpt import gpt_layer_specs as specs

    if family_spec_name(attention) != cfg.spec:
        raise ValueError(f"actor.attention {attention!r} does not match the family config's spec {cfg.spec!r}")
    if attention == "te":
        if not te_available():
            raise ValueError("actor.attention: te needs transformer_engine, which is not importable here")
        return specs.get_gpt_layer_with_transformer_engine_spec(moe_grouped_gemm=moe_grouped_gemm,
                                                                **cfg.layer_spec_kwargs())
    spec = specs.get_gpt_layer_local_spec(moe_grouped_gemm=moe_grouped_gemm, normalization="RMSNorm",
                                          **cfg.layer_spec_kwargs())
    if attention == "sdpa":  # the slot megatron's local spec fills from its backend's core_attention()
        spec.submodules.self_attention.submodules.core_attention = \
            SDPABackend(packed_attention).core_attention()
    return spec
