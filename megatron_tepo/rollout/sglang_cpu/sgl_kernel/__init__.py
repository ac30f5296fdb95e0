"""Stand-in for ``sgl_kernel`` (SGLang's compiled kernels) on a CPU-only machine.

There is no CPU wheel of ``sgl_kernel`` / ``sglang-kernel`` on PyPI, yet SGLang's CPU engine
imports a few names from it at module level. On a CPU without AMX none of them is called (the
torch-native attention and PyTorch sampling back-ends are used), so this module provides every
name, and every submodule, as a placeholder that raises a clear error *when called*. If the real
package is installed it wins: this directory is appended to ``sys.path`` after site-packages.
"""
from __future__ import annotations

import importlib.abc
import importlib.machinery
import sys
import types

IS_STAND_IN = True
__version__ = "0.0.0+mtepo-stand-in"


class _Missing:
    def __init__(self, name: str):
        self._name = name

    def __call__(self, *args, **kwargs):
        raise NotImplementedError(
            f"sgl_kernel.{self._name} was called, but sgl_kernel is the megatron_tepo CPU stand-in "
            "(megatron_tepo/rollout/sglang_cpu/sgl_kernel): this SGLang code path needs the real "
            "compiled kernels (a GPU, or an AMX CPU build)")

    def __getattr__(self, item):
        if item.startswith("__"):
            raise AttributeError(item)
        return _Missing(f"{self._name}.{item}")

    def __repr__(self):
        return f"<sgl_kernel stand-in {self._name}>"


def __getattr__(name: str):
    if name.startswith("__"):
        raise AttributeError(name)
    return _Missing(name)


class _SubmoduleFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Any ``sgl_kernel.<sub>`` import yields a module of placeholders."""

    def find_spec(self, fullname, path, target=None):
        if fullname.startswith(__name__ + "."):
            return importlib.machinery.ModuleSpec(fullname, self, is_package=True)
        return None

    def create_module(self, spec):
        mod = types.ModuleType(spec.name)
        mod.__path__ = []
        sub = spec.name[len(__name__) + 1:]
        mod.__getattr__ = lambda item: (_ for _ in ()).throw(AttributeError(item)) \
            if item.startswith("__") else _Missing(f"{sub}.{item}")
        return mod

    def exec_module(self, module):
        pass


sys.meta_path.append(_SubmoduleFinder())
