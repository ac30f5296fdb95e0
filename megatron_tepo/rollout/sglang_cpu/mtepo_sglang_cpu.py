"""Start-up patches for running SGLang on a CPU-only machine (loaded by a .pth file).

``tools/install_sglang_cpu.sh`` writes ``mtepo_sglang_cpu.pth`` into the SGLang venv; it puts this
directory on ``sys.path`` (so the stand-in :mod:`sgl_kernel` beside this file is importable when
the real one is absent) and imports this module in every interpreter of that venv. Each patch is
applied lazily, when SGLang imports the module it concerns (a meta-path finder), so importing this
module costs nothing and does not import torch.

Work-around 1 -- torchvision fake ops.  SGLang imports torchvision unconditionally. The torchvision
wheel on PyPI is a CUDA build; with the CPU torch its compiled ops (``torchvision/_C.so``) do not
load, and then ``torchvision/_meta_registrations.py`` fails at import time on
``torch.library.register_fake("torchvision::nms")`` with ``operator torchvision::nms does not
exist``. We hook the import of that one module and, only when torchvision's ops did not load, make
``register_fake`` for ``torchvision::*`` a no-op while it runs (there is no op to register a fake
for). Nothing else changes; with a working torchvision the hook does nothing.

Patch 2 -- a reused receive buffer for ``/update_weights_from_distributed`` (CPU engine only:
``SGLANG_USE_CPU_ENGINE=1``, which ``rollout/sglang/server.py``'s ``server_command`` sets for ``device="cpu"``).
SGLang 0.5.23 receives every ``load_format="flattened_bucket"`` broadcast into a fresh
``torch.empty`` (``FlattenedTensorBucket.empty``) and lets it go after ``load_weights`` copied it
into the parameters. On CPU a fresh buffer of a bucket's size (64-256 MiB) is page-faulted and
zeroed by the kernel *while* gloo receives into it: measured on the 2-core test machine, that made
the receive of 221 MB take 0.20 s against 0.12 s for a gloo broadcast into a buffer that exists
(docs/BENCHMARKS.md, "Weight sync"). The patch receives into one buffer per device that is kept
and grown to the largest bucket seen (extra memory: one bucket, for the server's lifetime). It is
safe because the loaders copy out of the received tensors before the next bucket arrives; after
every load we check that no parameter or buffer of the model points into the receive buffer, and
if one does (a loader that kept the tensor itself) the buffer is handed over to the model and the
next bucket gets a new one -- correctness never depends on the loaders. ``MTEPO_SGLANG_RECV_BUFFER=0``
turns the patch off. Not applied with CUDA (GPU memory is the scarce resource there).

Patch 3 -- receive straight into the parameters (CPU engine only, with patch 2's receive).
After a received bucket was loaded, its memory still has to be copied into the parameters: for the
221 MB of the weight-sync benchmark that load took 20-40 ms of a 0.15-0.2 s push on 2 cores. The
first time a bucket layout (its names, dtypes and shapes, exactly as the request gives them) is
loaded, the load runs under a ``TorchFunctionMode`` that records what the loaders do. When all
they did was view the received bytes and the parameters and ``copy_`` contiguous received bytes
into contiguous parameter memory of the same dtype, every parameter they wrote is covered
exactly by those copies at one fixed offset in the bucket, and nothing else holds the
parameters' memory (no other parameter, buffer or cached view: the storage's use count), the
layout gets a plan: one bucket-sized tensor, into which those parameters are moved (``param.data``
becomes a view of it at their offset in the bucket). From then on a bucket of that layout is
broadcast into that tensor, which *is* the load; ``load_weights`` is not called for it (another
runner, e.g. a draft model, still loads from its views). A loader that does anything else (a
``fill_``, an ``item``, a cast, a new tensor, a write into a tied weight) leaves its layout on the
normal path for good. A new layout (another bucket size) may take parameters an earlier plan
moved: they move again and the earlier plan is dropped. A plan whose parameters were replaced
(by a loader, a quantization repack) is dropped and its layout is traced again.
Bytes of a bucket no parameter takes (a tensor the loader skips) are received into the plan's
tensor and unused. Once a bucket goes in directly and no layout seen so far was refused, patch 2's
receive buffer is let go (a refused layout keeps it, so that it is not allocated at every push).
Difference from the normal path: a broadcast that fails half-way has already overwritten part of
the parameters (the normal path would only fail in the load; SGLang then says "the weights are
partially updated" either way). ``MTEPO_SGLANG_DIRECT_RECEIVE=0`` turns it off.

Work-around 4 -- host pools without CUDA. ``--enable-return-routed-experts`` (MoE routing replay)
allocates a host cache of the captured experts that SGLang page-locks through
``torch.cuda.cudart()``, which a CPU torch refuses ("Torch not compiled with CUDA enabled"): the
server did not start. Without CUDA the registration is skipped (there is no device to pin for).

Work-around 5 -- LoRA without pinned memory (sgl-project/sglang#31894). SGLang's LoRA modules
(``sglang.srt.lora.*``: layers, memory pool, the ``torch_native`` backend) page-lock small host
tensors with ``pin_memory=True`` / ``.pin_memory()``, which a CPU torch refuses: a server with
``--enable-lora`` did not serve. Without an accelerator those modules' ``torch`` drops
``pin_memory`` from its factories and ``Tensor.pin_memory`` returns the tensor itself (in that
server process only; nothing to pin for). With CUDA nothing changes.
"""
from __future__ import annotations

import importlib.abc
import importlib.util
import logging
import os
import sys
import weakref

log = logging.getLogger("mtepo_sglang_cpu")


# ---------------------------------------------------------------- work-around 1: torchvision
def _exec_torchvision_meta(inner, module):
    import torch
    import torchvision.extension as ext

    if ext._has_ops():
        return inner.exec_module(module)
    real = torch.library.register_fake

    def register_fake(op, *args, **kwargs):
        if isinstance(op, str) and op.startswith("torchvision::"):
            if args and callable(args[0]):
                return args[0]
            return lambda fn: fn
        return real(op, *args, **kwargs)

    torch.library.register_fake = register_fake
    try:
        return inner.exec_module(module)
    finally:
        torch.library.register_fake = real


# ---------------------------------------------------------------- patch 2: receive buffer
_recv_buffers: dict = {}  # device -> uint8 tensor, reused by every flattened-bucket receive


def _recv_buffer(nbytes: int, device):
    import torch

    key = str(device)
    buf = _recv_buffers.get(key)
    if buf is None or buf.numel() < nbytes:
        _recv_buffers.pop(key, None)
        del buf
        buf = torch.empty(nbytes, dtype=torch.uint8, device=device)
        _recv_buffers[key] = buf
    return buf


def _points_into(model, buf) -> bool:
    lo = buf.data_ptr()
    hi = lo + buf.numel()
    for t in list(model.parameters()) + list(model.buffers()):
        if t.numel() and lo <= t.data_ptr() < hi:
            return True
    return False


# ---------------------------------------------------------------- patch 3: receive into the parameters
# Tensor methods / torch functions a loader may call on the traced path: metadata reads and views
# (each checked to alias its input: a ``to``/``contiguous``/``reshape`` that copies disqualifies).
_VIEW_OPS = frozenset({
    "__get__", "size", "dim", "numel", "stride", "storage_offset", "data_ptr", "is_contiguous",
    "element_size", "__len__", "narrow", "view", "reshape", "__getitem__", "chunk", "split", "t",
    "transpose", "select", "squeeze", "unsqueeze", "flatten", "contiguous", "to", "detach",
    "view_as", "reshape_as",
})
_plans = weakref.WeakKeyDictionary()  # model -> {layout key: _Plan or None (not eligible)}
_flats = weakref.WeakKeyDictionary()  # model -> {storage ptr: a plan tensor that parameters live in}


def _storage_ptr(t) -> int:
    return t.untyped_storage().data_ptr()


def _aliases(out, base) -> bool:
    import torch

    outs = out if isinstance(out, (tuple, list)) else (out,)
    return all(not isinstance(o, torch.Tensor) or _storage_ptr(o) == _storage_ptr(base) for o in outs)


def _make_trace_mode(lo: int, hi: int):
    import torch
    from torch.overrides import TorchFunctionMode

    class _Trace(TorchFunctionMode):
        """Records ``copy_`` out of the received bytes [lo, hi); anything else but a view spoils."""

        def __init__(self):
            super().__init__()
            self.copies = []  # (destination view, byte offset in the bucket, nbytes)
            self.spoiled = None

        def __torch_function__(self, func, types, args=(), kwargs=None):
            kwargs = kwargs or {}
            out = func(*args, **kwargs)
            if self.spoiled is None:
                name = getattr(func, "__name__", repr(func))
                if name == "copy_":
                    dst, src = args[0], args[1] if len(args) > 1 else None
                    if (len(args) == 2 and not kwargs and isinstance(src, torch.Tensor)
                            and src.dtype == dst.dtype and src.shape == dst.shape
                            and src.is_contiguous() and dst.is_contiguous()
                            and lo <= src.data_ptr() and src.data_ptr() + src.nbytes <= hi):
                        self.copies.append((dst, src.data_ptr() - lo, src.nbytes))
                    else:
                        self.spoiled = "copy_ not from contiguous received bytes of the same dtype"
                elif name == "fill_" and args[0].numel() == 0:
                    pass  # the vocab padding of an embedding that has none
                elif name not in _VIEW_OPS:
                    self.spoiled = name
                elif args and isinstance(args[0], torch.Tensor) and not _aliases(out, args[0]):
                    self.spoiled = f"{name} made a copy"
            return out

    return _Trace()


class _Plan:
    """A bucket layout whose parameters live in ``flat`` at fixed offsets."""

    def __init__(self, flat, entries):
        self.flat, self.entries = flat, entries  # entries: [(param, byte offset in flat)]

    def valid(self, model) -> bool:
        base = self.flat.data_ptr()
        live = {id(p) for p in model.parameters()}
        return all(id(p) in live and p.data_ptr() == base + off for p, off in self.entries)


def _plan_from_trace(model, trace, nbytes: int, device, plans: dict):
    """The plan the traced load allows, with its parameters moved into it; or None (and why).

    A parameter may come from its own memory or from the tensor of an earlier plan (a new bucket
    size): that plan then no longer holds and is dropped by :func:`_forget_stale`."""
    import torch

    if trace.spoiled is not None:
        return None, f"the loader called {trace.spoiled}"
    if not hasattr(torch._C, "_storage_Use_Count"):  # a private torch API: without it, no proof
        return None, "this torch cannot count a storage's users"
    if not trace.copies:
        return None, "the loader copied nothing"
    ours = _flats.setdefault(model, {})
    params = {}
    for p in model.parameters():
        params.setdefault(_storage_ptr(p), []).append(p)
    others = {_storage_ptr(b) for b in model.buffers() if b.numel()}
    spans, per_param = [], {}
    for dst, off, n in trace.copies:
        sp = _storage_ptr(dst)
        owners = [p for p in params.get(sp, ()) if p.data_ptr() <= dst.data_ptr() < p.data_ptr() + p.nbytes]
        if len(owners) != 1 or sp in others or (sp not in ours and len(params[sp]) != 1):
            return None, "a copy went to memory that is not exactly one parameter's"
        p = owners[0]
        per_param.setdefault(id(p), (p, []))[1].append((dst.data_ptr() - p.data_ptr(), off, n))
        spans.append((off, off + n))
    spans.sort()
    if any(a[1] > b[0] for a, b in zip(spans, spans[1:])):
        return None, "received bytes were copied twice"
    entries = []
    for p, parts in per_param.values():
        if _storage_ptr(p) not in ours and (p.storage_offset() or p.untyped_storage().nbytes() != p.nbytes):
            return None, "a parameter does not own its memory"
        shifts = {off - at for at, off, _ in parts}
        if len(shifts) != 1 or sum(n for *_, n in parts) != p.nbytes or not p.is_contiguous():
            return None, "a parameter is not one contiguous run of the bucket"
        shift = shifts.pop()
        if shift < 0 or shift + p.nbytes > nbytes or shift % p.element_size():
            return None, "a parameter does not fit the bucket"
        entries.append((p, shift))
    del trace.copies[:], dst, owners  # drop the views before counting who else holds the memory
    probe = torch.empty(1)
    alone = torch._C._storage_Use_Count(probe.untyped_storage()._cdata)
    for sp in {_storage_ptr(p) for p, _ in entries}:
        # the parameters living there, those an earlier plan moved there (maybe replaced since)
        # and that plan's tensor: nobody else may hold it
        known = {id(t) for t in params[sp]}
        if sp in ours:
            known |= {id(t) for pl in plans.values() if pl is not None and _storage_ptr(pl.flat) == sp
                      for t, _ in pl.entries} | {id(ours[sp])}
        if torch._C._storage_Use_Count(params[sp][0].untyped_storage()._cdata) != alone - 1 + len(known):
            return None, "something besides the parameters holds their memory"
    flat = torch.empty(nbytes, dtype=torch.uint8, device=device)
    for p, shift in entries:
        view = flat[shift:shift + p.nbytes].view(p.dtype).view(p.shape)
        view.copy_(p.data)
        p.data = view
    ours[_storage_ptr(flat)] = flat
    return _Plan(flat, entries), None


def _forget_stale(model, plans: dict) -> None:
    """Drop the plans whose parameters moved or were replaced, and the plan tensors no parameter
    lives in any more."""
    for k in [k for k, v in plans.items() if v is not None and not v.valid(model)]:
        del plans[k]
    live = {_storage_ptr(p) for p in model.parameters()}
    flats = _flats.get(model, {})
    for sp in [sp for sp in flats if sp not in live]:
        del flats[sp]


class _Received(list):
    """The (name, tensor) list of one received bucket, with what the load needs to know: whether
    the broadcast wrote ``model``'s parameters itself (``direct``), or else whether this load is
    to be traced for a plan (``trace``: a layout not seen yet, or whose plan no longer holds)."""

    def __init__(self, tensors, *, model, key, flat, direct=False, trace=False):
        super().__init__(tensors)
        self.model, self.key, self.flat, self.direct, self.trace = model, key, flat, direct, trace


def _exec_weight_updater(inner, module):
    inner.exec_module(module)
    if os.environ.get("SGLANG_USE_CPU_ENGINE") != "1":
        return
    keep_buffer = os.environ.get("MTEPO_SGLANG_RECV_BUFFER", "1") != "0"
    direct = os.environ.get("MTEPO_SGLANG_DIRECT_RECEIVE", "1") != "0"
    if not (keep_buffer or direct):
        return
    import torch

    cls = module.WeightUpdater
    bucket_cls = module.FlattenedTensorBucket
    orig_load = cls.load_weights_from_distributed

    def _updates_allowed(self, model) -> bool:
        try:
            self._assert_weight_cache_inactive("update_weights_from_distributed")
        except Exception:
            return False
        return module._unsupported_derived_weight_cache_error(model) is None

    def _receive_bucketed_weights_from_distributed(self, *, names, dtypes, shapes, group_name):
        empty = bucket_cls.empty(names, dtypes, shapes, "meta")  # the layout checks, no memory
        meta = empty.get_metadata()
        nbytes = empty.get_flattened_tensor().numel()
        group = self._model_update_group[group_name]
        model = self.get_model()
        key = tuple((m.name, str(m.dtype), tuple(m.shape)) for m in meta)
        plans = _plans.setdefault(model, {}) if direct else {}
        plan = plans.get(key)
        stale = plan is not None and not plan.valid(model)
        if plan is not None and not stale and _updates_allowed(self, model):
            if None not in plans.values():  # every layout seen goes in directly: no buffer needed
                _recv_buffers.pop(str(self.device), None)
            torch.distributed.broadcast(plan.flat, src=0, group=group)
            tensors = bucket_cls(flattened_tensor=plan.flat, metadata=meta).reconstruct_tensors()
            return _Received(tensors, model=model, key=key, flat=plan.flat, direct=True)
        if keep_buffer:
            flat = _recv_buffer(nbytes, self.device)[:nbytes]
        else:
            flat = torch.empty(nbytes, dtype=torch.uint8, device=self.device)
        torch.distributed.broadcast(flat, src=0, group=group)
        tensors = bucket_cls(flattened_tensor=flat, metadata=meta).reconstruct_tensors()
        return _Received(tensors, model=model, key=key, flat=flat, trace=direct and (key not in plans or stale))

    def load_weights_from_distributed(self, named_tensors):
        model = self.get_model()
        own = isinstance(named_tensors, _Received) and named_tensors.model is model
        if own and named_tensors.direct:  # the broadcast wrote the parameters themselves
            return True, "Succeeded to update parameter online."
        trace = None
        if own and named_tensors.trace:
            lo = named_tensors.flat.data_ptr()
            trace = _make_trace_mode(lo, lo + named_tensors.flat.numel())
        try:
            if trace is None:
                ok, msg = orig_load(self, named_tensors)
            else:
                with trace:
                    ok, msg = orig_load(self, named_tensors)
        finally:
            buf = _recv_buffers.get(str(self.device))
            if buf is not None and _points_into(model, buf):
                log.warning("mtepo: a weight loader kept a received tensor; the receive buffer is "
                            "left to the model and the next bucket gets a new one")
                _recv_buffers.pop(str(self.device), None)
        if trace is not None and ok:
            plans = _plans.setdefault(model, {})
            try:
                plan, why = _plan_from_trace(model, trace, named_tensors.flat.numel(), self.device, plans)
            except Exception as e:  # noqa: BLE001 -- the load succeeded; only the fast path is lost
                plan, why = None, f"planning failed: {e!r}"
            plans[named_tensors.key] = plan
            _forget_stale(model, plans)
            print(f"mtepo_sglang_cpu: a bucket of {len(named_tensors)} tensors will be received "
                  + ("straight into the parameters" if plan else f"and loaded ({why})"),
                  file=sys.stderr, flush=True)
        return ok, msg

    cls._receive_bucketed_weights_from_distributed = _receive_bucketed_weights_from_distributed
    cls.load_weights_from_distributed = load_weights_from_distributed
    cls._mtepo_recv_buffer = keep_buffer
    cls._mtepo_direct_receive = direct


# ---------------------------------------------------------------- work-around 4: host pools without CUDA
def _exec_pool_host_common(inner, module):
    """``--enable-return-routed-experts`` (MoE routing replay) gives the scheduler a host cache of the
    captured experts, allocated by ``alloc_with_host_register``, which page-locks it with
    ``torch.cuda.cudart().cudaHostRegister``: on a CPU torch that raises "Torch not compiled with CUDA
    enabled" and the server does not start. Without CUDA there is nothing to page-lock for: the
    registration and its undoing are skipped (plain host memory). With CUDA nothing changes."""
    inner.exec_module(module)
    import torch

    if torch.cuda.is_available():
        return
    for name in ("_cuda_host_register", "_cuda_host_unregister"):
        if hasattr(module, name):
            setattr(module, name, lambda *args, **kwargs: None)


# ---------------------------------------------------------------- work-around 5: LoRA without pinned memory
_PIN_FACTORIES = ("tensor", "empty", "zeros", "ones", "full", "arange", "as_tensor")


class _TorchWithoutPinning:
    """``torch`` as a LoRA module sees it on a machine without an accelerator: the factories drop
    ``pin_memory=True`` (there is no pinned allocator; the memory is plain host memory, which is
    what the copies to a CPU "device" read anyway); everything else is torch's own."""

    def __init__(self, torch):
        self._torch = torch

    def __getattr__(self, name):
        attr = getattr(self._torch, name)
        if name in _PIN_FACTORIES:
            def factory(*args, **kwargs):
                kwargs.pop("pin_memory", None)
                return attr(*args, **kwargs)
            return factory
        return attr


def _unpinned_tensor_pin_memory(self, *args, **kwargs):
    return self


def _exec_lora_module(inner, module):
    """SGLang's LoRA layers, memory pool and backends page-lock their host tensors
    (``torch.tensor(..., pin_memory=True)``, ``t.pin_memory()``), which a CPU torch refuses
    ("pin_memory=True requires a CUDA or other accelerator backend", sgl-project/sglang#31894): a
    CPU server with ``--enable-lora`` crashes at start-up or at its first LoRA batch. Without an
    accelerator, the module's ``torch`` drops ``pin_memory`` from the factories and
    ``Tensor.pin_memory`` gives the tensor itself (pinning has no device to pin for). With CUDA
    nothing changes."""
    inner.exec_module(module)
    import torch

    if torch.cuda.is_available() or _has_accelerator(torch):
        return
    if getattr(module, "torch", None) is torch:
        module.torch = _TorchWithoutPinning(torch)
    if torch.Tensor.pin_memory is not _unpinned_tensor_pin_memory:
        torch.Tensor.pin_memory = _unpinned_tensor_pin_memory


def _has_accelerator(torch) -> bool:
    acc = getattr(torch, "accelerator", None)
    try:
        return bool(acc is not None and acc.is_available())
    except Exception:  # noqa: BLE001 -- an older torch: no accelerator API, CUDA was asked above
        return False


_LORA_MODULES = ("sglang.srt.lora.layers", "sglang.srt.lora.mem_pool", "sglang.srt.lora.lora",
                 "sglang.srt.lora.backend.torch_backend", "sglang.srt.lora.backend.base_backend",
                 "sglang.srt.lora.lora_manager")

_PATCHES = {
    "torchvision._meta_registrations": _exec_torchvision_meta,
    "sglang.srt.model_executor.model_runner_components.weight_updater": _exec_weight_updater,
    "sglang.srt.mem_cache.pool_host.common": _exec_pool_host_common,
    **{name: _exec_lora_module for name in _LORA_MODULES},
}


class _PatchedLoader(importlib.abc.Loader):
    def __init__(self, inner, patch):
        self._inner, self._patch = inner, patch

    def create_module(self, spec):
        return self._inner.create_module(spec)

    def exec_module(self, module):
        return self._patch(self._inner, module)


class _Finder(importlib.abc.MetaPathFinder):
    def find_spec(self, fullname, path, target=None):
        patch = _PATCHES.get(fullname)
        if patch is None:
            return None
        sys.meta_path.remove(self)
        try:
            spec = importlib.util.find_spec(fullname)
        finally:
            sys.meta_path.insert(0, self)
        if spec is not None and spec.loader is not None:
            spec.loader = _PatchedLoader(spec.loader, patch)
        return spec


def install() -> None:
    if not any(isinstance(f, _Finder) for f in sys.meta_path):
        sys.meta_path.insert(0, _Finder())


install()
