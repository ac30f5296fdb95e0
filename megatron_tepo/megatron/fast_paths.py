"""Faster stand-ins for megatron-core's own slow paths: what a step launches and syncs, not what it
computes.

A profile of the actor on one H100 (docs/BENCHMARKS.md, "Launch costs") found the GPU
waiting for the CPU most of the step, in code that belongs to megatron-core's local (no
Transformer Engine, no apex) paths. Each entry of :data:`PATCHES` replaces one of them by an
equivalent that launches a fixed number of ops and reads nothing back on the host:

* ``rope_thd`` -- ``rope_utils._apply_rotary_pos_emb_thd`` (RoPE of packed sequences without TE):
  one call per q / k per layer over the whole packed tensor (:mod:`megatron_tepo.ops.rope`), its
  ``cos`` / ``sin`` built once per micro-batch and shared by every layer (kept for the micro-batch
  whose ``cu_seqlens`` and ``freqs`` tensors it was built for: all layers share those objects).
  Context parallelism too: each rank's tokens at their true positions in the load-balanced split.
  megatron's own function stays in use for what the op leaves out (interleaved layouts, MLA).
* ``grad_norm`` -- ``clip_grads.l2_norm_impl`` when it is megatron's no-apex
  ``local_multi_tensor_l2_norm`` (a ``torch.norm`` and a host read per parameter): one
  ``torch._foreach_norm`` and one norm of the norms, left on the device (megatron then reads the
  total once).
* ``grad_scale`` -- ``multi_tensor_scale_impl`` of ``clip_grads`` and ``optimizer`` when it is the
  no-apex ``local_multi_tensor_scale`` (a multiply and a copy per parameter, for clipping and for
  the copy of the fp32 main parameters into the bf16 model): ``torch._foreach_mul_`` /
  ``torch._foreach_copy_``.
* ``param_copy`` -- ``optimizer._multi_tensor_copy_this_to_that`` (the copy of the fp32 main
  parameters into the bf16 model after every step, and back at a load): with bf16 megatron passes
  no overflow buffer and it copies one parameter at a time, even with apex; one
  ``torch._foreach_copy_`` instead (it converts the dtype itself).
* ``swiglu`` -- megatron's ``torch.compile``-d SwiGLU and its backward (used with
  ``actor.fusions: on``): compiled once with the token dimension dynamic and called on detached
  inputs (inside its autograd function, where no graph is recorded), so neither the packed length,
  which changes every RL step, nor ``requires_grad`` (log-prob pass vs train step) makes dynamo
  compile again. megatron's guards on both had it recompile until ``recompile_limit``.

:func:`use_fused_adam` is the optimizer's part: where megatron fell back to ``torch.optim.AdamW``
(no TE, no apex) it makes that optimizer run torch's fused kernel instead of the per-parameter
loop (and its per-parameter host read of the step count).

:func:`apply_fast_paths` applies every entry (idempotent; ``exclude`` leaves some out);
:func:`revert_fast_paths` restores megatron's objects (tests compare both). ``MTEPO_FAST_PATHS=0``
in the environment keeps megatron-core's own paths for a whole run, fused AdamW included: the
switch to bisect a suspected difference (the results agree to fp32 rounding; RoPE bit for bit). :data:`TARGETS`
names the megatron functions each one replaces; ``tests/megatron/test_fast_paths.py`` checks
them against the installed megatron-core and each stand-in against megatron's own result.

Left out: the distributed optimizer's per-parameter copies (no host sync), Transformer Engine's
and apex's kernels (never replaced: the optimizer entries apply only where megatron's local
fallback is installed), MoE permutation.
"""
from __future__ import annotations

import functools
import importlib
import os
from typing import Callable, Dict, Iterable, List, Tuple

import torch

__all__ = ["PATCHES", "TARGETS", "apply_fast_paths", "revert_fast_paths", "applied_fast_paths",
           "use_fused_adam", "refresh_fused_adam", "foreach_l2_norm", "foreach_scale", "foreach_copy_this_to_that"]

_UNDO: Dict[str, List[Tuple[object, str, object]]] = {}


def _replace(patch: str, owner: object, attr: str, new: object) -> None:
    _UNDO.setdefault(patch, []).append((owner, attr, getattr(owner, attr)))
    setattr(owner, attr, new)


# --------------------------------------------------------------------------------------------
# rope_thd
# --------------------------------------------------------------------------------------------
class _TableCache:
    """The ``(cos, sin)`` of the last few micro-batches, keyed by the identity of the tensors all
    layers share (``cu_seqlens``, ``freqs``); the entry holds them, so an id is never reused while
    it is cached. A few entries: pipeline schedules interleave micro-batches, and a recomputed
    layer runs again in the backward."""

    size = 4

    def __init__(self):
        self.entries: List[tuple] = []

    def get(self, cu_seqlens, freqs, total: int, dtype, mscale: float, cp_size: int = 1, cp_rank: int = 0):
        from megatron_tepo.ops.rope import packed_rope_tables

        key = (total, dtype, mscale, cp_size, cp_rank)
        for entry in self.entries:
            if entry[0] is cu_seqlens and entry[1] is freqs and entry[2] == key:
                return entry[3]
        tables = packed_rope_tables(cu_seqlens, freqs, total, dtype, mscale, cp_size=cp_size, cp_rank=cp_rank)
        self.entries = [(cu_seqlens, freqs, key, tables)] + self.entries[: self.size - 1]
        return tables

    def clear(self) -> None:
        self.entries = []


ROPE_TABLES = _TableCache()


def _rope_thd(original: Callable) -> Callable:
    @functools.wraps(original)
    def apply_rotary_pos_emb_thd(t, cu_seqlens, freqs, rotary_interleaved=False, *args, **kwargs):
        from megatron_tepo.ops.rope import apply_packed_rope

        mla = kwargs.get("mla_rotary_interleaved", kwargs.get("multi_latent_attention")) or (args and args[0])
        cp_group = kwargs.get("cp_group")
        mscale = kwargs.get("mscale", 1.0)
        if rotary_interleaved or mla or cp_group is None or freqs.dim() != 4:
            return original(t, cu_seqlens, freqs, rotary_interleaved, *args, **kwargs)
        # (context parallelism: this rank's chunks of every sequence, at their true positions)
        cos, sin = ROPE_TABLES.get(cu_seqlens, freqs, t.shape[0], t.dtype, float(mscale),
                                   cp_size=cp_group.size(), cp_rank=cp_group.rank())
        return apply_packed_rope(t, cos, sin)

    return apply_rotary_pos_emb_thd


def patch_rope_thd() -> None:
    from megatron.core.models.common.embeddings import rope_utils

    _replace("rope_thd", rope_utils, "_apply_rotary_pos_emb_thd", _rope_thd(rope_utils._apply_rotary_pos_emb_thd))


# --------------------------------------------------------------------------------------------
# grad_norm, grad_scale
# --------------------------------------------------------------------------------------------
def foreach_l2_norm(chunk_size, noop_flag, tensor_lists, per_tensor, *args):
    """``amp_C.multi_tensor_l2norm``'s contract (``(total [1], per-tensor norms or None)``) in two
    launches and no host read: ``torch._foreach_norm`` then the norm of the norms (fp32)."""
    tensors = [t for t in tensor_lists[0]]
    if not tensors:
        return torch.zeros(1, dtype=torch.float), None
    norms = torch._foreach_norm(tensors)
    stacked = torch.stack([n.float() for n in norms]) if any(n.dtype != torch.float for n in norms) \
        else torch.stack(norms)
    total = torch.linalg.vector_norm(stacked).reshape(1)
    return total, (stacked if per_tensor else None)


def foreach_scale(chunk_size, noop_flag, tensor_lists, scale):
    """``amp_C.multi_tensor_scale``'s contract (``dst[i] = src[i] * scale``) with foreach ops."""
    src, dst = tensor_lists[0], tensor_lists[1]
    if not dst:
        return
    if src is dst or all(a is b for a, b in zip(src, dst)):
        torch._foreach_mul_(dst, scale)
    elif scale == 1.0:
        torch._foreach_copy_(dst, src)
    else:
        torch._foreach_copy_(dst, torch._foreach_mul(src, scale))


def _local(name: str):
    from megatron.core import utils

    return getattr(utils, name)


def patch_grad_norm() -> None:
    from megatron.core.optimizer import clip_grads

    if clip_grads.l2_norm_impl is _local("local_multi_tensor_l2_norm"):
        _replace("grad_norm", clip_grads, "l2_norm_impl", foreach_l2_norm)


def patch_grad_scale() -> None:
    from megatron.core.optimizer import clip_grads, optimizer

    for module in (clip_grads, optimizer):
        if module.multi_tensor_scale_impl is _local("local_multi_tensor_scale"):
            _replace("grad_scale", module, "multi_tensor_scale_impl", foreach_scale)


def foreach_copy_this_to_that(this, that, overflow_buf=None):
    """megatron's ``_multi_tensor_copy_this_to_that``: ``that[i].copy_(this[i])`` in one foreach op."""
    if that:
        torch._foreach_copy_(list(that), list(this))


def patch_param_copy() -> None:
    from megatron.core.optimizer import optimizer

    _replace("param_copy", optimizer, "_multi_tensor_copy_this_to_that", foreach_copy_this_to_that)


# --------------------------------------------------------------------------------------------
# swiglu
# --------------------------------------------------------------------------------------------
def _swiglu(y):
    y_1, y_2 = torch.chunk(y, 2, -1)
    return torch.nn.functional.silu(y_1) * y_2


def _swiglu_back(g, y):  # megatron's swiglu_back, the same expression
    y_1, y_2 = torch.chunk(y, 2, -1)
    return torch.cat((g * torch.sigmoid(y_1) * (1 + y_1 * (1 - torch.sigmoid(y_1))) * y_2,
                      g * torch.nn.functional.silu(y_1)), -1)


@functools.lru_cache(maxsize=None)
def _compiled(fn):
    return torch.compile(fn, dynamic=True)


def swiglu(y):
    """megatron's fused SwiGLU: compiled once for any length (see the module docstring); eager
    where a graph is being recorded through it; the plain expression where a compiled function of
    megatron's calls it (MoE's ``weighted_swiglu``: it joins that graph, no nested compile)."""
    if (torch.is_grad_enabled() and y.requires_grad) or torch.compiler.is_compiling():
        return _swiglu(y)
    return _compiled(_swiglu)(y.detach())


def swiglu_back(g, y):
    if (torch.is_grad_enabled() and (g.requires_grad or y.requires_grad)) or torch.compiler.is_compiling():
        return _swiglu_back(g, y)
    return _compiled(_swiglu_back)(g.detach(), y.detach())


def patch_swiglu() -> None:
    from megatron.core.fusions import fused_bias_swiglu as m

    _replace("swiglu", m, "swiglu", swiglu)
    _replace("swiglu", m, "swiglu_back", swiglu_back)


# --------------------------------------------------------------------------------------------
# the optimizer
# --------------------------------------------------------------------------------------------
def _torch_optimizers(optimizer) -> List[torch.optim.Optimizer]:
    inner = getattr(optimizer, "chained_optimizers", None) or [optimizer]
    return [o.optimizer for o in inner if isinstance(getattr(o, "optimizer", None), torch.optim.Optimizer)]


def enabled() -> bool:
    """False when ``MTEPO_FAST_PATHS=0``: megatron-core's own paths for the whole run."""
    return os.environ.get("MTEPO_FAST_PATHS", "1").strip() != "0"


def use_fused_adam(optimizer) -> int:
    """Make every plain ``torch.optim.AdamW`` inside megatron's ``optimizer`` (what megatron
    builds without TE and apex) run torch's fused kernel: one launch for all parameters, the step
    count kept on the parameters' device (no host read per parameter). Step counts already in the
    state move to that device. Returns how many torch optimizers now run fused; TE's and apex's
    ``FusedAdam`` (not ``torch.optim.AdamW``) are left as they are."""
    from torch.utils._foreach_utils import _get_fused_kernels_supported_devices

    if not enabled():
        return 0
    supported = set(_get_fused_kernels_supported_devices())
    count = 0
    for opt in _torch_optimizers(optimizer):
        if type(opt) is not torch.optim.AdamW:
            continue
        params = [p for g in opt.param_groups for p in g["params"]]
        if not params or any(p.device.type not in supported or not p.is_floating_point() for p in params):
            continue
        if any(g.get("differentiable") or g.get("capturable") for g in opt.param_groups):
            continue
        for group in opt.param_groups:
            group["fused"], group["foreach"] = True, False
        opt.defaults["fused"], opt.defaults["foreach"] = True, False
        opt._step_supports_amp_scaling = True
        fused_step_state(opt)
        count += 1
    return count


def fused_step_state(opt: torch.optim.Optimizer) -> None:
    """The fused kernel reads each parameter's ``step`` as an fp32 tensor on its device (a
    checkpoint written by the per-parameter loop holds them on the host)."""
    for p, state in opt.state.items():
        step = state.get("step")
        if step is not None and (not isinstance(step, torch.Tensor) or step.device != p.device
                                 or step.dtype != torch.float32):
            state["step"] = torch.as_tensor(step, dtype=torch.float32).to(p.device)


def refresh_fused_adam(optimizer) -> None:
    """After a checkpoint load: the step counts of the fused optimizers where the kernel wants them."""
    for opt in _torch_optimizers(optimizer):
        if any(g.get("fused") for g in opt.param_groups):
            fused_step_state(opt)


# --------------------------------------------------------------------------------------------
PATCHES: Dict[str, Callable[[], None]] = {
    "rope_thd": patch_rope_thd,
    "grad_norm": patch_grad_norm,
    "grad_scale": patch_grad_scale,
    "param_copy": patch_param_copy,
    "swiglu": patch_swiglu,
}

#: patch -> the megatron functions it replaces or serves (module, qualified name, a construct of
#: its source that makes the stand-in necessary or valid), checked by tests/megatron/test_fast_paths.py
TARGETS: Dict[str, List[Tuple[str, str, str]]] = {
    "rope_thd": [("megatron.core.models.common.embeddings.rope_utils", "apply_rotary_pos_emb",
                  "_apply_rotary_pos_emb_thd("),
                 ("megatron.core.models.common.embeddings.rope_utils", "_apply_rotary_pos_emb_bshd",
                  "_rotate_half(t, rotary_interleaved) * sin_")],
    "grad_norm": [("megatron.core.optimizer.clip_grads", "get_grad_norm_fp32", "l2_norm_impl"),
                  ("megatron.core.utils", "local_multi_tensor_l2_norm", "torch.tensor(l2)")],
    "grad_scale": [("megatron.core.optimizer.clip_grads", "clip_grad_by_total_norm_fp32", "multi_tensor_scale_impl"),
                   ("megatron.core.optimizer.optimizer", "_multi_tensor_copy_this_to_that", "multi_tensor_scale_impl")],
    "param_copy": [("megatron.core.optimizer.optimizer",
                    "Float16OptimizerWithFloat16Params._copy_main_params_to_model_params",
                    "_multi_tensor_copy_this_to_that("),
                   ("megatron.core.optimizer.optimizer", "_multi_tensor_copy_this_to_that", "that_.copy_(this_)")],
    "swiglu": [("megatron.core.fusions.fused_bias_swiglu", "SwiGLUFunction.forward", "swiglu(input"),
               ("megatron.core.fusions.fused_bias_swiglu", "SwiGLUFunction.backward", "swiglu_back(")],
}


def applied_fast_paths() -> List[str]:
    return [name for name in PATCHES if name in _UNDO]


def apply_fast_paths(exclude: Iterable[str] = ()) -> List[str]:
    """Apply every entry of :data:`PATCHES` not in ``exclude`` (idempotent); returns those in effect."""
    exclude = set(exclude)
    unknown = exclude - set(PATCHES)
    if unknown:
        raise ValueError(f"unknown fast path(s) {sorted(unknown)}; known: {sorted(PATCHES)}")
    if not enabled():
        return applied_fast_paths()
    for name, patch in PATCHES.items():
        if name not in exclude and name not in _UNDO:
            patch()
            _UNDO.setdefault(name, [])
    return applied_fast_paths()


def revert_fast_paths() -> None:
    """Restore megatron-core's own objects (latest first)."""
    for name in reversed(list(_UNDO)):
        for owner, attr, original in reversed(_UNDO.pop(name)):
            setattr(owner, attr, original)
    ROPE_TABLES.clear()


def target_source(module: str, qualname: str) -> str:
    """The source of a :data:`TARGETS` function as installed (for the target checks)."""
    import inspect

    obj = importlib.import_module(module)
    for part in qualname.split("."):
        obj = getattr(obj, part)
    return inspect.getsource(obj)
