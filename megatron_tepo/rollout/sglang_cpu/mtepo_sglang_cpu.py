"""Start-up work-arounds for running SGLang on a CPU-only machine (loaded by a .pth file).

``tools/install_sglang_cpu.sh`` writes ``mtepo_sglang_cpu.pth`` into the SGLang venv; it puts this
directory on ``sys.path`` (so the stand-in :mod:`sgl_kernel` beside this file is importable when
the real one is absent) and imports this module in every interpreter of that venv.

Work-around 1 -- torchvision fake ops.  SGLang imports torchvision unconditionally. The torchvision
wheel on PyPI is a CUDA build; with the CPU torch its compiled ops (``torchvision/_C.so``) do not
load, and then ``torchvision/_meta_registrations.py`` fails at import time on
``torch.library.register_fake("torchvision::nms")`` with ``operator torchvision::nms does not
exist``. We hook the import of that one module and, only when torchvision's ops did not load, make
``register_fake`` for ``torchvision::*`` a no-op while it runs (there is no op to register a fake
for). Nothing else changes; with a working torchvision the hook does nothing.

The hook is installed lazily (a meta-path finder), so importing this module costs nothing and does
not import torch.
"""
from __future__ import annotations

import importlib.abc
import importlib.util
import sys

_TARGET = "torchvision._meta_registrations"


class _GuardedLoader(importlib.abc.Loader):
    def __init__(self, inner):
        self._inner = inner

    def create_module(self, spec):
        return self._inner.create_module(spec)

    def exec_module(self, module):
        import torch
        import torchvision.extension as ext

        if ext._has_ops():
            return self._inner.exec_module(module)
        real = torch.library.register_fake

        def register_fake(op, *args, **kwargs):
            if isinstance(op, str) and op.startswith("torchvision::"):
                if args and callable(args[0]):
                    return args[0]
                return lambda fn: fn
            return real(op, *args, **kwargs)

        torch.library.register_fake = register_fake
        try:
            return self._inner.exec_module(module)
        finally:
            torch.library.register_fake = real


class _Finder(importlib.abc.MetaPathFinder):
    def find_spec(self, fullname, path, target=None):
        if fullname != _TARGET:
            return None
        sys.meta_path.remove(self)
        try:
            spec = importlib.util.find_spec(fullname)
        finally:
            sys.meta_path.insert(0, self)
        if spec is not None and spec.loader is not None:
            spec.loader = _GuardedLoader(spec.loader)
        return spec


def install() -> None:
    if not any(isinstance(f, _Finder) for f in sys.meta_path):
        sys.meta_path.insert(0, _Finder())


install()
