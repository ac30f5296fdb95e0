"""Helper processes that die with the process that started them, ``kill -9`` included (Linux):
:func:`die_with_parent`, called first thing in a child (the math-reward workers), and
:func:`checkpoint_results_queue`, megatron-core's asynchronous-save results queue served by such a
child, and :func:`call_dying_with_parent`, which NVRx's persistent checkpoint writer runs.

megatron-core's asynchronous checkpoint writer reports through a ``multiprocessing`` queue that a
Manager serves from a spawned server process (``filesystem_async._results_queue``, made on the
first asynchronous save, 0.16.1 and 0.19.x alike). Python stops that server when the trainer exits
normally; after a ``kill -9`` (the OOM killer, a user, a supervisor) nothing does, and it stays for
good, with the trainer's imports in memory (about 0.5 GB on CPU). Under Slurm the step's end kills
it; on a workstation or a supervisor's restart loop it piles up, one per kill.

Standard library only. Left out: other platforms (``PR_SET_PDEATHSIG`` is Linux's; elsewhere the
children behave as before), and megatron's forked writer itself, which finishes its write and exits
(NVRx's persistent writer, which waits for the next save, dies with the trainer instead).
"""
from __future__ import annotations

import os

__all__ = ["die_with_parent", "call_dying_with_parent", "checkpoint_results_queue"]

_MANAGERS = []  # the Manager behind the queue: kept, so its finalizer runs only at exit


def die_with_parent(parent_pid: int) -> None:
    """In a child: the kernel kills this process when its parent dies (``PR_SET_PDEATHSIG``); if the
    parent (``parent_pid``) is already gone, exit now. (The kernel's "parent" is the thread that
    started the child: start it from a thread that lives as long as the process, the main one.)"""
    try:
        import ctypes
        import signal

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass
    if os.getppid() != parent_pid:  # the parent died before the line above took effect
        os._exit(0)


def call_dying_with_parent(parent_pid: int, fn, *args, **kwargs):
    """``fn(*args, **kwargs)`` in a child that from now on dies with its parent (:func:`die_with_parent`):
    what NVRx's persistent checkpoint writer runs for each save (it would otherwise wait for the next
    one for good once the trainer is killed)."""
    die_with_parent(parent_pid)
    return fn(*args, **kwargs)


def checkpoint_results_queue(filesystem_async):
    """megatron-core's asynchronous-save results queue, made now (once per process) and served by a
    Manager whose server process dies with this one; returns it. ``filesystem_async``: the writer's
    module that holds the queue (``megatron.core.dist_checkpointing.strategies.filesystem_async``;
    NVRx's writer has its own, ``nvidia_resiliency_ext.checkpointing.async_ckpt.filesystem_async``,
    the same way), imported by the caller (megatron_tepo/megatron/async_save.py). A queue
    megatron already made is left as it is."""
    import multiprocessing as mp
    from multiprocessing.managers import SyncManager

    if getattr(filesystem_async, "_results_queue", None) is None:
        manager = SyncManager(ctx=mp.get_context("spawn"))  # (megatron's own context)
        manager.start(initializer=die_with_parent, initargs=(os.getpid(),))
        _MANAGERS.append(manager)
        filesystem_async._results_queue = manager.Queue()
    return filesystem_async._results_queue
