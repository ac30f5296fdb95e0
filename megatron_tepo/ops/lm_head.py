"""Log-probabilities and entropy straight from the final hidden states: a fused, vocab-parallel LM
head that never holds the ``[tokens, V/tp]`` logits.

``lm_head_log_probs_and_entropy(hidden, weight, labels, tp_group, temperature, block_size, impl)``
returns, per token (row of ``hidden``), the same two numbers as
:func:`~megatron_tepo.ops.vocab_parallel.vocab_parallel_log_probs_and_entropy` of
``hidden @ weight.T``: ``log softmax(z)[label]`` and the entropy of ``softmax(z)`` over the full
vocabulary, ``z = logits / temperature``, with ``weight`` this tensor-parallel rank's shard of the
output layer (``[V/tp, h]``, rows ``[r V/tp, (r + 1) V/tp)``; the embedding when they are tied).
It is differentiable with respect to ``hidden`` and ``weight``.

How. The shard's vocabulary is walked in blocks of ``block_size`` columns. Forward, per block: one
GEMM gives the block's logits ``[n, block]`` in the inputs' dtype (as the output layer would), the
vocab op's per-shard code (:func:`~megatron_tepo.ops.vocab_parallel.shard_stats`: the chunked torch
loop, or its Triton kernel on CUDA) reduces them to three per-token numbers (log-sum-exp, entropy,
label log-prob), which are merged into the running ones in float64
(:func:`~megatron_tepo.ops.vocab_parallel.merge_shards`, the shifted form that does not cancel; in
float64 the merges add no rounding to the blocks' own, so the result is as close as the
materialized path's), and the block is freed. The tensor-parallel combination is then the vocab op's own: two all-reduces of
``[n]`` vectors for the whole call. Backward, per block: the block's logits are recomputed, the
vocab op's gradient code writes their gradient (in the inputs' dtype), and two GEMMs give the
block's rows of the weight's gradient (``grad.T @ hidden``, over all tokens at once: exact, as
the output layer's own) and its share of the hidden states' gradient, accumulated in fp32. The
hidden states' gradient is this rank's part; the caller's tensor-parallel region sums it over the
ranks (megatron's output layer does the same).

Memory (``n`` tokens, ``V`` the shard's vocabulary, ``h`` hidden, ``e`` the inputs' element size):
the forward holds one ``[n, block]`` block and the vocab op's own chunk buffers; the backward two
blocks (the logits and their gradient), an ``[n, h]`` fp32 accumulator (none for fp32 inputs) and
its outputs. The default block keeps one ``[n, block]`` block at most ``1/32`` of the logits'
bytes ``n V e`` and at most 256 MiB, and at least 128 columns (:func:`default_block_size`), so the
extra memory is at most about ``n V e / 16 + 4 n h``, against ``2 n V e`` for the logits and their
gradient. Saved for backward: ``hidden`` and ``weight`` (by reference), the labels and two ``[n]``
vectors.

Cost. Four GEMMs of ``n x h x V`` (the forward, its recompute in backward, and the two gradients)
where the materialized head has three: the bound with recompute is 4/3 of theirs. The block
GEMMs are ``[n, h] x [h, block]``, large enough to run near the GEMM's peak for any ``n`` in the
thousands.

Numerics. Every element of a block's logits is the same dot product the full GEMM computes; the
statistics are fp32 (fp64 for fp64 inputs, so gradcheck is tight). The hidden states' gradient
sums the blocks' products in fp32 (on CUDA with ``torch.mm(..., out_dtype=float32)`` where this torch
has it; on CPU, which has no mixed-dtype GEMM, a bf16 block's rows are upcast an eighth at a time,
and so on a torch whose CUDA ``mm`` lacks ``out_dtype``), where the output
layer's single GEMM sums them in its own accumulator: the results agree within the inputs' rounding.

Left out: a single kernel that keeps a block's logits in on-chip memory (the GEMM and the
statistics are separate launches here, the block goes through device memory once each way);
gradient-accumulation fusion into megatron's ``main_grad`` (the weight's gradient is returned, as the
unfused output layer does); sequence parallelism and the tensor-parallel region of the hidden
states (the caller's: :mod:`megatron_tepo.megatron.lm_head`).
"""
from __future__ import annotations

from typing import Optional, Tuple

import torch
import torch.distributed as dist

from megatron_tepo.ops.vocab_parallel import (_local_labels, _resolve_impl, _tp_info, check_label_range, check_size,
                                              check_temperature, combine_tp, compute_dtype, default_chunk_size,
                                              fill_logits_grad, grad_coefficients, merge_shards, shard_stats)

__all__ = ["lm_head_log_probs_and_entropy", "default_block_size", "BLOCK_FRACTION", "MAX_BLOCK_BYTES"]

#: one block's logits are at most this share of the whole shard's logits ...
BLOCK_FRACTION = 1 / 32
#: ... and at most this many bytes
MAX_BLOCK_BYTES = 256 * 2**20
_MIN_BLOCK = 128  # columns: below this the block GEMMs get thin


def default_block_size(num_tokens: int, vocab_local: int, elem: int) -> int:
    """Columns per block: the block ``[num_tokens, block]`` of ``elem``-byte logits at most
    :data:`BLOCK_FRACTION` of the shard's logits and at most :data:`MAX_BLOCK_BYTES`, at least 128
    columns (or the whole shard when smaller), a multiple of 128 below the whole shard."""
    if vocab_local <= _MIN_BLOCK:
        return max(1, vocab_local)
    row = max(1, num_tokens) * elem
    cap = min(row * vocab_local * BLOCK_FRACTION, MAX_BLOCK_BYTES)
    block = int(cap // row) // _MIN_BLOCK * _MIN_BLOCK
    return min(vocab_local, max(_MIN_BLOCK, block))


def _block_labels(lbl_local: torch.Tensor, owned: torch.Tensor, v0: int, v1: int):
    """The labels as indices into block ``[v0, v1)`` of the shard (0 where it does not own them)."""
    local = lbl_local - v0
    mine = owned & (local >= 0) & (local < v1 - v0)
    return local.masked_fill_(~mine, 0), mine


_MM_OUT_DTYPE: Optional[bool] = None  # whether this torch's CUDA mm takes out_dtype (seen at first use)


def _mm_into_fp32(acc: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> None:
    """``acc += a @ b`` with ``acc`` fp32 (or fp64) and ``a``, ``b`` maybe in a lower precision."""
    global _MM_OUT_DTYPE
    if a.dtype == acc.dtype:
        acc.addmm_(a, b)
        return
    if a.is_cuda and _MM_OUT_DTYPE is not False:
        try:
            acc.add_(torch.mm(a, b, out_dtype=acc.dtype))  # bf16 inputs, fp32 accumulation and output
            _MM_OUT_DTYPE = True
            return
        except (TypeError, NotImplementedError, RuntimeError):
            if _MM_OUT_DTYPE:  # (it worked before: this is another error)
                raise
            _MM_OUT_DTYPE = False  # an older torch: the CPU way below
    # no mixed-dtype GEMM: the block upcast an eighth of its rows at a time
    b = b.to(acc.dtype)
    rows = max(1, -(-a.shape[0] // 8))
    for i in range(0, a.shape[0], rows):
        acc[i:i + rows].addmm_(a[i:i + rows].to(acc.dtype), b)


class _FusedLMHead(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, labels, tp_group, temperature, block, impl):
        tp_size, tp_rank = _tp_info(tp_group)
        n, v_local = hidden.shape[0], weight.shape[0]
        cdt = compute_dtype(hidden.dtype)
        inv_t = 1.0 / temperature
        lbl_local, owned = _local_labels(labels, tp_rank, v_local)
        lse = ent = logp = None
        for v0 in range(0, v_local, block):
            v1 = min(v0 + block, v_local)
            x = hidden @ weight[v0:v1].t()          # this block's logits, in the inputs' dtype
            lbl_b, mine = _block_labels(lbl_local, owned, v0, v1)
            chunk = default_chunk_size(n, v1 - v0, hidden.device, cdt)
            parts = tuple(t.to(torch.float64) for t in shard_stats(x, lbl_b, inv_t, impl, chunk, cdt))
            del x
            lse, ent, logp = parts if lse is None else merge_shards(lse, ent, logp, *parts, mine)
        lse, ent, logp = (t.to(cdt) for t in (lse, ent, logp))
        lse, ent, logp = combine_tp(lse, ent, logp, owned, tp_group, tp_size, cdt)
        ctx.save_for_backward(hidden, weight, labels, lse, ent)
        ctx.settings = (tp_size, tp_rank, inv_t, block, impl, cdt)
        ctx.set_materialize_grads(False)
        return logp, ent

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, g_logp, g_ent):
        hidden, weight, labels, lse, ent = ctx.saved_tensors
        need_h, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        if (g_logp is None and g_ent is None) or not (need_h or need_w):
            return None, None, None, None, None, None, None
        tp_size, tp_rank, inv_t, block, impl, cdt = ctx.settings
        n, v_local = hidden.shape[0], weight.shape[0]
        lbl_local, owned = _local_labels(labels, tp_rank, v_local)
        coef_a, coef_b, onehot = grad_coefficients(g_logp, g_ent, ent, owned, inv_t, cdt)
        acc = torch.zeros(n, hidden.shape[1], dtype=cdt, device=hidden.device) if need_h else None
        grad_w = torch.empty_like(weight) if need_w else None
        zero = torch.zeros((), dtype=cdt, device=hidden.device)
        for v0 in range(0, v_local, block):
            v1 = min(v0 + block, v_local)
            w_b = weight[v0:v1]
            x = hidden @ w_b.t()                    # the block's logits again
            lbl_b, mine = _block_labels(lbl_local, owned, v0, v1)
            onehot_b = None if onehot is None else torch.where(mine, onehot, zero)
            g = torch.empty_like(x)
            chunk = default_chunk_size(n, v1 - v0, hidden.device, cdt)
            fill_logits_grad(x, g, lse, coef_a, coef_b, onehot_b, lbl_b, inv_t, impl, chunk, cdt)
            del x
            if need_w:
                torch.mm(g.t(), hidden, out=grad_w[v0:v1])
            if need_h:
                _mm_into_fp32(acc, g, w_b)
            del g
        grad_h = None if acc is None else (acc if acc.dtype == hidden.dtype else acc.to(hidden.dtype))
        return grad_h, grad_w, None, None, None, None, None


def lm_head_log_probs_and_entropy(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    tp_group: Optional["dist.ProcessGroup"] = None,
    temperature: float = 1.0,
    block_size: Optional[int] = None,
    impl: str = "auto",
) -> Tuple[torch.Tensor, torch.Tensor]:
    """Per-token ``log softmax(hidden @ weight.T / T)[label]`` and full-vocabulary entropy, with
    the vocabulary split over ``tp_group``, without the logits (see the module doc).

    Args:
        hidden: ``[n, h]`` final hidden states (after the final norm), one row per scored token.
        weight: ``[V_local, h]``, this rank's shard of the output layer (rank ``r``: ids
            ``[r V_local, (r + 1) V_local)``), same dtype and device as ``hidden``.
        labels: ``[n]`` global token ids.
        tp_group: the group the vocabulary is split over (None or size 1: not split).
        temperature: divides the logits; > 0.
        block_size: vocabulary columns per block (None: :func:`default_block_size`).
        impl: the vocab op's ``"auto"`` / ``"chunked"`` / ``"triton"`` for the per-block statistics.

    Returns:
        ``(log_probs, entropy)``, ``[n]`` fp32 (fp64 for fp64 inputs).

    Raises:
        ValueError: naming the argument, on wrong shapes, dtypes or devices, labels out of range
            (checked on CPU only: a check on GPU would synchronize), a bad temperature or block size.
    """
    if not isinstance(hidden, torch.Tensor) or not hidden.is_floating_point() or hidden.dim() != 2:
        raise ValueError(f"hidden must be a floating-point [n, h] tensor, got "
                         f"{getattr(hidden, 'dtype', type(hidden).__name__)} {tuple(getattr(hidden, 'shape', ()))}")
    if not isinstance(weight, torch.Tensor) or weight.dim() != 2 or weight.shape[1] != hidden.shape[1]:
        raise ValueError(f"weight must be [V_local, {hidden.shape[1]}] (the output layer's shard), got "
                         f"{tuple(getattr(weight, 'shape', ()))}")
    if weight.dtype != hidden.dtype or weight.device != hidden.device:
        raise ValueError(f"weight is {weight.dtype} on {weight.device} but hidden is {hidden.dtype} on {hidden.device}")
    if not isinstance(labels, torch.Tensor) or labels.is_floating_point() or labels.dtype == torch.bool \
            or tuple(labels.shape) != (hidden.shape[0],):
        raise ValueError(f"labels must be an integer [{hidden.shape[0]}] tensor of token ids, got "
                         f"{getattr(labels, 'dtype', type(labels).__name__)} {tuple(getattr(labels, 'shape', ()))}")
    if labels.device != hidden.device:
        raise ValueError(f"labels are on {labels.device} but hidden on {hidden.device}")
    temperature = check_temperature(temperature)
    n, v_local = hidden.shape[0], weight.shape[0]
    block_size = check_size(block_size, "block_size") or default_block_size(n, v_local, hidden.element_size())
    impl = _resolve_impl(impl, hidden)
    labels = labels.long()
    check_label_range(labels, v_local, _tp_info(tp_group)[0])
    cdt = compute_dtype(hidden.dtype)
    if n == 0:  # (a micro-batch that scores nothing: zero gradients for both, as the output layer gives)
        zero = (hidden.sum() + weight.sum()).to(cdt) * 0
        empty = torch.zeros(0, dtype=cdt, device=hidden.device)
        return empty + zero, empty + zero
    return _FusedLMHead.apply(hidden, weight, labels, tp_group, temperature, int(block_size), impl)
