"""A pure-torch stand-in for the flash-linear-attention kernels that megatron-core's Gated DeltaNet
calls: the same three functions, the same arguments, the same results.

megatron-core's ``GatedDeltaNet`` (``ssm/gated_delta_net/gdn.py``) runs its short causal
convolution and its gated delta rule through flash-linear-attention (``fla``): Triton kernels,
GPU only; without ``fla`` it refuses to build. :mod:`.cpu_patches` (``gdn_kernels``) puts these in
their place where those kernels cannot run (no ``fla``, or no CUDA):

* :func:`causal_conv1d` -- ``fla.modules.convolution.causal_conv1d``: a depthwise causal
  convolution over ``[b, s, d]`` with an optional activation, as transformers' ``causal_conv1d_fn``
  computes it (``F.conv1d`` with ``w - 1`` zeros before the sequence);
* :func:`chunk_gated_delta_rule` -- ``fla.ops.gated_delta_rule.chunk_gated_delta_rule``: the gated
  delta rule in chunks of 64 tokens, transformers' ``torch_chunk_gated_delta_rule`` step for step
  (fp32 inside, the UT system solved by ``torch.linalg.solve_triangular``);
* :func:`l2norm` -- ``fla.modules.l2norm.l2norm`` (``x / sqrt(sum x^2 + 1e-6)``, in fp32).

Packed sequences (``cu_seqlens``: THD, ``b == 1``): every sequence starts from a zero state and a
zero convolution window, as flash-linear-attention's varlen kernels do. The tokens are gathered
into one ``[sequences, longest, ...]`` batch (:func:`packed_to_rows`; the padding follows each
sequence, so causality keeps it out of the real tokens), run as a batch, and gathered back: a
fixed number of ops whatever the number of sequences, none per sequence.

Everything is differentiable by autograd (the backward is torch's, not the kernels' hand-written
one). Left out: initial and final recurrent states beyond zero / None (inference), the recurrent
(one-token) form, ``head_first`` layouts.
"""
from __future__ import annotations

from typing import Optional, Tuple

import torch
import torch.nn.functional as F

__all__ = ["causal_conv1d", "chunk_gated_delta_rule", "l2norm", "packed_to_rows", "rows_to_packed", "CHUNK"]

#: tokens per chunk of the gated delta rule (flash-linear-attention's and transformers' 64)
CHUNK = 64


def l2norm(x: torch.Tensor, dim: int = -1, eps: float = 1e-6, output_dtype: Optional[torch.dtype] = None) -> torch.Tensor:
    """``x`` over ``dim`` scaled to unit L2 norm, computed in fp32, returned in ``x``'s dtype."""
    y = x.float()
    y = y * torch.rsqrt((y * y).sum(dim=dim, keepdim=True) + eps)
    return y.to(output_dtype or x.dtype)


def packed_to_rows(x: torch.Tensor, cu_seqlens) -> Tuple[torch.Tensor, torch.Tensor]:
    """``[1, T, ...]`` packed tokens -> ``([N, L, ...]`` one row per sequence, zero after its end,
    ``[N, L]`` bool: the real tokens)``; ``L`` the longest sequence. One gather."""
    cu = torch.as_tensor(cu_seqlens, device=x.device).long()
    lengths = cu[1:] - cu[:-1]
    longest = int(lengths.max()) if lengths.numel() else 0
    pos = torch.arange(longest, device=x.device)
    real = pos[None, :] < lengths[:, None]
    index = (cu[:-1, None] + pos[None, :]).clamp(max=max(x.shape[1] - 1, 0))
    rows = x[0][index]
    mask = real.reshape(*real.shape, *([1] * (rows.dim() - 2)))
    return rows * mask.to(rows.dtype), real


def rows_to_packed(rows: torch.Tensor, real: torch.Tensor) -> torch.Tensor:
    """Inverse of :func:`packed_to_rows`: the real tokens, in order, as ``[1, T, ...]``."""
    return rows[real].unsqueeze(0)


def causal_conv1d(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor] = None,
                  residual: Optional[torch.Tensor] = None, initial_state: Optional[torch.Tensor] = None,
                  output_final_state: bool = False, activation: Optional[str] = None,
                  cu_seqlens: Optional[torch.Tensor] = None, **_) -> Tuple[torch.Tensor, None]:
    """``fla``'s ``causal_conv1d``: ``x`` ``[b, s, d]``, ``weight`` ``[d, w]`` -> ``(y [b, s, d], None)``."""
    if initial_state is not None or output_final_state or residual is not None:
        raise NotImplementedError("causal_conv1d stand-in: initial / final states and residuals are not supported")
    if activation not in (None, "silu", "swish"):
        raise NotImplementedError(f"causal_conv1d stand-in: activation {activation!r} (only silu)")
    real = None
    if cu_seqlens is not None:
        if x.shape[0] != 1:
            raise ValueError(f"causal_conv1d: packed sequences (cu_seqlens) need batch 1, got {x.shape[0]}")
        x, real = packed_to_rows(x, cu_seqlens)
    s, d = x.shape[1], x.shape[2]
    w = weight.shape[-1]
    y = F.conv1d(x.transpose(1, 2).to(weight.dtype), weight.unsqueeze(1), bias, padding=w - 1, groups=d)[..., :s]
    if activation is not None:
        y = F.silu(y)
    y = y.to(x.dtype).transpose(1, 2)
    return (rows_to_packed(y, real) if real is not None else y), None


def _chunk_rule(q, k, v, g, beta, scale: float, chunk: int = CHUNK):
    """``[B, T, H, K]`` q/k, ``[B, T, H, V]`` v, ``[B, T, H]`` g/beta (fp32) -> ``[B, T, H, V]``."""
    length = q.shape[1]
    q, k, v, beta, g = [t.transpose(1, 2).contiguous() for t in (q, k, v, beta, g)]  # heads first
    q = q * scale
    pad = (chunk - length % chunk) % chunk
    q, k, v = (F.pad(t, (0, 0, 0, pad)) for t in (q, k, v))
    beta, g = (F.pad(t, (0, pad)) for t in (beta, g))
    n = (length + pad) // chunk
    v_beta, k_beta = v * beta.unsqueeze(-1), k * beta.unsqueeze(-1)
    q, k, k_beta, v_beta = (t.reshape(t.shape[0], t.shape[1], n, chunk, t.shape[-1]) for t in (q, k, k_beta, v_beta))
    g = g.reshape(g.shape[0], g.shape[1], n, chunk)
    upper = torch.ones(chunk, chunk, dtype=torch.bool, device=q.device).triu(1)
    cum = g.cumsum(dim=3)
    pairwise = (cum.unsqueeze(4) - cum.unsqueeze(3)).masked_fill(upper, float("-inf")).exp()
    ut = (k_beta @ k.transpose(-1, -2)) * pairwise
    intra = (q @ k.transpose(-1, -2)) * pairwise
    decayed_k_beta = k_beta * cum.exp().unsqueeze(-1)
    new_values = torch.linalg.solve_triangular(ut, v_beta, upper=False, unitriangular=True)
    k_cumdecay = torch.linalg.solve_triangular(ut, decayed_k_beta, upper=False, unitriangular=True)
    state = new_values.new_zeros(q.shape[0], q.shape[1], q.shape[-1], v.shape[-1])
    q = q * cum.exp().unsqueeze(-1)
    k = k * (cum[..., -1:] - cum).exp().unsqueeze(-1)
    chunk_decay = cum[..., -1].exp()[..., None, None]
    outs = []
    for i in range(n):  # the sequential scan over chunks
        v_new = new_values[:, :, i] - k_cumdecay[:, :, i] @ state
        outs.append(q[:, :, i] @ state + intra[:, :, i] @ v_new)
        state = state * chunk_decay[:, :, i] + k[:, :, i].transpose(-1, -2) @ v_new
    out = torch.stack(outs, dim=2).reshape(q.shape[0], q.shape[1], -1, v.shape[-1])[:, :, :length]
    return out.transpose(1, 2)


def chunk_gated_delta_rule(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                           scale: Optional[float] = None, initial_state: Optional[torch.Tensor] = None,
                           output_final_state: bool = False, use_qk_l2norm_in_kernel: bool = False,
                           cu_seqlens: Optional[torch.Tensor] = None, **_) -> Tuple[torch.Tensor, None]:
    """``fla``'s ``chunk_gated_delta_rule`` (``[B, T, H, K]`` q / k with as many heads as v,
    ``[B, T, H]`` g in log space and beta) -> ``(o [B, T, H, V] in v's dtype, None)``."""
    if initial_state is not None or output_final_state:
        raise NotImplementedError("chunk_gated_delta_rule stand-in: initial / final states are not supported")
    dtype = v.dtype
    q, k, v, g, beta = (t.float() for t in (q, k, v, g, beta))
    if use_qk_l2norm_in_kernel:
        q, k = l2norm(q), l2norm(k)
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    if cu_seqlens is None:
        return _chunk_rule(q, k, v, g, beta, scale).to(dtype), None
    if q.shape[0] != 1:
        raise ValueError(f"chunk_gated_delta_rule: packed sequences (cu_seqlens) need batch 1, got {q.shape[0]}")
    rows = [packed_to_rows(t, cu_seqlens) for t in (q, k, v, g, beta)]
    out = _chunk_rule(*(r for r, _ in rows), scale)
    return rows_to_packed(out, rows[0][1]).to(dtype), None
