"""The layer spec of the actor's decoder layers: one of megatron-core's own spec functions for the
resolved ``actor.attention``, with this project's core attention in the slot megatron provides
for it where that is the choice (megatron-core's ``ModuleSpec`` swap: the layer code is untouched).

* ``te`` -- Transformer Engine's spec (``get_gpt_layer_with_transformer_engine_spec``); TE folds the
  pre-norms into the following linear's ``layer_norm_weight``, so the HF mapping's norm names follow
  it (:attr:`GPTFamilyConfig.spec` is ``"te"``).
* ``sdpa`` -- megatron's local spec with :func:`sdpa_core_attention` in its core-attention slot:
  :class:`~megatron_tepo.megatron.attention.SDPACoreAttention` (its packed mode given as the
  module's own constructor argument, through the ``ModuleSpec``'s params).
* ``unfused`` -- megatron's local spec as it ships (``DotProductAttention``).

Under sequence parallelism (``actor.sequence_parallel``) the local spec's norms -- each layer's
two, Qwen3's QK-norms and the block's final one -- are :class:`SequenceParallelTorchNorm`, torch's
norm as megatron's ``WrappedTorchNorm`` makes it but with its parameters marked
``sequence_parallel`` as Transformer Engine marks its own (megatron's ``WrappedTorchNorm`` refuses
sequence parallelism): ``finalize_model_grads`` then sums their gradients over the TP ranks, each of
which normalised its own share of the tokens. That is what runs TP > 1 MoE layers (megatron's
``MoELayer`` needs sequence parallelism with TP) on CPU; on a GPU the ``te`` spec's norms do it.
The same class makes the zero-centred RMSNorm of a family whose norms store ``w - 1``
(:class:`ZeroCenteredRMSNorm`, ``layernorm_zero_centered_gamma``: Qwen3.5; megatron's
``WrappedTorchNorm`` refuses it too, Transformer Engine's norms have it).

:func:`layer_spec` builds a fresh spec per call: nothing is changed after the model is built.
Left out: inference / kitchen / MLA specs.
"""
from __future__ import annotations

import importlib.util
from megatron_tepo.megatron.family_kwargs import layer_spec_kwargs
from megatron_tepo.models.family import GPTFamilyConfig

__all__ = ["ATTENTIONS", "te_available", "family_spec_name", "layer_spec", "block_spec", "sdpa_core_attention",
           "SequenceParallelTorchNorm", "ZeroCenteredRMSNorm"]

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


def sdpa_core_attention(packed_attention: str = "loop"):
    """The ``ModuleSpec`` of the core attention in megatron's local spec for ``attention: sdpa``:
    :class:`~megatron_tepo.megatron.attention.SDPACoreAttention` in place of
    ``DotProductAttention``, its packed mode (``varlen`` / ``flex`` / ``loop``) a constructor
    argument through the spec's params; every other slot stays the local one."""
    from megatron.core.transformer.spec_utils import ModuleSpec

    from megatron_tepo.megatron.attention import SDPACoreAttention

    return ModuleSpec(module=SDPACoreAttention, params={"packed_attention": packed_attention})


class ZeroCenteredRMSNorm:
    """RMSNorm whose weight is stored as ``w - 1`` (zeros at init): ``rms_norm(x) * (1 + w)``, in fp32,
    returned in ``x``'s dtype -- HF's ``Qwen3_5RMSNorm``, Transformer Engine's ``zero_centered_gamma``
    (made on first use: a ``torch.nn.Module``)."""

    def __new__(cls, hidden_size: int, eps: float = 1e-6):
        return _zero_centered_class()(hidden_size, eps)


def _zero_centered_class():
    global _ZERO_CENTERED
    if _ZERO_CENTERED is None:
        import torch

        class _ZeroCenteredRMSNorm(torch.nn.Module):
            def __init__(self, hidden_size: int, eps: float):
                super().__init__()
                self.hidden_size, self.eps = hidden_size, eps
                self.weight = torch.nn.Parameter(torch.zeros(hidden_size))

            def forward(self, x):
                y = torch.nn.functional.rms_norm(x.float(), (self.hidden_size,), eps=self.eps)
                return (y * (1.0 + self.weight.float())).to(x.dtype)

        _ZeroCenteredRMSNorm.__name__ = _ZeroCenteredRMSNorm.__qualname__ = "ZeroCenteredRMSNorm"
        _ZeroCenteredRMSNorm.__module__ = __name__
        _ZERO_CENTERED = _ZeroCenteredRMSNorm
    return _ZERO_CENTERED


_ZERO_CENTERED = None


class SequenceParallelTorchNorm:
    """torch's ``RMSNorm`` / ``LayerNorm`` (``config.normalization``), as megatron's
    ``WrappedTorchNorm`` builds it, also under sequence parallelism: then its parameters carry
    ``sequence_parallel = True`` (the module docstring says why); a :class:`ZeroCenteredRMSNorm`
    with ``config.layernorm_zero_centered_gamma``."""

    def __new__(cls, config, hidden_size: int, eps: float = 1e-5, persist_layer_norm: bool = False,
                zero_centered_gamma: bool = False, normalization: str = "LayerNorm"):
        import torch

        if config.persist_layer_norm or config.memory_efficient_layer_norm:
            raise ValueError("SequenceParallelTorchNorm: persistent and memory-efficient norms are Transformer "
                             "Engine's / apex's")
        kinds = {"LayerNorm": torch.nn.LayerNorm, "RMSNorm": torch.nn.RMSNorm}
        if config.normalization not in kinds:
            raise ValueError(f"SequenceParallelTorchNorm: normalization {config.normalization!r} is not one of {list(kinds)}")
        if config.layernorm_zero_centered_gamma:
            if config.normalization != "RMSNorm":
                raise ValueError("SequenceParallelTorchNorm: a zero-centred LayerNorm is Transformer Engine's")
            norm = ZeroCenteredRMSNorm(hidden_size, eps)
        else:
            norm = kinds[config.normalization](normalized_shape=hidden_size, eps=eps)
        if config.sequence_parallel:
            for p in norm.parameters():
                p.sequence_parallel = True
        return norm


def block_spec(layer, config):
    """The ``spec`` for megatron's ``GPTModel``: ``layer`` itself (megatron adds the block's final
    norm of its own choice), or under sequence parallelism on the local spec this stage's layers
    with a :class:`SequenceParallelTorchNorm` as the final norm."""
    from megatron.core.transformer.transformer_block import TransformerBlockSubmodules, get_num_layers_to_build

    if getattr(layer.submodules, "input_layernorm", None) is not SequenceParallelTorchNorm or not (
            config.sequence_parallel or config.layernorm_zero_centered_gamma):
        return layer
    return TransformerBlockSubmodules(layer_specs=[layer] * get_num_layers_to_build(config),
                                      layer_norm=SequenceParallelTorchNorm)


def layer_spec(cfg: GPTFamilyConfig, attention: str, *, packed_attention: str = "loop",
               moe_grouped_gemm: bool = False, sequence_parallel: bool = False):
    """The ``ModuleSpec`` of one decoder layer for the resolved ``attention`` (te / sdpa / unfused);
    the family's part (experts, QK-norm) from :func:`~megatron_tepo.megatron.family_kwargs.layer_spec_kwargs`;
    ``packed_attention`` (varlen / flex / loop): how the sdpa attention runs packed (THD) input."""
    from megatron.core.models.gpt import gpt_layer_specs as specs

    if family_spec_name(attention) != cfg.spec:
        raise ValueError(f"actor.attention {attention!r} does not match the family config's spec {cfg.spec!r}")
    if attention == "te":
        if not te_available():
            raise ValueError("actor.attention: te needs transformer_engine, which is not importable here")
        return specs.get_gpt_layer_with_transformer_engine_spec(moe_grouped_gemm=moe_grouped_gemm,
                                                                **layer_spec_kwargs(cfg))
    spec = specs.get_gpt_layer_local_spec(moe_grouped_gemm=moe_grouped_gemm, normalization="RMSNorm",
                                          **layer_spec_kwargs(cfg))
    if attention == "sdpa":  # the slot megatron's local spec fills with DotProductAttention
        spec.submodules.self_attention.submodules.core_attention = sdpa_core_attention(packed_attention)
    if sequence_parallel or cfg.zero_centered_norms:  # every slot that holds megatron's torch norm (QK-norms too)
        from megatron.core.transformer.torch_norm import WrappedTorchNorm

        for owner, name in ((spec.submodules, "input_layernorm"), (spec.submodules, "pre_mlp_layernorm"),
                            (spec.submodules.self_attention.submodules, "q_layernorm"),
                            (spec.submodules.self_attention.submodules, "k_layernorm")):
            if getattr(owner, name, None) is WrappedTorchNorm:
                setattr(owner, name, SequenceParallelTorchNorm)
    return spec
