"""Loss aggregation over a [batch, response_len] matrix of per-token values.

Three modes (TEPO Table 5, verl ``agg_loss``), with ``m`` the validity mask, ``L`` the per-token
values, ``n_i = sum_t m_{i,t}`` and ``S`` the number of *non-empty* sequences (``n_i > 0``):

* ``token-mean``:           ``sum_{i,t} m L / N``               with ``N = sum_i n_i``
* ``seq-mean-token-sum``:   ``sum_i (sum_t m L) / S``
* ``seq-mean-token-mean``:  ``sum_i (sum_t m L / n_i) / S``

Sequences with zero valid tokens contribute nothing and are not counted in ``S`` (verl divides
by ``n_i + 1e-8`` and counts them; we do not).

Global normaliser: ``normalizer`` replaces ``N`` (token-mean) or ``S`` (seq-*) by a count given
from outside -- the count over the whole mini-batch, summed over micro-batches and data-parallel
ranks with :func:`count_for_normalizer`. Each micro-batch then contributes its own numerator over
the *global* denominator, so the sum of the micro-batch losses equals the whole-batch loss (value
and gradient, up to floating-point rounding). Every denominator is ``max(count, 1)``-guarded: a
count of 0 (an all-masked input) uses 1, and the loss is an exact 0 that still has a ``grad_fn``
connected to ``values`` (zero gradient, never NaN).

Padding positions may hold anything (nan/inf included): they are removed with ``torch.where``
before any arithmetic, never multiplied by 0.
"""
from __future__ import annotations

import math
from typing import Union

import torch

__all__ = ["AGG_MODES", "aggregate", "count_for_normalizer", "compute_dtype", "masked_mean"]

AGG_MODES: tuple[str, ...] = ("token-mean", "seq-mean-token-sum", "seq-mean-token-mean")

Normalizer = Union[float, int, torch.Tensor, None]


def compute_dtype(*tensors: torch.Tensor | None) -> torch.dtype:
    """The internal compute dtype: float64 if any given tensor is float64, else float32.

    Half-precision inputs (bf16/fp16) are therefore always computed in fp32.
    """
    for t in tensors:
        if t is not None and t.dtype == torch.float64:
            return torch.float64
    return torch.float32


def _check_mode(mode: str) -> None:
    if mode not in AGG_MODES:
        raise ValueError(f"unknown aggregation mode agg={mode!r}; valid modes: {list(AGG_MODES)}")


def _check_2d_pair(values: torch.Tensor, mask: torch.Tensor) -> None:
    if mask.dim() != 2:
        raise ValueError(f"mask must be 2-D [batch, response_len], got shape {tuple(mask.shape)}")
    if values.shape != mask.shape:
        raise ValueError(
            f"values has shape {tuple(values.shape)} but mask has shape {tuple(mask.shape)}; they must match"
        )


def _as_bool(mask: torch.Tensor) -> torch.Tensor:
    return mask if mask.dtype == torch.bool else mask != 0


def _denominator(local_count: torch.Tensor, normalizer: Normalizer, dtype: torch.dtype) -> torch.Tensor:
    """``max(count, 1)`` in ``dtype``; ``count`` is ``normalizer`` when given, else ``local_count``.

    A tensor normaliser is guarded with ``torch.where`` (no host sync); a Python number is
    validated (finite, >= 0).
    """
    if normalizer is None:
        count = local_count.to(dtype)
    elif isinstance(normalizer, torch.Tensor):
        if normalizer.dim() != 0:
            raise ValueError(f"normalizer must be a number or a 0-d tensor, got shape {tuple(normalizer.shape)}")
        count = normalizer.to(device=local_count.device, dtype=dtype)
    elif isinstance(normalizer, (int, float)) and not isinstance(normalizer, bool):
        if not math.isfinite(normalizer) or normalizer < 0:
            raise ValueError(f"normalizer must be finite and >= 0, got {normalizer!r}")
        count = torch.tensor(float(normalizer), dtype=dtype, device=local_count.device)
    else:
        raise ValueError(f"normalizer must be a number, a 0-d tensor or None, got {type(normalizer).__name__}")
    return torch.where(count > 0, count, torch.ones_like(count))


def count_for_normalizer(mask: torch.Tensor, mode: str) -> torch.Tensor:
    """The local count that ``mode`` divides by: valid tokens (token-mean) or non-empty sequences.

    Returns a 0-d int64 tensor on ``mask``'s device, to be summed over micro-batches (and
    all-reduced over data-parallel ranks) and passed back as ``normalizer=``.
    """
    _check_mode(mode)
    if mask.dim() != 2:
        raise ValueError(f"mask must be 2-D [batch, response_len], got shape {tuple(mask.shape)}")
    m = _as_bool(mask)
    if mode == "token-mean":
        return m.sum(dtype=torch.int64)
    return m.any(dim=-1).sum(dtype=torch.int64)


def aggregate(values: torch.Tensor, mask: torch.Tensor, mode: str, normalizer: Normalizer = None) -> torch.Tensor:
    """Aggregate per-token ``values`` [B, T] over the valid positions of ``mask`` into a 0-d tensor.

    Args:
        values: per-token values, any float dtype (computed in fp32, or fp64 if given fp64).
        mask: [B, T], bool or float (non-zero = valid).
        mode: one of :data:`AGG_MODES`.
        normalizer: optional global count replacing ``N`` (token-mean) or ``S`` (seq-*).

    Returns:
        0-d tensor in the compute dtype (fp32 unless ``values`` is fp64).
    """
    _check_mode(mode)
    _check_2d_pair(values, mask)
    m = _as_bool(mask)
    dtype = compute_dtype(values)
    v = torch.where(m, values.to(dtype), torch.zeros((), dtype=dtype, device=values.device))
    if mode == "token-mean":
        return v.sum() / _denominator(m.sum(), normalizer, dtype)
    per_seq = v.sum(dim=-1)
    n_i = m.sum(dim=-1)
    nonempty = n_i > 0
    if mode == "seq-mean-token-mean":
        per_seq = per_seq / torch.where(nonempty, n_i, torch.ones_like(n_i)).to(dtype)
    return per_seq.sum() / _denominator(nonempty.sum(), normalizer, dtype)


def masked_mean(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Mean of ``values`` over the valid positions of ``mask`` (0 when none); garbage-safe."""
    return aggregate(values, mask, "token-mean")
