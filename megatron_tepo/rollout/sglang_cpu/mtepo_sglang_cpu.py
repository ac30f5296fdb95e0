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
``SGLANG_USE_CPU_ENGINE=1``, which ``sglang_fleet.server_command`` sets for ``device="cpu"``).
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
"""
from __future__ import annotations

import importlib.abc
import importlib.util
import logging
import os
import sys

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


def _exec_weight_updater(inner, module):
    inner.exec_module(module)
    if os.environ.get("SGLANG_USE_CPU_ENGINE") != "1" or os.environ.get("MTEPO_SGLANG_RECV_BUFFER", "1") == "0":
        return
    import torch

    cls = module.WeightUpdater
    bucket_cls = module.FlattenedTensorBucket
    orig_load = cls.load_weights_from_distributed

    def _receive_bucketed_weights_from_distributed(self, *, names, dtypes, shapes, group_name):
        empty = bucket_cls.empty(names, dtypes, shapes, "meta")  # the layout checks, no memory
        nbytes = empty.get_flattened_tensor().numel()
        flat = _recv_buffer(nbytes, self.device)[:nbytes]
        torch.distributed.broadcast(flat, src=0, group=self._model_update_group[group_name])
        return bucket_cls(flattened_tensor=flat, metadata=empty.get_metadata()).reconstruct_tensors()

    def load_weights_from_distributed(self, named_tensors):
        try:
            return orig_load(self, named_tensors)
        finally:
            buf = _recv_buffers.get(str(self.device))
            if buf is not None and _points_into(self.get_model(), buf):
                log.warning("mtepo: a weight loader kept a received tensor; the receive buffer is "
                            "left to the model and the next bucket gets a new one")
                _recv_buffers.pop(str(self.device), None)

    cls._receive_bucketed_weights_from_distributed = _receive_bucketed_weights_from_distributed
    cls.load_weights_from_distributed = load_weights_from_distributed
    cls._mtepo_recv_buffer = True


_PATCHES = {
    "torchvision._meta_registrations": _exec_torchvision_meta,
    "sglang.srt.model_executor.model_runner_components.weight_updater": _exec_weight_updater,
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
