"""torch's CUDA caching allocator: whether it makes expandable segments, and a scope whose
allocations are never in one (:func:`no_expandable_segments`).

The trainer runs with ``PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True`` (slurm/lib.sh: packed
micro-batches change size every step, which fragments fixed segments). A tensor in an expandable
segment shares by CUDA IPC as a file descriptor that the receiving process opens through
``pidfd_getfd``, which containers without the ptrace capability and hosts with Yama
``ptrace_scope=1`` refuse (``RuntimeError: pidfd_getfd: Operation not permitted``,
pytorch/pytorch#165685). So the buffers that go out by CUDA IPC (the weight export's, which the
``ipc`` sync hands to the SGLang servers) are allocated with the setting off around them, as
SGLang's and verl's senders do; the rest of the process keeps it.

torch's setter and getter: ``torch._C._accelerator_setAllocatorSettings`` /
``_accelerator_getAllocatorSettings`` (torch 2.9 on), else ``torch.cuda.memory._set_allocator_settings``
and the process's ``PYTORCH_ALLOC_CONF`` / ``PYTORCH_CUDA_ALLOC_CONF``. Left out: other devices'
allocators (nothing here shares their memory across processes); on a machine without CUDA the
scope does nothing. (torch is imported where it is used: the launch side reads a setting with
:func:`expandable_in` without it.)
"""
from __future__ import annotations

import contextlib
import os
import threading
from typing import Iterator

__all__ = ["expandable_segments_on", "no_expandable_segments", "expandable_in"]

_lock = threading.Lock()


def _get_settings() -> str:
    import torch

    get = getattr(torch._C, "_accelerator_getAllocatorSettings", None)
    if get is not None:
        try:
            return str(get())
        except RuntimeError:  # (no allocator yet on this build)
            pass
    return os.environ.get("PYTORCH_ALLOC_CONF") or os.environ.get("PYTORCH_CUDA_ALLOC_CONF") or ""


def _set_settings(conf: str) -> None:
    import torch

    set_ = getattr(torch._C, "_accelerator_setAllocatorSettings", None)
    if set_ is None:
        set_ = torch.cuda.memory._set_allocator_settings
    set_(conf)


def expandable_in(conf: str) -> bool:
    """Whether an allocator setting (``key:value,key:value``, as ``PYTORCH_CUDA_ALLOC_CONF``) turns
    expandable segments on."""
    for item in conf.split(","):
        key, _, value = item.partition(":")
        if key.strip() == "expandable_segments":
            return value.strip().lower() in ("true", "1")
    return False


def expandable_segments_on() -> bool:
    """Whether the CUDA allocator makes expandable segments now (False without CUDA)."""
    import torch

    return torch.cuda.is_available() and expandable_in(_get_settings())


@contextlib.contextmanager
def no_expandable_segments() -> Iterator[None]:
    """CUDA allocations made inside are ordinary segments (their IPC handles open in another
    process without ``pidfd_getfd``); the setting is as it was afterwards. One scope at a time."""
    with _lock:
        on = expandable_segments_on()
        if on:
            _set_settings("expandable_segments:False")
        try:
            yield
        finally:
            if on:
                _set_settings("expandable_segments:True")
