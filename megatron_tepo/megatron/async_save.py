"""The asynchronous checkpoint saves' writer: which one (:func:`choose_async_writer`, the one choice),
how a save's tensors reach it (:data:`STAGINGS`), and the saves in flight through it
(:class:`AsyncSaves`). Two writers: nvidia-resiliency-ext's (NVRx: one persistent writer process,
the one megatron-core >= 0.19 asks for) and megatron-core's own (a forked writer per save). Either
way the writers' results queue is served by a child that dies with this process
(:mod:`megatron_tepo.children`).

The caller makes the save itself (:func:`megatron_tepo.megatron.dist_checkpoint.save` with the
writer's ``save_kwargs``) and hands its request to :meth:`AsyncSaves.schedule`; what is published
when a save's files are written (the checkpoint's marker, its rename) is the caller's finalize
function on that request (:mod:`megatron_tepo.actor.checkpointing`). A writer that cannot be had
raises the caller's ``error`` class.

NVRx's host-shm staging is taken only where ``/dev/shm`` holds what a save stages (:func:`shm_shortfall`;
the caller says the bytes). Left out: the checkpoint's folders and marker, synchronous saves, other
tenants of ``/dev/shm`` growing between the choice and a later save.
"""
from __future__ import annotations

import atexit
import functools
import os
from dataclasses import dataclass
from typing import Any, Dict, List, Optional

import torch
import torch.distributed as dist

__all__ = ["ASYNC_WRITER_ENV", "STAGINGS", "NVRX_WORKER_CONTEXT_GIB", "SHM_PATH", "AsyncWriter", "shm_shortfall",
           "choose_async_writer", "AsyncSaves"]


#: ``MTEPO_ASYNC_WRITER``: ``auto`` (the default: :func:`choose_async_writer`'s rule), ``mcore`` or ``nvrx``
#: (that writer, or an error saying why it cannot be had): for tests that run both paths.
ASYNC_WRITER_ENV = "MTEPO_ASYNC_WRITER"


#: how a save's tensors reach the writer process: by CUDA IPC handles (NVRx's default: the writer
#: opens them, with a CUDA context of its own on the GPU), copied into host shared memory first
#: (NVRx's ``use_cpu_shm_for_gpu_tensors``, megatron-core's ``cpu_shm_mode``), or copied to host
#: memory and the writer forked from the trainer (megatron-core's own writer)
STAGINGS = ("cuda_ipc", "host_shm", "host_copy")
#: the CUDA context NVRx's writer process makes on the trainer's GPU when it opens CUDA IPC handles
#: (each rank's writer on its own GPU); the fit check prices it (launch/memory.py)
NVRX_WORKER_CONTEXT_GIB = 0.5


@dataclass(frozen=True)
class AsyncWriter:
    """The writer of the asynchronous saves: ``name`` (``"nvrx"``: nvidia-resiliency-ext's, the one
    megatron-core >= 0.19 asks for; ``"mcore"``: megatron-core's own), ``save_kwargs`` (for
    ``dist_checkpointing.save``), ``why`` (said once in the log) and ``staging`` (how the tensors
    reach the writer: :data:`STAGINGS`)."""
    name: str
    save_kwargs: Dict[str, Any]
    why: str
    staging: str = "host_copy"


def _nvrx_ready() -> Optional[str]:
    """nvidia-resiliency-ext's version when megatron-core finds in it every symbol its ``nvrx`` async
    strategy uses (megatron-core's own probe, ``strategies.torch.HAVE_NVRX``; it wants >= 0.6), else None."""
    import importlib.metadata

    from megatron.core.dist_checkpointing.strategies import torch as mcore_torch_strategy

    if not getattr(mcore_torch_strategy, "HAVE_NVRX", False):
        return None
    return importlib.metadata.version("nvidia-resiliency-ext")


def mcore_has_cpu_shm_mode() -> bool:
    """Whether this megatron-core's ``TorchDistSaveShardedStrategy`` takes ``cpu_shm_mode`` (0.19.2 on)."""
    import inspect

    from megatron.core.dist_checkpointing.strategies.torch import TorchDistSaveShardedStrategy

    return "cpu_shm_mode" in inspect.signature(TorchDistSaveShardedStrategy.__init__).parameters


def _nvrx_stages_in_host_memory() -> bool:
    """Whether this megatron-core and nvidia-resiliency-ext can stage a save's GPU tensors in host
    shared memory (megatron-core's ``TorchDistSaveShardedStrategy(cpu_shm_mode=)`` from 0.19.2,
    NVRx's ``FileSystemWriterAsync(use_cpu_shm_for_gpu_tensors=)`` from 0.7)."""
    import inspect

    if not mcore_has_cpu_shm_mode():
        return False
    try:
        from nvidia_resiliency_ext.checkpointing.async_ckpt.filesystem_async import FileSystemWriterAsync
    except ImportError:
        return False
    return "use_cpu_shm_for_gpu_tensors" in inspect.signature(FileSystemWriterAsync.__init__).parameters


def _host_shm_strategy():
    from megatron.core.dist_checkpointing.strategies.torch import TorchDistSaveShardedStrategy

    return TorchDistSaveShardedStrategy(cpu_shm_mode=True)


#: where host shared memory is (NVRx's ``host_shm`` staging puts a save's tensors there)
SHM_PATH = "/dev/shm"


def shm_shortfall(staged_bytes: Optional[int], statvfs=None, path: str = SHM_PATH) -> Optional[str]:
    """Why ``path`` (``/dev/shm``) cannot hold ``staged_bytes`` (what this node's ranks stage there in
    one save), or None when it can or the bytes are not known. Its free space is ``os.statvfs``'s
    (``statvfs``: for tests). Plain Docker gives a container 64 MB unless started with ``--shm-size``
    or ``--ipc=host``; pyxis / enroot share the host's."""
    if staged_bytes is None:
        return None
    try:
        st = (statvfs or os.statvfs)(path)
    except OSError as exc:
        return f"{path} cannot be read ({exc.strerror or exc})"
    free = st.f_bavail * st.f_frsize
    if free >= staged_bytes:
        return None
    return (f"{path} has {free / 2**20:.0f} MiB free and a save stages {staged_bytes / 2**30:.2f} GiB of this node's "
            f"tensors there (plain Docker gives 64 MB unless the container is started with --shm-size or --ipc=host)")


def _any_rank(flag: bool) -> bool:
    """Whether ``flag`` holds on any rank (collective where a process group is up: every rank makes
    the same choice of writer)."""
    if not dist.is_initialized():
        return flag
    device = "cuda" if "nccl" in str(dist.get_backend()) else "cpu"
    t = torch.tensor([1 if flag else 0], device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return bool(t.item())


def choose_async_writer(save_fn=None, nvrx_version: Optional[str] = "probe",
                        wanted: Optional[str] = None, expandable: Optional[bool] = None,
                        host_shm: Optional[bool] = None, on_gpu: Optional[bool] = None,
                        error: type = RuntimeError, staged_bytes: Optional[int] = None,
                        statvfs=None) -> AsyncWriter:
    """THE choice of the asynchronous saves' writer and of how the tensors reach it: NVRx's where
    megatron-core's ``dist_checkpointing.save`` takes ``async_strategy`` (>= 0.19, which deprecates
    its own writer) and nvidia-resiliency-ext is importable with what megatron-core needs;
    megatron-core's own writer elsewhere (megatron-core 0.16.1, or NVRx missing).

    NVRx hands a save's GPU tensors to its writer process by CUDA IPC, unless they are staged in host
    shared memory first. Tensors in the allocator's expandable segments (the trainer's
    ``PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True``, slurm/lib.sh) share by a file descriptor that
    the receiver opens with ``pidfd_getfd``, which containers without ptrace and Yama
    ``ptrace_scope=1`` refuse (pytorch#165685: the first save fails). So with expandable segments (or
    NVRx's writer gets host shared memory (``staging`` ``host_shm``), and where this stack cannot do
    that, megatron-core's own writer (host copies, a forked writer) is used instead -- and also where
    ``/dev/shm`` has less room than a save stages (``staged_bytes``: this node's ranks' checkpoint
    bytes; :func:`shm_shortfall`; decided on every rank alike: plain Docker's 64 MB failed the first
    save); CUDA IPC (``cuda_ipc``) only with ordinary segments. Without CUDA the tensors are on the host already
    (``host_copy``: NVRx's writer gets copies, and makes no CUDA context).

    ``save_fn`` (default megatron-core's ``dist_checkpointing.save``), ``nvrx_version`` (default:
    probed; None: not installed), ``wanted`` (default ``$MTEPO_ASYNC_WRITER`` or ``auto``),
    ``expandable`` (default: the CUDA allocator's setting now), ``host_shm`` (whether the stack can
    stage in host shared memory; default: probed), ``on_gpu`` (default: whether CUDA is there) and
    ``statvfs`` (default ``os.statvfs``) are for tests; ``staged_bytes`` None: ``/dev/shm`` is not
    checked. A ``wanted`` that is not known, or NVRx's writer asked for where it cannot be had, raises
    ``error`` (the actor's :class:`~megatron_tepo.checkpoint.store.CheckpointError`)."""
    import inspect

    from megatron_tepo.cuda_alloc import expandable_segments_on
    from megatron_tepo.megatron.compat import async_save_kwargs, mcore_version

    if save_fn is None:
        from megatron.core.dist_checkpointing import save as save_fn
    wanted = wanted or os.environ.get(ASYNC_WRITER_ENV) or "auto"
    if wanted not in ("auto", "mcore", "nvrx"):
        raise error(f"{ASYNC_WRITER_ENV}={wanted!r}: expected auto, mcore or nvrx")
    mcore = AsyncWriter("mcore", async_save_kwargs(save_fn), "", "host_copy")
    if "async_strategy" not in inspect.signature(save_fn).parameters:
        why = f"megatron-core {mcore_version()} has no async_strategy"
    else:
        if nvrx_version == "probe":
            nvrx_version = _nvrx_ready()
        why = (f"{ASYNC_WRITER_ENV}=mcore" if nvrx_version is not None else
               "nvidia-resiliency-ext >= 0.6 is not installed: docs/FAULT_TOLERANCE.md")
        if nvrx_version is not None and wanted != "mcore":
            on_gpu = torch.cuda.is_available() if on_gpu is None else on_gpu
            expandable = expandable_segments_on() if expandable is None else expandable
            kwargs, named = {"async_sharded_save": True, "async_strategy": "nvrx"}, f"nvidia-resiliency-ext {nvrx_version}"
            if not on_gpu:
                return AsyncWriter("nvrx", kwargs, f"{named}; no CUDA", "host_copy")
            if not expandable:
                return AsyncWriter("nvrx", kwargs, f"{named}; GPU tensors by CUDA IPC", "cuda_ipc")
            host_shm = _nvrx_stages_in_host_memory() if host_shm is None else host_shm
            short = shm_shortfall(staged_bytes, statvfs) if host_shm else None
            if host_shm and staged_bytes is not None and _any_rank(short is not None):
                why = (f"{named} would stage GPU tensors in host shared memory (expandable segments cannot go by "
                       f"CUDA IPC where pidfd_getfd is refused), but {short or 'another node has too little /dev/shm'}")
            elif host_shm:
                return AsyncWriter("nvrx", {**kwargs, "sharded_strategy": _host_shm_strategy()},
                                   f"{named}; GPU tensors staged in host shared memory: expandable segments cannot "
                                   f"go by CUDA IPC where pidfd_getfd is refused", "host_shm")
            else:
                why = (f"{named} with megatron-core {mcore_version()} cannot stage GPU tensors in host shared memory "
                       f"(NVRx >= 0.7's use_cpu_shm_for_gpu_tensors, megatron-core >= 0.19.2's cpu_shm_mode), and "
                       f"expandable segments cannot go by CUDA IPC where pidfd_getfd is refused (pytorch#165685)")
    if wanted == "nvrx":
        raise error(f"{ASYNC_WRITER_ENV}=nvrx: NVRx's writer cannot be had here: {why}")
    return AsyncWriter(mcore.name, mcore.save_kwargs, why, mcore.staging)


_ANNOUNCED: List[str] = []  # the writer this process said it uses (once)


def _announce(writer: AsyncWriter) -> None:
    if not _ANNOUNCED and (not dist.is_initialized() or dist.get_rank() == 0):
        name = {"nvrx": "NVRx (nvidia-resiliency-ext)", "mcore": "megatron-core's own"}[writer.name]
        print(f"[megatron_tepo] asynchronous checkpoint saves: {name} writer, staging {writer.staging} "
              f"({writer.why})", flush=True)
    _ANNOUNCED.append(writer.name)


class AsyncSaves:
    """The asynchronous checkpoint saves of one actor, at most one in flight, through the writer
    :func:`choose_async_writer` picks: megatron-core's ``AsyncCallsQueue`` (a forked writer per save,
    writing from its own copy) or NVRx's (one persistent writer process, given a copy of the
    tensors, made to die with this process: ``megatron_tepo/children.py``). Either way the writers'
    results queue is served by a child that dies with this process. Every method is collective (all
    ranks call it at the same point). ``writer``: :func:`choose_async_writer`'s choice."""

    def __init__(self, writer: AsyncWriter):
        from megatron_tepo.children import checkpoint_results_queue

        self.writer = writer
        _announce(self.writer)
        if self.writer.name == "nvrx":
            from nvidia_resiliency_ext.checkpointing.async_ckpt import filesystem_async
            from nvidia_resiliency_ext.checkpointing.async_ckpt.core import AsyncCallsQueue

            # staged in host shared memory (or without CUDA): its writer process makes no CUDA context
            self.queue = AsyncCallsQueue(persistent=True, cpu_shm_mode=self.writer.staging != "cuda_ipc")
            checkpoint_results_queue(filesystem_async)
            atexit.register(self._close_queue)  # (its writer process is stopped before Python tears down)
        else:
            from megatron.core.dist_checkpointing.strategies import filesystem_async
            from megatron.core.dist_checkpointing.strategies.async_utils import AsyncCallsQueue

            self.queue = AsyncCallsQueue()  # (a forked writer per save: it writes from its own copy)
            checkpoint_results_queue(filesystem_async)

    def schedule(self, request) -> None:
        if self.writer.name == "nvrx" and request.async_fn is not None:
            from megatron_tepo.children import call_dying_with_parent

            # (the persistent writer runs it: from its first save on, it dies with this process)
            request = request._replace(async_fn=functools.partial(call_dying_with_parent, os.getpid(),
                                                                  request.async_fn))
        self.queue.schedule_async_request(request)

    def finalize(self, blocking: bool = False) -> int:
        """Publish every save whose files are written (``blocking``: wait for them first); returns
        how many saves are still in flight."""
        self.queue.maybe_finalize_async_calls(blocking=blocking)
        return self.queue.get_num_unfinalized_calls()

    def close(self) -> None:
        self.finalize(blocking=True)
        self._close_queue()

    def _close_queue(self) -> None:
        """Close the queue (at exit: NVRx's writer process is stopped; a save still in flight then,
        after a failure, is abandoned unpublished)."""
        if self.writer.name != "nvrx":
            self.queue.close()
            return
        self.queue.close(abort=self.queue.get_num_unfinalized_calls() > 0)
        self.queue.cpu_shm_mode = False  # (else its __del__ imports again at shutdown to undo what close() did)
