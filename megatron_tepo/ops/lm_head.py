"""Log-probabilities and entropy straight from the final hidden states: a fused, vocab-parallel LM
head that never holds the ``[tokens, V/tp]`` logits.

``lm_head_log_probs_and_entropy(hidden, weight, labels, tp_group, temperature, block_size, impl)``
returns, per token (row of ``hidden``), the same two numbers as
:func:`~megatron_tepo.ops.vocab_parallel.vocab_parallel_log_probs_and_entropy` of
``hidden @ weight.T``: ``log softmax(z)[label]`` and the entropy of ``softmax(z)`` over the full
vocabulary, ``z = logits / temperature``, with ``weight`` this tensor-parallel rank's shard of the
output layer (``[V/tp, h]``, rows ``[r V/tp, (r + 1) V/tp)``; the embedding when they are tied).
It is differentiable with respect to ``hidden`` and ``weight``.

How. The shard's vocabulary is walked in blocks of ``block_size`` columns, each block's logits
``[n, block]`` written by one GEMM, in the inputs' dtype (as the output layer would), into a
buffer made once for all blocks. Forward, on CUDA (``impl`` ``"triton"``, the default there): one
kernel (:func:`~megatron_tepo.ops.vocab_triton.running_stats`) continues every row's running max,
sum of exponentials and their weighted sum (the vocab op's online softmax, in fp32) over the
block's columns and picks the label's logit where the block holds it; after the last block they
give the shard's log-sum-exp, entropy and label log-prob
(:func:`~megatron_tepo.ops.vocab_parallel.finish_stats`): the arithmetic of the vocab op's Triton
path over the whole row. Elsewhere (the chunked torch loop: CPU, fp64) the vocab op's
:func:`~megatron_tepo.ops.vocab_parallel.shard_stats` reduces each block to the three numbers,
merged into the running ones in float64
(:func:`~megatron_tepo.ops.vocab_parallel.merge_shards`, the shifted form that does not cancel; in
float64 the merges add no rounding to the blocks' own). The tensor-parallel combination is then the
vocab op's own: two all-reduces of ``[n]`` vectors for the whole call. Backward, per block: the
block's logits are recomputed, the vocab op's gradient code writes their gradient (in the inputs'
dtype; on CUDA its kernel finds the label's column itself), and two GEMMs give the block's rows of
the weight's gradient (``grad.T @ hidden``, over all tokens at once: exact, as the output layer's
own) and its share of the hidden states' gradient, added in place into one fp32 accumulator
(:class:`_HiddenGrad`). The hidden states' gradient is this rank's part; the caller's
tensor-parallel region sums it over the ranks (megatron's output layer does the same).

Launches (issue #50 row 6). On CUDA a block costs a handful of ops: forward its GEMM and the
statistics kernel (with the views of the weight, 4 aten ops), backward the GEMM again, the gradient
kernel, the weight gradient's GEMM and the hidden gradient's ``addmm`` (8); the rest (labels,
coefficients, the statistics' last step) runs once a call. ``tests/ops/test_lm_head.py`` counts
them on CPU with :mod:`megatron_tepo.launch_costs`, each kernel stood in by one op. The chunked
path (CPU) launches far more a block: its loop over token chunks.

Memory (``n`` tokens, ``V`` the shard's vocabulary, ``h`` hidden, ``e`` the inputs' element size):
the forward holds one ``[n, block]`` block (and, chunked, the vocab op's two chunk buffers); the
backward two blocks (the logits and their gradient), an ``[n, h]`` fp32 accumulator (none for fp32
inputs: the gradient is its own), the weight's gradient it returns and, where no in-place
mixed-precision GEMM exists (see below), two fp32 staging buffers (a block's weights ``[block, h]``
and an eighth of its gradient's rows). All of them are made once a pass: nothing is allocated per
block but ``[n]`` vectors (the chunked path's merges). The default block keeps one ``[n, block]``
block at most ``1/32`` of the logits' bytes ``n V e`` and at most 256 MiB, and at least 128
columns (:func:`default_block_size`), so the extra memory is at most about
``n V e / 16 + 4 n h``, against ``2 n V e`` for the logits and their gradient.
``launch/memory.py:fused_head_bytes`` prices the backward's peak for the fit check. Saved for
backward: ``hidden`` and ``weight`` (by reference), the labels and two ``[n]`` vectors.

Cost. Four GEMMs of ``n x h x V`` (the forward, its recompute in backward, and the two gradients)
where the materialized head has three: the bound with recompute is 4/3 of theirs. The block
GEMMs are ``[n, h] x [h, block]``, large enough to run near the GEMM's peak for any ``n`` in the
thousands.

Numerics. Every element of a block's logits is the same dot product the full GEMM computes; the
statistics are fp32 (fp64 for fp64 inputs, so gradcheck is tight). The hidden states' gradient
sums the blocks' products in fp32: on CUDA with ``torch.addmm(acc, g, w, out_dtype=torch.float32,
out=acc)`` (bf16 GEMMs accumulating into ``acc``; the first block with ``beta=0``) where this torch
has it (:func:`mixed_gemm_accumulates`: from torch 2.10; 2.8 and 2.9 take ``out_dtype`` but not an
fp32 ``acc``), else (CPU, older torch) through the staging buffers, the block's bf16 gradient and
weights upcast and multiplied in fp32 (exact products; on CUDA several times slower:
:func:`~megatron_tepo.megatron.lm_head.note_hidden_gradient_gemm` says so once at the actor's
build). The output layer's single GEMM sums the same products in its own accumulator: the results
agree within the inputs' rounding.

Left out: a single kernel that keeps a block's logits in on-chip memory (the GEMM and the
statistics are separate launches here, the block goes through device memory once each way);
gradient-accumulation fusion into megatron's ``main_grad`` (the weight's gradient is returned, as the
unfused output layer does); sequence parallelism and the tensor-parallel region of the hidden
states (the caller's: :mod:`megatron_tepo.megatron.lm_head`).
"""
from __future__ import annotations

import math
from typing import Dict, Optional, Tuple

import torch
import torch.distributed as dist

from megatron_tepo.ops.vocab_parallel import (_local_labels, _resolve_impl, _tp_info, _triton, check_label_range,
                                              check_size, check_temperature, combine_tp, compute_dtype,
                                              default_chunk_size, fill_logits_grad, finish_stats, grad_coefficients,
                                              merge_shards, shard_stats)

__all__ = ["lm_head_log_probs_and_entropy", "default_block_size", "mixed_gemm_accumulates", "BLOCK_FRACTION",
           "MAX_BLOCK_BYTES", "STAGING_ROWS"]

#: one block's logits are at most this share of the whole shard's logits ...
BLOCK_FRACTION = 1 / 32
#: ... and at most this many bytes
MAX_BLOCK_BYTES = 256 * 2**20
_MIN_BLOCK = 128  # columns: below this the block GEMMs get thin
#: without an in-place mixed-precision GEMM, a bf16 block's gradient is upcast this share of its rows at a time
STAGING_ROWS = 1 / 8


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


_MIXED_ADDMM: Dict[str, bool] = {}  # device type -> whether addmm accumulates a bf16 product into fp32 there


def mixed_gemm_accumulates(device) -> bool:
    """Whether this torch's ``torch.addmm(acc, a, b, out_dtype=torch.float32, out=acc)`` adds a
    bf16 product into an fp32 ``acc`` in place on ``device``'s type: on CUDA from torch 2.10 (2.8
    and 2.9 take ``out_dtype`` but want ``acc`` in the inputs' dtype, older ones lack it), on no
    CPU so far. Tried once per device type on a ``1 x 1`` product (a host-side check: no sync)."""
    kind = torch.device(device).type
    if kind not in _MIXED_ADDMM:
        try:
            acc = torch.zeros(1, 1, dtype=torch.float32, device=device)
            one = torch.ones(1, 1, dtype=torch.bfloat16, device=device)
            torch.addmm(acc, one, one, out_dtype=torch.float32, out=acc)
            _MIXED_ADDMM[kind] = True
        except (TypeError, RuntimeError, NotImplementedError):
            _MIXED_ADDMM[kind] = False
    return _MIXED_ADDMM[kind]


class _Blocks:
    """The shard's vocabulary blocks ``[v0, v1)`` and ``count`` ``[n, v1 - v0]`` buffers of ``dtype``
    for each: made once, the same memory for every block (the last, narrower one a view of their
    front); ``flat``: the buffers themselves, the first of at least ``first_elems`` elements."""

    def __init__(self, n: int, v_local: int, block: int, count: int, dtype, device, first_elems: int = 0):
        self.v_local, self.block = v_local, block
        self.cols = min(block, v_local)
        self.last = v_local - (v_local - 1) // block * block  # columns of the last block
        self.flat = [torch.empty(max(n * self.cols, first_elems if i == 0 else 0), dtype=dtype, device=device)
                     for i in range(count)]
        self.full = tuple(f[: n * self.cols].view(n, self.cols) for f in self.flat)
        self.ragged = self.full if self.last == self.cols else \
            tuple(f[: n * self.last].view(n, self.last) for f in self.flat)

    def widths(self):
        return {self.cols, self.last}

    def __iter__(self):
        for v0 in range(0, self.v_local, self.block):
            v1 = min(v0 + self.block, self.v_local)
            yield v0, v1, self.full if v1 - v0 == self.cols else self.ragged


def _chunk_work(blocks: _Blocks, n: int, device, cdt) -> Tuple[Tuple[torch.Tensor, ...], Dict[int, int]]:
    """The chunked loop's two buffers, made once for every block (``work`` of ``shard_stats`` and
    ``fill_logits_grad``), and its rows per chunk for each block width."""
    chunks = {w: default_chunk_size(n, w, device, cdt) for w in blocks.widths()}
    size = max(max(1, min(n, c)) * w for w, c in chunks.items())
    return tuple(torch.empty(size, dtype=cdt, device=device) for _ in range(2)), chunks


class _HiddenGrad:
    """The hidden states' gradient ``sum_b g_b @ W_b`` over the vocabulary blocks, summed in
    ``cdt`` (fp32, fp64 for fp64 inputs) in one ``[n, h]`` accumulator, in place: ``addmm`` into it
    (the first block overwrites it: ``beta=0``), with ``out_dtype`` for bf16/fp16 blocks where
    :func:`mixed_gemm_accumulates`. Elsewhere (CPU; CUDA before torch 2.10) such a block's gradient
    is upcast :data:`STAGING_ROWS` of its rows at a time and the block's weights whole, into two
    staging buffers: the weights' made once, the rows' the front of the block's logits buffer
    (:meth:`stage_rows_in`: the logits are spent once their gradient is written)."""

    def __init__(self, n: int, h: int, block: int, dtype, cdt, device):
        self.acc = torch.empty(n, h, dtype=cdt, device=device)
        self.mixed = dtype != cdt
        self.staged = self.mixed and not mixed_gemm_accumulates(device)
        self.rows = max(1, math.ceil(n * STAGING_ROWS))
        self.row_elems = 0  # elements of ``dtype`` the rows' staging takes (0: none)
        if self.staged:
            self.w32 = torch.empty(block * h, dtype=cdt, device=device)
            self.row_elems = self.rows * block * (torch.empty((), dtype=cdt).element_size()
                                                  // torch.empty((), dtype=dtype).element_size())

    def stage_rows_in(self, flat: torch.Tensor) -> None:
        """The rows' fp32 staging: the front of ``flat`` (at least :attr:`row_elems` elements)."""
        if self.staged:
            self.g32 = flat[: self.row_elems].view(self.acc.dtype)

    def add(self, g: torch.Tensor, w_b: torch.Tensor, first: bool) -> None:
        beta = 0 if first else 1
        if not self.mixed:
            self.acc.addmm_(g, w_b, beta=beta)
        elif not self.staged:
            torch.addmm(self.acc, g, w_b, beta=beta, out_dtype=self.acc.dtype, out=self.acc)
        else:
            cols = w_b.shape[0]
            w32 = self.w32[: cols * w_b.shape[1]].view_as(w_b)
            w32.copy_(w_b)
            for i in range(0, g.shape[0], self.rows):
                j = min(i + self.rows, g.shape[0])
                g32 = self.g32[: (j - i) * cols].view(j - i, cols)
                g32.copy_(g[i:j])
                self.acc[i:j].addmm_(g32, w32, beta=beta)


class _FusedLMHead(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, labels, tp_group, temperature, block, impl):
        tp_size, tp_rank = _tp_info(tp_group)
        n, v_local = hidden.shape[0], weight.shape[0]
        dev = hidden.device
        cdt = compute_dtype(hidden.dtype)
        inv_t = 1.0 / temperature
        lbl_local, owned = _local_labels(labels, tp_rank, v_local)
        blocks = _Blocks(n, v_local, block, 1, hidden.dtype, dev)
        if impl == "triton":
            # the running statistics of every row, continued block after block by one kernel
            kernels = _triton()
            m = torch.full((n,), float("-inf"), dtype=cdt, device=dev)
            s = torch.zeros(n, dtype=cdt, device=dev)
            d = torch.zeros(n, dtype=cdt, device=dev)
            zl = torch.empty(n, dtype=cdt, device=dev)  # z at the label (every row's lies in one block)
            for v0, v1, (x,) in blocks:
                torch.mm(hidden, weight[v0:v1].t(), out=x)  # this block's logits, in the inputs' dtype
                kernels.running_stats(x, lbl_local, v0, inv_t, m, s, d, zl)
            lse, ent, logp = finish_stats(m, s, d, zl.sub_(m))
        else:
            work, chunks = _chunk_work(blocks, n, dev, cdt)
            lse = ent = logp = None
            for v0, v1, (x,) in blocks:
                torch.mm(hidden, weight[v0:v1].t(), out=x)
                lbl_b, mine = _block_labels(lbl_local, owned, v0, v1)
                parts = shard_stats(x, lbl_b, inv_t, impl, chunks[v1 - v0], cdt, work=work)
                parts = tuple(t.to(torch.float64) for t in parts)
                lse, ent, logp = parts if lse is None else merge_shards(lse, ent, logp, *parts, mine)
            lse, ent, logp = (t.to(cdt) for t in (lse, ent, logp))
        del blocks, x  # (the buffer: freed before the outputs are made)
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
        dev = hidden.device
        lbl_local, owned = _local_labels(labels, tp_rank, v_local)
        coef_a, coef_b, onehot = grad_coefficients(g_logp, g_ent, ent, owned, inv_t, cdt)
        grad_w = torch.empty_like(weight) if need_w else None
        acc = _HiddenGrad(n, hidden.shape[1], min(block, v_local), hidden.dtype, cdt, dev) if need_h else None
        # a block's logits and their gradient; the logits' buffer also the hidden gradient's row staging
        blocks = _Blocks(n, v_local, block, 2, hidden.dtype, dev, first_elems=acc.row_elems if need_h else 0)
        if need_h:
            acc.stage_rows_in(blocks.flat[0])
        if impl == "triton":
            kernels = _triton()
        else:
            work, chunks = _chunk_work(blocks, n, dev, cdt)
            zero = torch.zeros((), dtype=cdt, device=dev)
        for v0, v1, (x, g) in blocks:
            w_b = weight[v0:v1]
            torch.mm(hidden, w_b.t(), out=x)  # the block's logits again
            if impl == "triton":
                kernels.logits_grad(x, g, lse, coef_a, coef_b, onehot, lbl_local, inv_t, lbl_offset=v0)
            else:
                lbl_b, mine = _block_labels(lbl_local, owned, v0, v1)
                onehot_b = None if onehot is None else torch.where(mine, onehot, zero)
                fill_logits_grad(x, g, lse, coef_a, coef_b, onehot_b, lbl_b, inv_t, impl, chunks[v1 - v0], cdt,
                                 work=work)
            if need_w:
                torch.mm(g.t(), hidden, out=grad_w[v0:v1])
            if need_h:
                acc.add(g, w_b, first=v0 == 0)
        grad_h = None if acc is None else acc.acc
        del blocks, x, g, w_b, acc  # (the buffers and the staging: freed before the hidden gradient's cast)
        if grad_h is not None and grad_h.dtype != hidden.dtype:
            grad_h = grad_h.to(hidden.dtype)
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
    if not isinstance(weight, torch.Tensor) or weight.dim() != 2 or weight.shape[1] != hidden.shape[1] \
            or weight.shape[0] == 0:
        raise ValueError(f"weight must be [V_local, {hidden.shape[1]}] with V_local >= 1 (the output layer's "
                         f"shard), got {tuple(getattr(weight, 'shape', ()))}")
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
