"""Rotary position embedding on packed (THD) sequences in one call for the whole packed tensor.

megatron-core's local RoPE for packed input (``rope_utils._apply_rotary_pos_emb_thd``) applies the
rotation one sequence at a time in 0.19 (a slice, cos / sin, a rotation and a copy per sequence,
for q and k, in every layer; 0.16.1 gathers the angles per sequence and then rotates once). Here:

* :func:`packed_rope_tables` builds the ``cos`` / ``sin`` of every packed token once per
  micro-batch: each token's position within its own sequence (from ``cu_seqlens``, on the device,
  without a host sync), its row of megatron's ``freqs`` table, ``cos`` / ``sin`` times ``mscale``
  in fp32, cast to the activations' dtype -- the same arithmetic as megatron's.
* :func:`apply_packed_rope` rotates the whole ``[t, heads, d]`` tensor against those tables:
  ``t * cos + rotate_half(t) * sin`` on the first ``rot_dim`` channels (the rest passes through),
  a fixed number of ops whatever the number of sequences. Its backward is the inverse rotation of
  the incoming gradient (``g * cos + rotate_half^T(g * sin)``): nothing of ``t`` is saved. Both
  directions equal megatron's per-sequence path bit for bit in fp32 and bf16 (the same elementwise
  operations on the same values; ``tests/ops/test_rope.py``).

Context parallelism (``cp_size > 1``): ``cu_seqlens`` are the whole micro-batch's, every sequence
padded to a multiple of ``2 * cp_size`` tokens, and this rank holds chunks ``cp_rank`` and
``2 * cp_size - 1 - cp_rank`` of each (the CP chunk rule of ``megatron_tepo/layout.py``: megatron's
and Transformer Engine's load-balanced layout): :func:`context_positions` gives each local token its
true position, the tables follow from it.

Left out (the caller keeps megatron's own path for them): interleaved rotary layouts and MLA's
channel shuffle. Transformer Engine's fused THD kernel replaces all of
this where TE is installed (``apply_rope_fusion``).
"""
from __future__ import annotations

from typing import Tuple

import torch

from megatron_tepo.layout import cp_chunk, cp_position, cp_rank_tokens

__all__ = ["packed_positions", "context_positions", "packed_rope_tables", "apply_packed_rope"]


def packed_positions(cu_seqlens: torch.Tensor, total: int, device: torch.device) -> torch.Tensor:
    """``[total]`` long: each packed token's position within its own sequence (0 at every start
    in ``cu_seqlens``), computed on ``device`` without reading ``cu_seqlens`` on the host."""
    cu = cu_seqlens.to(device=device, dtype=torch.long, non_blocking=True)
    tokens = torch.arange(total, device=device)
    seq = torch.searchsorted(cu[1:].contiguous(), tokens, right=True).clamp_(max=cu.numel() - 2)
    return tokens - cu[seq]


def context_positions(cu_seqlens: torch.Tensor, cp_size: int, cp_rank: int, total: int,
                      device: torch.device) -> torch.Tensor:
    """``[total]`` long: the true position in its sequence of each of context-parallel rank
    ``cp_rank``'s ``total`` tokens (module docstring; ``cu_seqlens`` the whole micro-batch's padded
    boundaries), on ``device`` without a host sync."""
    cu = cu_seqlens.to(device=device, dtype=torch.long, non_blocking=True)
    local = cp_rank_tokens(cu, cp_size)  # this rank's share of each sequence starts here
    tokens = torch.arange(total, device=device)
    seq = torch.searchsorted(local[1:].contiguous(), tokens, right=True).clamp_(max=cu.numel() - 2)
    return cp_position(tokens - local[seq], cp_chunk(cu[seq + 1] - cu[seq], cp_size), cp_size, cp_rank)


def packed_rope_tables(cu_seqlens: torch.Tensor, freqs: torch.Tensor, total: int, dtype: torch.dtype,
                       mscale: float = 1.0, cp_size: int = 1, cp_rank: int = 0) -> Tuple[torch.Tensor, torch.Tensor]:
    """``(cos, sin)``, each ``[total, 1, rot_dim]`` in ``dtype``, for the ``total`` packed tokens
    with boundaries ``cu_seqlens`` (megatron's ``freqs`` ``[max_s, 1, 1, rot_dim]``, fp32). A
    ``freqs`` of exactly ``total`` rows already holds one row per packed token (megatron's "exact
    mapping" case, and a single sequence): it is used as it is. ``cp_size > 1``: this
    context-parallel rank's tokens (:func:`context_positions`)."""
    if cp_size > 1:
        angles = freqs[context_positions(cu_seqlens, cp_size, cp_rank, total, freqs.device)]
        angles = angles.reshape(total, 1, freqs.shape[-1])
    elif freqs.shape[0] == total:
        angles = freqs.reshape(total, 1, freqs.shape[-1])
    else:
        angles = freqs[packed_positions(cu_seqlens, total, freqs.device)].reshape(total, 1, freqs.shape[-1])
    return (torch.cos(angles) * mscale).to(dtype), (torch.sin(angles) * mscale).to(dtype)


class _PackedRope(torch.autograd.Function):
    @staticmethod
    def forward(ctx, t, cos, sin):
        ctx.save_for_backward(cos, sin)
        rot = cos.shape[-1]
        head = t[..., :rot]
        x1, x2 = torch.chunk(head, 2, dim=-1)
        out = head * cos + torch.cat((-x2, x1), dim=-1) * sin
        return torch.cat((out, t[..., rot:]), dim=-1) if t.shape[-1] > rot else out

    @staticmethod
    def backward(ctx, grad):
        cos, sin = ctx.saved_tensors
        rot = cos.shape[-1]
        head = grad[..., :rot]
        # d/dt of t*cos + rotate_half(t)*sin: g*cos + rotate_half^T(g*sin), rotate_half^T([y1, y2]) = [y2, -y1]
        y1, y2 = torch.chunk(head * sin, 2, dim=-1)
        out = head * cos + torch.cat((y2, -y1), dim=-1)
        return (torch.cat((out, grad[..., rot:]), dim=-1) if grad.shape[-1] > rot else out), None, None


def apply_packed_rope(t: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """``t`` ``[total, heads, d]`` rotated by the tables of :func:`packed_rope_tables` (the first
    ``rot_dim`` channels; the rest pass through). Differentiable in ``t``."""
    if cos.shape[-1] % 2 or cos.shape[-1] > t.shape[-1]:
        raise ValueError(f"rotary dim {cos.shape[-1]} must be even and at most the head dim {t.shape[-1]}")
    if cos.shape[0] != t.shape[0]:
        raise ValueError(f"rope tables for {cos.shape[0]} tokens, input has {t.shape[0]}")
    return _PackedRope.apply(t, cos, sin)
