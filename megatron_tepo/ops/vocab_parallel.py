"""Log-probabilities of given tokens and entropy of the full softmax over vocab-parallel logits.

``vocab_parallel_log_probs_and_entropy(logits, labels, tp_group, temperature, chunk_size, impl)``
returns, per token,

* ``log_probs = log softmax(z)[label]`` and
* ``entropy = -sum_v p_v log p_v`` with ``p = softmax(z)``,

where ``z = logits / temperature`` over the FULL vocabulary, although each tensor-parallel rank
holds only its shard ``[..., V_local]`` of it: rank ``r`` of ``tp_group`` holds vocabulary ids
``[r * V_local, (r + 1) * V_local)`` (Megatron's ``VocabUtility`` convention). ``labels`` are global
token ids. ``tp_group=None`` (or a group of size 1) means the logits are not sharded.

Numerics
--------
Both outputs are computed in fp32 (fp64 when the logits are fp64, so gradcheck can be tight),
whatever the logits' dtype; the gradient flows back to the logits in their own dtype. Forward
and backward are exact (no approximation beyond floating-point rounding):

* ``d log_probs / dz = onehot(label) - p``
* ``d entropy / dz   = -p (log p + H)``

and ``d/dlogits = d/dz / temperature``. All sums are taken over shifted values (``z - max``), so
logits with a spread of 1e4 stay finite and accurate.

Tensor parallelism
------------------
Each rank reduces its own shard to four per-token numbers: its local log-sum-exp ``L_r``, its
local entropy ``H_r`` (of its local softmax), and, on the rank owning the label, the local
log-probability of the label. The global values follow from two collectives for the whole call
(not per chunk): an ``all_reduce(MAX)`` of ``L_r`` (giving ``M``) and one ``all_reduce(SUM)`` of
the stacked ``[3, N]`` tensor ``[e_r, e_r (H_r - (L_r - M)), owned ? logp_r + (L_r - M) : 0]``
with ``e_r = exp(L_r - M)``; then ``S = sum e_r``, ``L = M + log S``,
``H = sum(...)/S + log S`` and ``log_prob = sum(...) - log S``. These are the max / sum-exp /
target-logit / sum p*z reductions of the textbook formulation, in a shifted form that does not
cancel. The backward pass needs no communication: every rank holds the global ``L`` and ``H``
and the (replicated) upstream gradients, and the gradient with respect to its shard is local.

Memory and chunking
-------------------
A ``torch.autograd.Function``; its chunked path (``impl="chunked"``, the one on CPU; the GPU
path is below) walks over the tokens in chunks of ``chunk_size`` tokens. Forward
uses two ``[chunk, V_local]`` buffers of the compute dtype (``z - max``, and its ``exp``);
backward writes each chunk's gradient straight into the preallocated gradient tensor and uses
one ``[chunk, V_local]`` buffer (``p``), plus a second one only when the logits are not in the
compute dtype (bf16/fp16: ``log p`` is formed in fp32 and then cast into the gradient).
Saved for backward: the logits (by reference, no copy), the labels, and two ``[N]`` vectors
(global log-sum-exp and entropy). Nothing of size ``[N, V_local]`` besides the gradient itself.

Default ``chunk_size``: the largest token count whose buffer (``chunk * V_local`` elements of
the compute dtype) is at most ``min(shard_bytes / 8, 64 MiB)`` and, on CPU, at most 4 MiB so
the buffers stay in cache (the CPU passes are then cache-bound: at V=32768 the forward with
16-64-token chunks took ~0.18-0.21 s against ~0.32 s with 512-token ones); at least one token. With the two forward buffers the
extra memory is therefore at most 1/4 of the shard (1/64 of it at 4096 x 32768 on CPU).

Input layout: the logits are viewed as ``[N, V_local]`` with ``reshape``; that is free for
contiguous inputs and for any layout whose leading dims can be flattened without a copy. Other
layouts (e.g. ``[b, s, V].transpose(0, 1)``) and a last dim with stride != 1 cost one contiguous
copy of the shard in forward and again in backward (transient; it is not kept between them, so
memory between forward and backward stays at the saved-vectors level).

Pieces shared with the fused LM head
------------------------------------
:func:`shard_stats` (one shard's log-sum-exp, entropy and label log-prob from its logits; its last
step, from the local max and sums, is :func:`finish_stats`), :func:`merge_shards` (two parts of one
vocabulary as one), :func:`combine_tp` (the two all-reduces), :func:`grad_coefficients` and
:func:`fill_logits_grad` (the backward) are the op's own steps; :mod:`megatron_tepo.ops.lm_head`
runs them on one vocabulary block of logits at a time, handing the chunked loop its buffers
(``work``: made once for all blocks).

GPU path (``impl``)
-------------------
Two implementations compute the same per-token local numbers (``m = max z``, ``s = sum exp(z - m)``,
``d = sum exp(z - m)(z - m)``, ``t = (z - m)[label]`` per shard) and the same per-row gradient
``p (A + B log p) + onehot * g1 / T``; everything else (the tensor-parallel combination and its
two all-reduces, the saved tensors, the backward coefficients) is shared:

* ``"chunked"``: the torch loop over token chunks described above; any device and floating dtype.
* ``"triton"``: two Triton kernels (:mod:`megatron_tepo.ops.vocab_triton`), one program per token
  row looping over the vocabulary in blocks: the forward reads each row once with an online
  softmax (running max, rescaled sums), the backward reads it once and writes its gradient. Both
  compute in fp32 and take fp32/bf16/fp16 logits with any row stride. They allocate nothing of
  size ``[N, V_local]`` besides the gradient itself (no chunk buffers; ``chunk_size`` is unused).
  They need CUDA tensors, or CPU tensors under Triton's interpreter (``TRITON_INTERPRET=1`` set
  before the kernels are first imported; slow, meant for tests).
* ``"auto"`` (default): ``"triton"`` when the logits are on a CUDA device, their dtype is
  fp32/bf16/fp16 and triton can be imported; ``"chunked"`` otherwise (always for fp64, so gradcheck
  runs the chunked loop, and for CPU tensors).

What the triton path leaves out: fp64 logits (asking for it raises); devices other than CUDA; a
last dim with stride != 1 or leading dims that cannot be flattened into one row stride (both
still cost the one contiguous copy described above); autotuning (the block size is
``min(4096, next_power_of_2(V_local))``). Its results equal the chunked path's up to fp32
rounding (the sums are taken in a different order), not bit for bit.

Labels are checked to lie in ``[0, V_local * tp)`` only for CPU tensors (a check on GPU would
synchronize the device); out-of-range labels on GPU give undefined values.
"""
from __future__ import annotations

import math
from typing import Optional, Tuple

import torch
import torch.distributed as dist

__all__ = ["vocab_parallel_log_probs_and_entropy", "default_chunk_size"]

IMPLS = ("auto", "chunked", "triton")
_KERNEL_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
_TRITON_STATE: Optional[tuple] = None    # (module or None, why not), set on first use

_MAX_CHUNK_BYTES = 64 * 2**20       # hard cap on one [chunk, V_local] buffer
_CPU_CHUNK_BYTES = 4 * 2**20        # cache-friendly cap on CPU (L3-resident passes)


def default_chunk_size(num_tokens: int, vocab_local: int, device: torch.device,
                       compute_dtype: torch.dtype = torch.float32) -> int:
    """Tokens per chunk: buffer <= min(shard/8, 64 MiB) (and <= 4 MiB on CPU), >= 1 token."""
    elem = torch.empty((), dtype=compute_dtype).element_size()
    row_bytes = max(1, vocab_local) * elem
    shard_bytes = max(1, num_tokens) * row_bytes
    cap = min(shard_bytes // 8, _MAX_CHUNK_BYTES)
    if torch.device(device).type == "cpu":
        cap = min(cap, _CPU_CHUNK_BYTES)
    return max(1, min(max(1, num_tokens), cap // row_bytes))


def _triton_module():
    """(megatron_tepo.ops.vocab_triton, None), or (None, reason) when triton cannot be imported."""
    global _TRITON_STATE
    if _TRITON_STATE is None:
        try:
            import triton  # noqa: F401
        except ImportError as e:
            _TRITON_STATE = (None, f"{type(e).__name__}: {e}")
        else:
            from megatron_tepo.ops import vocab_triton
            _TRITON_STATE = (vocab_triton, None)
    return _TRITON_STATE


def _triton():
    return _triton_module()[0]


def _resolve_impl(impl: str, logits: torch.Tensor) -> str:
    """``"chunked"`` or ``"triton"`` for these logits (see the module doc); ValueError if not
    possible."""
    if impl not in IMPLS:
        raise ValueError(f"impl must be one of {IMPLS}, got {impl!r}")
    if impl == "chunked":
        return "chunked"
    kernel_dtype = logits.dtype in _KERNEL_DTYPES
    if impl == "auto":
        if logits.device.type == "cuda" and kernel_dtype and _triton_module()[0] is not None:
            return "triton"
        return "chunked"
    mod, why = _triton_module()
    if mod is None:
        raise ValueError(f"impl='triton' needs the 'triton' package, which cannot be imported "
                         f"({why}); install triton, or use impl='chunked' or 'auto'")
    if not kernel_dtype:
        raise ValueError(f"impl='triton' takes fp32/bf16/fp16 logits, got {logits.dtype}; use "
                         f"impl='chunked' or 'auto'")
    if logits.device.type == "cuda":
        return "triton"
    if logits.device.type == "cpu":
        if mod.INTERPRETED:
            return "triton"
        raise ValueError("impl='triton' on CPU tensors runs only under Triton's interpreter, which "
                         "was not selected: set TRITON_INTERPRET=1 in the environment before "
                         "triton (megatron_tepo.ops.vocab_triton) is imported, or use "
                         "impl='chunked' or 'auto'")
    raise ValueError(f"impl='triton' needs CUDA tensors (or CPU ones under TRITON_INTERPRET=1), "
                     f"got logits on {logits.device}")


def _tp_info(tp_group) -> Tuple[int, int]:
    if tp_group is None:
        return 1, 0
    world = dist.get_world_size(group=tp_group)
    if world == 1:
        return 1, 0
    return world, dist.get_rank(group=tp_group)


def _scratch(work, i: int, rows: int, cols: int, dtype: torch.dtype, dev) -> torch.Tensor:
    """A ``[rows, cols]`` buffer: new, or the front of the caller's flat ``work[i]``."""
    if work is None:
        return torch.empty(rows, cols, dtype=dtype, device=dev)
    return work[i][: rows * cols].view(rows, cols)


def finish_stats(m: torch.Tensor, s: torch.Tensor, d: torch.Tensor, t: torch.Tensor):
    """``L_r, H_r, (z - L_r)[label]`` from a shard's ``m = max z``, ``s = sum exp(z - m)``,
    ``d = sum exp(z - m)(z - m)`` and ``t = (z - m)[label]`` (``[n]`` each; overwritten)."""
    log_s = torch.log(s)
    local_logp = t.sub_(log_s)                 # (z - m)[label] - log s
    ent = d.div_(s).neg_().add_(log_s)         # H_r = log s - d / s
    lse = m.add_(log_s)                        # L_r = m + log s
    return lse, ent, local_logp


def shard_stats(x: torch.Tensor, lbl_local: torch.Tensor, inv_t: float, impl: str, chunk: int,
                cdt: torch.dtype, work=None) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One shard's per-row numbers from its ``[n, V_local]`` logits ``x``: its log-sum-exp ``L_r``,
    the entropy ``H_r`` of its own softmax and ``(z - L_r)[label]`` (meaningful where the shard owns
    the label; ``lbl_local`` is clamped to 0 elsewhere), each ``[n]`` of ``cdt``. ``impl``:
    ``"chunked"`` (``chunk`` rows at a time) or ``"triton"`` (see the module doc). ``work``: two
    flat ``cdt`` buffers of at least ``chunk * V_local`` elements for the chunked loop's two
    buffers (None: allocated here)."""
    n, v_local = x.shape
    dev = x.device
    m = torch.empty(n, dtype=cdt, device=dev)       # local max of z
    s = torch.empty(n, dtype=cdt, device=dev)       # local sum exp(z - m)
    d = torch.empty(n, dtype=cdt, device=dev)       # local sum exp(z - m) (z - m)
    t = torch.empty(n, 1, dtype=cdt, device=dev)    # (z - m) at the (local) label
    if n > 0 and v_local > 0 and impl == "triton":
        # the same four local numbers per row, one kernel over all rows (no [N, V] buffer)
        _triton().local_stats(x, lbl_local, inv_t, m, s, d, t)
    elif n > 0 and v_local > 0:
        buf_a = _scratch(work, 0, chunk, v_local, cdt, dev)
        buf_b = _scratch(work, 1, chunk, v_local, cdt, dev)
        for i in range(0, n, chunk):
            j = min(i + chunk, n)
            xc = x[i:j]
            za = buf_a[: j - i]
            eb = buf_b[: j - i]
            mc = m[i:j]
            if xc.dtype == cdt:
                torch.amax(xc, dim=-1, out=mc)
            else:                                    # bf16/fp16: max is exact, then upcast
                mc.copy_(xc.amax(-1))
            if inv_t != 1.0:
                mc.mul_(inv_t)
                # z - m = x / T - m, in the compute dtype (x is upcast on the fly)
                torch.add(mc.neg().unsqueeze(1), xc, alpha=inv_t, out=za)
            else:
                torch.sub(xc, mc.unsqueeze(1), out=za)
            torch.gather(za, 1, lbl_local[i:j].unsqueeze(1), out=t[i:j])
            torch.exp(za, out=eb)
            torch.sum(eb, dim=-1, out=s[i:j])
            za.mul_(eb)
            torch.sum(za, dim=-1, out=d[i:j])
        del buf_a, buf_b
    else:
        m.zero_(); s.fill_(1.0); d.zero_(); t.zero_()
    return finish_stats(m, s, d, t.squeeze(1))


def merge_shards(lse_a, ent_a, logp_a, lse_b, ent_b, logp_b, owned_b):
    """Two disjoint parts of one vocabulary (their ``shard_stats``) as one: the same shifted
    combination as the tensor-parallel one below, for two parts held by one rank (the fused LM
    head's vocabulary blocks). ``logp_a`` is kept where ``owned_b`` is False. Returns new tensors."""
    big_m = torch.maximum(lse_a, lse_b)
    sa, sb = lse_a - big_m, lse_b - big_m          # <= 0
    ea, eb = sa.exp(), sb.exp()
    big_s = ea + eb
    log_big_s = big_s.log()
    ent = (ea * (ent_a - sa) + eb * (ent_b - sb)).div_(big_s).add_(log_big_s)
    logp = torch.where(owned_b, logp_b + sb, logp_a + sa).sub_(log_big_s)
    return big_m.add_(log_big_s), ent, logp


def combine_tp(lse, ent, local_logp, owned, tp_group, tp_size: int, cdt: torch.dtype):
    """Every rank's shard numbers (:func:`shard_stats`) as the full vocabulary's: the global
    log-sum-exp, entropy and label log-prob ``[n]``, with two all-reduces (see the module doc)."""
    if tp_size <= 1:
        return lse, ent, local_logp
    n, dev = lse.shape[0], lse.device
    big_m = lse.clone()
    dist.all_reduce(big_m, op=dist.ReduceOp.MAX, group=tp_group)
    shift = lse - big_m          # L_r - M  (<= 0)
    stacked = torch.empty(3, n, dtype=cdt, device=dev)
    torch.exp(shift, out=stacked[0])
    torch.mul(stacked[0], ent - shift, out=stacked[1])
    torch.where(owned, local_logp + shift, torch.zeros((), dtype=cdt, device=dev), out=stacked[2])
    dist.all_reduce(stacked, op=dist.ReduceOp.SUM, group=tp_group)
    log_big_s = stacked[0].log()
    ent = stacked[1].div_(stacked[0]).add_(log_big_s)
    log_probs = stacked[2].sub_(log_big_s)
    lse = big_m.add_(log_big_s)
    return lse, ent.clone(), log_probs.clone()


def grad_coefficients(g_logp, g_ent, ent, owned, inv_t: float, cdt: torch.dtype):
    """The backward's per-row coefficients: ``grad_x = p (A + B log p) + onehot * G`` with
    ``A = (-g1 - g2 H) / T``, ``B = -g2 / T`` (None without an entropy gradient) and ``G = g1 / T``
    where the shard owns the label (None without a log-prob gradient)."""
    dev = ent.device
    g1 = None if g_logp is None else g_logp.reshape(-1).to(cdt)
    g2 = None if g_ent is None else g_ent.reshape(-1).to(cdt)
    if g2 is not None:
        coef_a = torch.mul(g2, ent).neg_()
        if g1 is not None:
            coef_a.sub_(g1)
        coef_a.mul_(inv_t)
        coef_b = g2 * (-inv_t)
    else:
        coef_a = g1 * (-inv_t)
        coef_b = None
    onehot = None if g1 is None else torch.where(owned, g1 * inv_t, torch.zeros((), dtype=cdt, device=dev))
    return coef_a, coef_b, onehot


def fill_logits_grad(x, grad, lse, coef_a, coef_b, onehot, lbl_local, inv_t: float, impl: str, chunk: int,
                     cdt: torch.dtype, work=None) -> None:
    """Write the gradient of the ``[n, V_local]`` logits ``x`` into ``grad`` (same shape, the
    logits' dtype) from the global log-sum-exp and :func:`grad_coefficients`. ``work``: as
    :func:`shard_stats`'s, for the chunked loop's (at most) two buffers."""
    n, v_local = x.shape
    if n == 0 or v_local == 0:
        return
    if impl == "triton":
        _triton().logits_grad(x, grad, lse, coef_a, coef_b, onehot, lbl_local, inv_t)
        return
    dev = x.device
    neg_lse = lse.neg()
    direct = grad.dtype == cdt       # work in the gradient slices themselves
    buf_p = _scratch(work, 0, chunk, v_local, cdt, dev) if coef_b is not None else None
    buf_w = None if direct else _scratch(work, 1, chunk, v_local, cdt, dev)
    for i in range(0, n, chunk):
        j = min(i + chunk, n)
        xc = x[i:j]
        w = grad[i:j] if direct else buf_w[: j - i]
        # w = log p = x / T - L
        if inv_t != 1.0:
            torch.add(neg_lse[i:j].unsqueeze(1), xc, alpha=inv_t, out=w)
        else:
            torch.add(xc, neg_lse[i:j].unsqueeze(1), out=w)
        if coef_b is not None:
            p = buf_p[: j - i]
            torch.exp(w, out=p)
            w.mul_(coef_b[i:j].unsqueeze(1)).add_(coef_a[i:j].unsqueeze(1)).mul_(p)
        else:
            w.exp_().mul_(coef_a[i:j].unsqueeze(1))
        if onehot is not None:
            w.scatter_add_(1, lbl_local[i:j].unsqueeze(1), onehot[i:j].unsqueeze(1))
        if not direct:
            grad[i:j].copy_(w)


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """fp64 for fp64 inputs (so gradcheck can be tight), fp32 otherwise."""
    return torch.float64 if dtype == torch.float64 else torch.float32


class _VocabParallelLogProbsEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, labels, tp_group, temperature, chunk_size, impl):
        tp_size, tp_rank = _tp_info(tp_group)
        shape = logits.shape
        v_local = shape[-1]
        cdt = compute_dtype(logits.dtype)
        x = _as_2d(logits)
        n = x.shape[0]
        inv_t = 1.0 / temperature
        lbl_local, owned = _local_labels(labels.reshape(-1), tp_rank, v_local)
        if chunk_size is None:
            chunk_size = default_chunk_size(n, v_local, logits.device, cdt)
        chunk = max(1, min(int(chunk_size), max(n, 1)))
        lse, ent, log_probs = shard_stats(x, lbl_local, inv_t, impl, chunk, cdt)
        lse, ent, log_probs = combine_tp(lse, ent, log_probs, owned, tp_group, tp_size, cdt)

        ctx.save_for_backward(logits, labels, lse, ent)
        ctx.tp = (tp_size, tp_rank)
        ctx.inv_t = inv_t
        ctx.chunk = chunk
        ctx.cdt = cdt
        ctx.impl = impl
        ctx.set_materialize_grads(False)
        out_shape = shape[:-1]
        return log_probs.view(out_shape), ent.view(out_shape)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, g_logp, g_ent):
        logits, labels, lse, ent = ctx.saved_tensors
        if g_logp is None and g_ent is None:
            return None, None, None, None, None, None
        tp_size, tp_rank = ctx.tp
        shape = logits.shape
        x = _as_2d(logits)
        grad = torch.empty((x.shape[0], shape[-1]), dtype=logits.dtype, device=logits.device)
        lbl_local, owned = _local_labels(labels.reshape(-1), tp_rank, shape[-1])
        coef_a, coef_b, onehot = grad_coefficients(g_logp, g_ent, ent, owned, ctx.inv_t, ctx.cdt)
        fill_logits_grad(x, grad, lse, coef_a, coef_b, onehot, lbl_local, ctx.inv_t, ctx.impl, ctx.chunk, ctx.cdt)
        return grad.view(shape), None, None, None, None, None


def _as_2d(logits: torch.Tensor) -> torch.Tensor:
    """[..., V] -> [N, V]: a view when possible, else one contiguous copy (see module doc)."""
    x = logits.reshape(-1, logits.shape[-1])
    if x.shape[-1] > 1 and x.stride(-1) != 1:
        x = x.contiguous()
    return x


def _local_labels(lbl: torch.Tensor, tp_rank: int, v_local: int):
    """Labels as indices into this rank's shard (clamped to 0 where not owned) and the mask."""
    start = tp_rank * v_local
    local = lbl - start
    owned = (local >= 0) & (local < v_local)
    return local.masked_fill_(~owned, 0), owned


def check_temperature(temperature) -> float:
    """``temperature`` as a finite float > 0; ValueError naming it otherwise."""
    try:
        temperature = float(temperature)
    except (TypeError, ValueError):
        raise ValueError(f"temperature must be a positive number, got {temperature!r}") from None
    if not (temperature > 0.0) or not math.isfinite(temperature):
        raise ValueError(f"temperature must be a finite number > 0, got {temperature}")
    return temperature


def check_size(value, name: str) -> Optional[int]:
    """``value`` as a positive int, or None; ValueError naming ``name`` otherwise."""
    if value is None:
        return None
    if isinstance(value, bool) or int(value) != value or value < 1:
        raise ValueError(f"{name} must be a positive integer or None, got {value!r}")
    return int(value)


def check_label_range(labels: torch.Tensor, v_local: int, tp_size: int) -> None:
    """Global token ids in ``[0, v_local * tp_size)``; checked for CPU tensors only (a check on
    GPU would synchronize the device)."""
    if labels.device.type == "cpu" and labels.numel() > 0:
        v_total = v_local * tp_size
        lo, hi = int(labels.min()), int(labels.max())
        if lo < 0 or hi >= v_total:
            raise ValueError(f"labels must lie in [0, {v_total}) (V_local={v_local} x tp={tp_size}), "
                             f"got values in [{lo}, {hi}]")


def vocab_parallel_log_probs_and_entropy(
    logits: torch.Tensor,
    labels: torch.Tensor,
    tp_group: Optional["dist.ProcessGroup"] = None,
    temperature: float = 1.0,
    chunk_size: Optional[int] = None,
    impl: str = "auto",
) -> Tuple[torch.Tensor, torch.Tensor]:
    """Per-token ``log softmax(logits / T)[label]`` and full-vocabulary entropy, vocab-parallel.

    Args:
        logits: ``[..., V_local]`` floating tensor, this rank's vocabulary shard (rank ``r`` holds
            ids ``[r * V_local, (r + 1) * V_local)``); the full logits when not sharded.
        labels: ``[...]`` integer tensor (converted to int64) of global token ids, same leading
            shape as ``logits``.
        tp_group: the tensor-parallel process group the vocabulary is sharded over; ``None`` or a
            group of size 1 means not sharded.
        temperature: divides the logits, as the rollout engine does when sampling; must be > 0.
        chunk_size: tokens processed per chunk; ``None`` picks :func:`default_chunk_size`.
            Used by the chunked path only.
        impl: ``"auto"`` (default: the Triton kernels for fp32/bf16/fp16 logits on CUDA when
            triton imports, else the chunked loop), ``"chunked"`` or ``"triton"`` (see the module
            doc).

    Returns:
        ``(log_probs, entropy)``, both of shape ``logits.shape[:-1]`` and dtype fp32 (fp64 for
        fp64 logits), differentiable with respect to ``logits`` (exact backward, gradient in the
        logits' dtype).

    Raises:
        ValueError: on non-floating ``logits``, non-integer or wrongly shaped (or, on CPU,
            out-of-range) ``labels``, ``temperature <= 0`` (or non-finite), ``chunk_size < 1``,
            an unknown ``impl``, or ``impl="triton"`` where it cannot run (triton not importable,
            fp64 logits, CPU tensors without ``TRITON_INTERPRET=1``, a non-CUDA device).
    """
    if not isinstance(logits, torch.Tensor) or not logits.is_floating_point():
        raise ValueError(f"logits must be a floating-point tensor, got "
                         f"{getattr(logits, 'dtype', type(logits).__name__)}")
    if logits.dim() < 1:
        raise ValueError("logits must have at least one dimension (the vocabulary)")
    if not isinstance(labels, torch.Tensor):
        raise ValueError(f"labels must be an integer tensor, got {type(labels).__name__}")
    if labels.is_floating_point() or labels.is_complex() or labels.dtype == torch.bool:
        raise ValueError(f"labels must be an integer tensor of token ids, got dtype {labels.dtype}")
    if tuple(labels.shape) != tuple(logits.shape[:-1]):
        raise ValueError(f"labels shape {tuple(labels.shape)} must equal logits.shape[:-1] = "
                         f"{tuple(logits.shape[:-1])}")
    temperature = check_temperature(temperature)
    chunk_size = check_size(chunk_size, "chunk_size")
    if labels.device != logits.device:
        raise ValueError(f"labels are on {labels.device} but logits on {logits.device}")
    impl = _resolve_impl(impl, logits)
    labels = labels.long()
    check_label_range(labels, logits.shape[-1], _tp_info(tp_group)[0])
    return _VocabParallelLogProbsEntropy.apply(logits, labels, tp_group, temperature, chunk_size,
                                               impl)
