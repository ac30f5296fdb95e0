"""Triton kernels for :mod:`megatron_tepo.ops.vocab_parallel` (the GPU path, ``impl="triton"``).

They compute the same per-row, per-shard quantities as the chunked torch loop there; the
tensor-parallel combination (the two all-reduces), the saved tensors and the coefficients of the
backward stay in ``vocab_parallel.py`` and are shared by both paths.

* :func:`local_stats` (forward, one program per row of the ``[N, V_local]`` logits): with
  ``z = logits * (1 / T)`` and ``m = max z`` over the local shard, it writes fp32 ``m``,
  ``s = sum exp(z - m)``, ``d = sum exp(z - m) (z - m)`` and ``t = (z - m)[label]`` (the label
  already made local to the shard and clamped to 0 where not owned). The row is read once, in
  blocks of ``BLOCK_V`` columns, with an online softmax: a running max and sums kept relative to
  it; when the max grows from ``m_old`` to ``m_new``, ``c = exp(m_old - m_new)``,
  ``s_new = c s_old + sum_blk e`` and
  ``d_new = c (d_old + s_old (m_old - m_new)) + sum_blk e (z - m_new)`` with ``e = exp(z - m_new)``.
  Lanes past the end of the row load ``-inf`` (so ``e = 0``) and contribute ``0`` to ``d`` (their
  ``z - m`` is replaced by 0, never ``0 * -inf``); the label's logit is loaded directly.
* :func:`running_stats` (the fused LM head's forward, ``ops/lm_head.py``): the same online update,
  started from the ``m, s, d`` in memory (``-inf, 0, 0`` before a row's first part) and stored back,
  over one vocabulary block that holds columns ``[offset, offset + V)`` of the rows; it writes
  ``zl = z[label]`` where the label falls in the block. Called once a block, it walks the whole row
  as :func:`local_stats` does; ``t = zl - m`` after the last block. (The online step is one
  ``@triton.jit`` function both kernels call.)
* :func:`logits_grad` (backward, one program per row): ``grad[i, v] = p (A_i + B_i log p)``
  ``(+ G_i at the local label)`` with ``log p = z - L_i`` (``L`` the global log-sum-exp), written in
  the gradient's dtype. ``HAS_B`` (an entropy gradient is present) and ``HAS_LABEL`` (a
  log-prob gradient is present) are compile-time switches; ``lbl_offset`` (0 for the vocab op) makes
  the logits columns ``[offset, offset + V)`` of the rows the labels index (the fused head's blocks).

Logits may be fp32, bf16 or fp16 with any row stride (the last dim must have stride 1); all
arithmetic is fp32. ``BLOCK_V = min(MAX_BLOCK_V, next_power_of_2(V_local))`` with 8 warps for
blocks of 2048 columns and more (fewer for smaller blocks); no autotuning. FMA contraction is
on (``enable_fp_fusion=True``, the Triton default, passed explicitly). Nothing of size
``[N, V_local]`` is allocated here: the forward writes four ``[N]`` vectors, the backward writes
into the gradient it is given; no wrapper dispatches a torch op when its ``[N]`` arguments are
contiguous and one-dimensional (the fused head calls them once a block).

On CPU tensors the kernels run only under Triton's interpreter, which is selected by
``TRITON_INTERPRET=1`` in the environment when this module (and thus ``@triton.jit``) is first
imported; :data:`INTERPRETED` records which one happened. (The interpreter of Triton 3.9 truncates
fp32 -> bf16 where the GPU rounds to nearest even: bf16 gradients may differ from the GPU's by one
unit in the last place.) Importing this module requires triton.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

__all__ = ["INTERPRETED", "MAX_BLOCK_V", "block_v", "local_stats", "running_stats", "logits_grad"]

#: Upper bound on the columns one program handles per loop step (a power of two). Tests lower it
#: so that small vocabularies still span several blocks.
MAX_BLOCK_V = 4096


@triton.jit
def _online_step(m, s, d, z, mask):
    """One block ``z`` of a row (masked lanes ``-inf``) into the running ``m, s, d``."""
    m_new = tl.maximum(m, tl.max(z, axis=0))
    c = tl.exp(m - m_new)                      # 0 on the first block (m = -inf)
    e = tl.exp(z - m_new)                      # 0 on masked lanes
    zm = tl.where(mask, z - m_new, 0.0)        # never -inf, so e * zm is never 0 * -inf
    # before the first block m_old = -inf and s_old = 0: use m_old - m_new = 0 there, so
    # s_old * (m_old - m_new) is never 0 * -inf
    m_old = tl.where(s > 0.0, m, m_new)
    d = c * (d + s * (m_old - m_new)) + tl.sum(e * zm, axis=0)
    s = s * c + tl.sum(e, axis=0)
    return m_new, s, d


@triton.jit
def _local_stats_kernel(x_ptr, x_row_stride, lbl_ptr, m_ptr, s_ptr, d_ptr, t_ptr, V, inv_t,
                        BLOCK_V: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    x_row = x_ptr + row * x_row_stride
    offs = tl.arange(0, BLOCK_V)
    m = float("-inf")
    s = 0.0
    d = 0.0
    for start in range(0, V, BLOCK_V):
        cols = start + offs
        mask = cols < V
        z = tl.load(x_row + cols, mask=mask, other=float("-inf")).to(tl.float32) * inv_t
        m, s, d = _online_step(m, s, d, z, mask)
    lbl = tl.load(lbl_ptr + row)
    t = tl.load(x_row + lbl).to(tl.float32) * inv_t - m
    tl.store(m_ptr + row, m)
    tl.store(s_ptr + row, s)
    tl.store(d_ptr + row, d)
    tl.store(t_ptr + row, t)


@triton.jit
def _running_stats_kernel(x_ptr, x_row_stride, lbl_ptr, lbl_offset, m_ptr, s_ptr, d_ptr, zl_ptr, V,
                          inv_t, BLOCK_V: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    x_row = x_ptr + row * x_row_stride
    offs = tl.arange(0, BLOCK_V)
    m = tl.load(m_ptr + row)
    s = tl.load(s_ptr + row)
    d = tl.load(d_ptr + row)
    for start in range(0, V, BLOCK_V):
        cols = start + offs
        mask = cols < V
        z = tl.load(x_row + cols, mask=mask, other=float("-inf")).to(tl.float32) * inv_t
        m, s, d = _online_step(m, s, d, z, mask)
    lbl = tl.load(lbl_ptr + row) - lbl_offset
    mine = (lbl >= 0) & (lbl < V)
    zl = tl.load(x_row + lbl, mask=mine, other=0.0).to(tl.float32) * inv_t
    tl.store(zl_ptr + row, zl, mask=mine)
    tl.store(m_ptr + row, m)
    tl.store(s_ptr + row, s)
    tl.store(d_ptr + row, d)


@triton.jit
def _logits_grad_kernel(x_ptr, x_row_stride, g_ptr, g_row_stride, lse_ptr, a_ptr, b_ptr, gl_ptr,
                        lbl_ptr, lbl_offset, V, inv_t, BLOCK_V: tl.constexpr, HAS_B: tl.constexpr,
                        HAS_LABEL: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    x_row = x_ptr + row * x_row_stride
    g_row = g_ptr + row * g_row_stride
    offs = tl.arange(0, BLOCK_V)
    lse = tl.load(lse_ptr + row)
    a = tl.load(a_ptr + row)
    if HAS_B:
        b = tl.load(b_ptr + row)
    if HAS_LABEL:
        lbl = tl.load(lbl_ptr + row) - lbl_offset   # outside [0, V): no column of this row
        gl = tl.load(gl_ptr + row)
    for start in range(0, V, BLOCK_V):
        cols = start + offs
        mask = cols < V
        x = tl.load(x_row + cols, mask=mask, other=0.0).to(tl.float32)
        logp = x * inv_t - lse
        p = tl.exp(logp)
        if HAS_B:
            w = p * (a + b * logp)
        else:
            w = p * a
        if HAS_LABEL:
            w = tl.where(cols == lbl, w + gl, w)
        tl.store(g_row + cols, w.to(g_ptr.dtype.element_ty), mask=mask)


#: True when the kernels above were built by Triton's interpreter (TRITON_INTERPRET=1 at import):
#: then they run on CPU tensors (slowly); otherwise they need CUDA tensors.
INTERPRETED = type(_local_stats_kernel).__name__ == "InterpretedFunction"

_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def block_v(v_local: int) -> int:
    """Columns per loop step: ``min(MAX_BLOCK_V, next_power_of_2(v_local))``."""
    cap = int(MAX_BLOCK_V)
    if cap < 1 or cap & (cap - 1):
        raise ValueError(f"MAX_BLOCK_V must be a power of two, got {MAX_BLOCK_V!r}")
    return min(cap, triton.next_power_of_2(max(1, int(v_local))))


def _num_warps(block: int) -> int:
    # ~8-16 elements per thread at the 2048-4096 column blocks of real vocabularies
    return max(1, min(8, block // 256))


def _check_rows(x: torch.Tensor) -> None:
    if x.dim() != 2 or (x.shape[1] > 1 and x.stride(1) != 1):
        raise ValueError(f"expected [N, V] logits with a unit last-dim stride, got shape "
                         f"{tuple(x.shape)} strides {x.stride()}")
    if x.dtype not in _DTYPES:
        raise ValueError(f"the triton path takes fp32/bf16/fp16 logits, got {x.dtype}")


def _device_guard(x: torch.Tensor):
    if x.is_cuda:
        return torch.cuda.device(x.device)
    import contextlib
    return contextlib.nullcontext()


def _check_stats(x: torch.Tensor, names: str, *outs: torch.Tensor):
    """``x``'s ``(N, V)`` once its rows and the fp32 ``[N]`` outputs ``outs`` (called ``names``) are
    as the kernels need them."""
    _check_rows(x)
    n, v = x.shape
    if n and any(o.dtype != torch.float32 or o.numel() != n or not o.is_contiguous() for o in outs):
        raise ValueError(f"{names} must be contiguous fp32 tensors of N elements")
    return n, v


def local_stats(x: torch.Tensor, lbl_local: torch.Tensor, inv_t: float, m: torch.Tensor,
                s: torch.Tensor, d: torch.Tensor, t: torch.Tensor) -> None:
    """Fill fp32 ``[N]`` vectors ``m, s, d, t`` (see the module doc) for ``[N, V]`` logits ``x``."""
    n, v = _check_stats(x, "m, s, d, t", m, s, d, t)
    if n == 0:
        return
    if lbl_local.dim() != 1:
        lbl_local = lbl_local.reshape(-1)
    lbl_local = lbl_local.contiguous()
    blk = block_v(v)
    with _device_guard(x):
        _local_stats_kernel[(n,)](x, x.stride(0), lbl_local, m, s, d, t, v, float(inv_t),
                                  BLOCK_V=blk, num_warps=_num_warps(blk), enable_fp_fusion=True)


def running_stats(x: torch.Tensor, lbl_local: torch.Tensor, lbl_offset: int, inv_t: float, m: torch.Tensor,
                  s: torch.Tensor, d: torch.Tensor, zl: torch.Tensor) -> None:
    """Continue the fp32 ``[N]`` running ``m, s, d`` (see the module doc; ``-inf, 0, 0`` before the
    first part of a row) over ``[N, V]`` logits ``x``, columns ``[lbl_offset, lbl_offset + V)`` of
    a longer row, and write ``zl = z[label]`` where the label (``lbl_local``, an index into the
    whole row) falls in them. The fused LM head calls it once per vocabulary block."""
    n, v = _check_stats(x, "m, s, d, zl", m, s, d, zl)
    if n == 0:
        return
    if lbl_local.dim() != 1 or not lbl_local.is_contiguous():
        raise ValueError("lbl_local must be a contiguous [N] tensor")
    blk = block_v(v)
    with _device_guard(x):
        _running_stats_kernel[(n,)](x, x.stride(0), lbl_local, int(lbl_offset), m, s, d, zl, v, float(inv_t),
                                    BLOCK_V=blk, num_warps=_num_warps(blk), enable_fp_fusion=True)


def logits_grad(x: torch.Tensor, out: torch.Tensor, lse: torch.Tensor, coef_a: torch.Tensor,
                coef_b, g_label, lbl_local: torch.Tensor, inv_t: float, lbl_offset: int = 0) -> None:
    """Write ``p (A + B log p) (+ G at the label)`` into ``out`` (``[N, V]``, any dtype of x's).

    ``lse``, ``coef_a``, ``coef_b`` and ``g_label`` are fp32 ``[N]`` vectors; ``coef_b=None``
    drops the ``B log p`` term and ``g_label=None`` the label term. ``lbl_offset``: ``x`` holds
    columns ``[lbl_offset, lbl_offset + V)`` of the rows ``lbl_local`` indexes (the fused LM
    head's vocabulary blocks; a label outside them adds nothing).
    """
    _check_rows(x)
    _check_rows(out)
    n, v = x.shape
    if n == 0:
        return
    has_b, has_label = coef_b is not None, g_label is not None
    vecs = [lse, coef_a] + ([coef_b] if has_b else []) + ([g_label] if has_label else [])
    for vec in vecs:
        if vec.dtype != torch.float32 or vec.numel() != n:
            raise ValueError("lse and the coefficients must be fp32 tensors of N elements")
    lse, coef_a = lse.contiguous(), coef_a.contiguous()
    coef_b = coef_b.contiguous() if has_b else None
    g_label = g_label.contiguous() if has_label else None
    if lbl_local.dim() != 1:
        lbl_local = lbl_local.reshape(-1)
    lbl_local = lbl_local.contiguous()
    blk = block_v(v)
    with _device_guard(x):
        _logits_grad_kernel[(n,)](
            x, x.stride(0), out, out.stride(0), lse, coef_a,
            coef_b if has_b else coef_a, g_label if has_label else coef_a, lbl_local, int(lbl_offset), v,
            float(inv_t), BLOCK_V=blk, HAS_B=has_b, HAS_LABEL=has_label,
            num_warps=_num_warps(blk), enable_fp_fusion=True)
