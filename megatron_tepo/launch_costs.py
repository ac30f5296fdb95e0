"""Count what a GPU pays for, on any device: the aten ops a piece of code dispatches (each is at
least one kernel launch on a GPU), its host syncs (a read of a tensor's value on the host:
``.item()``, ``float(t)``, ``bool(t)``, ``.tolist()``, a non-``non_blocking`` copy to the host), and
the graphs ``torch.compile`` builds.

On a CPU machine a launch-bound GPU step cannot be timed, but its cost can be counted: these
counts are what ``benchmarks/actor_step.py --counts`` prints and what the actor's launch-overhead
tests assert on (``tests/megatron/test_launch_costs.py``).

:class:`LaunchCounter` is a context manager; ``with LaunchCounter() as c: ...`` then ``c.ops`` (total
aten ops, backward included where it runs inside), ``c.by_op`` (a Counter by op name), ``c.syncs``
(host syncs) and ``c.sync_sites`` (where each happened: ``file:line`` of the first frame outside
torch). :func:`paused` leaves a region out, :func:`uncounted` a function's forward and backward
(e.g. a core attention that is one call per sequence by necessity on CPU). :func:`compiles`
counts dynamo's compiled graphs so far.

Left out: real kernel counts (an aten op may launch several kernels, a fused one fewer), and
device-to-host copies of CPU tensors (they cost nothing here, so a ``.cpu()`` on a CPU machine is
not seen; ``.tolist()`` / ``.item()`` are).
"""
from __future__ import annotations

import collections
import contextlib
import functools
import threading
import traceback
from typing import Callable, Counter

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

__all__ = ["LaunchCounter", "paused", "uncounted", "compiles"]

#: aten ops that read a value on the host (every ``.item()``, ``float()``, ``bool()`` goes through one)
_SYNC_OPS = ("_local_scalar_dense",)
#: Tensor methods that read values on the host without a ``_local_scalar_dense`` per value
_SYNC_METHODS = ("tolist", "numpy")


def _site() -> str:
    for frame in reversed(traceback.extract_stack()[:-2]):
        name = frame.filename.replace("\\", "/")
        if "/torch/" not in name and not name.endswith("launch_costs.py"):
            return f"{name.rsplit('/', 3)[-2:][0]}/{name.rsplit('/', 1)[-1]}:{frame.lineno}"
    return "?"


class _Dispatch(TorchDispatchMode):
    def __init__(self, owner: "LaunchCounter"):
        super().__init__()
        self.owner = owner

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.owner._op(func)
        return func(*args, **(kwargs or {}))


class _Function(TorchFunctionMode):
    def __init__(self, owner: "LaunchCounter"):
        super().__init__()
        self.owner = owner

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if getattr(func, "__name__", "") in _SYNC_METHODS and not _paused_here():
            self.owner._sync()
        return func(*args, **(kwargs or {}))


_PAUSED = threading.local()


def _paused_here() -> bool:
    return bool(getattr(_PAUSED, "depth", 0))


@contextlib.contextmanager
def paused():
    """Nothing inside is counted by any counter (this thread)."""
    _PAUSED.depth = getattr(_PAUSED, "depth", 0) + 1
    try:
        yield
    finally:
        _PAUSED.depth -= 1


class _Uncounted(torch.autograd.Function):
    @staticmethod
    def forward(ctx, run, *tensors):
        ctx.run = run
        ctx.save_for_backward(*tensors)
        with paused():
            return run(tensors)

    @staticmethod
    def backward(ctx, grad):
        with paused(), torch.enable_grad():
            inputs = [t.detach().requires_grad_(t.requires_grad) for t in ctx.saved_tensors]
            wanted = [x for x in inputs if x.requires_grad]
            grads = iter(torch.autograd.grad(ctx.run(inputs), wanted, grad) if wanted else ())
            return (None, *[next(grads) if x.requires_grad else None for x in inputs])


def uncounted(fn: Callable) -> Callable:
    """``fn`` with its forward and its backward left out of every count; its floating-point tensor
    arguments get their gradients (the backward recomputes the forward: for counting runs only)."""
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        slots = [i for i, a in enumerate(args) if isinstance(a, torch.Tensor) and a.is_floating_point()]

        def run(tensors):
            full = list(args)
            for i, t in zip(slots, tensors):
                full[i] = t
            return fn(*full, **kwargs)

        return _Uncounted.apply(run, *[args[i] for i in slots])

    return wrapper


class LaunchCounter:
    """Counts aten ops, host syncs and where the syncs happen (see the module docstring)."""

    def __init__(self, sites: bool = True):
        self.by_op: Counter[str] = collections.Counter()
        self.syncs = 0
        self.sync_sites: Counter[str] = collections.Counter()
        self._sites = sites
        self._stack = contextlib.ExitStack()

    @property
    def ops(self) -> int:
        return sum(self.by_op.values())

    def _sync(self) -> None:
        self.syncs += 1
        if self._sites:
            self.sync_sites[_site()] += 1

    def _op(self, func) -> None:
        if _paused_here():
            return
        name = func.__name__.split(".")[0]
        self.by_op[name] += 1
        if name in _SYNC_OPS:
            self._sync()

    def __enter__(self) -> "LaunchCounter":
        self._stack.enter_context(_Function(self))
        self._stack.enter_context(_Dispatch(self))
        return self

    def __exit__(self, *exc) -> None:
        self._stack.close()

    def summary(self) -> dict:
        return {"ops": self.ops, "syncs": self.syncs, "sync_sites": dict(self.sync_sites.most_common(8))}


def compiles() -> int:
    """Graphs dynamo has compiled in this process so far (``torch._dynamo.utils.counters``)."""
    from torch._dynamo.utils import counters

    return int(counters["stats"]["unique_graphs"])
