"""Training checkpoints of the Megatron actor: atomic, resumable bit-exactly at the same layout.

Layout of one checkpoint directory (e.g. ``<root>/step_<N>``)::

    complete            JSON marker, written LAST (step, time, layout): no marker = no checkpoint
    extra_state.json    the caller's JSON state (trainer step, data position, ...)
    rng/rank<R>.pt      RNG states of global rank R (python, numpy, torch CPU, CUDA, megatron tracker)
    metadata.json, common.pt, __*.distcp, ...   megatron-core dist_checkpointing (torch_dist):
                        model (``sharded_state_dict``), optimizer, LR scheduler (common state;
                        inside the .distcp files from megatron-core 0.19 on, no common.pt)

:func:`save_actor_checkpoint` (a collective over all ranks) writes everything into
``<directory>.tmp-<id>``; after a barrier rank 0 writes the marker, renames the temporary
directory to ``<directory>`` and fsyncs the parent. A crash at any point leaves either a
``*.tmp-*`` directory or nothing: the store (:mod:`megatron_tepo.checkpoint.store`) ignores both, and
:func:`load_actor_checkpoint` refuses any directory without the marker.

The model tensors use megatron's sharded keys, so the model part is loadable at another TP/PP
(``load_actor_checkpoint(..., model_only=True)``, or ``checkpoint.load_checkpoint_into``) -- by
the same model builder only (``actor.model_builder``: a ``HybridModel``'s keys are not a
``GPTModel``'s); the marker's layout records it, and a mismatch is refused naming the setting.
A full load (optimizer, scheduler, RNG) requires the layout and precision it was saved at (a bf16
actor's optimizer holds fp32 main parameters that an fp32 one does not). The distributed
optimizer is saved with ``distrib_optim_sharding_type = "dp_reshardable"``.

Assumes a file system shared by all ranks (every rank writes its own shards and RNG file).
"""
from __future__ import annotations

import atexit
import functools
import json
import os
import random
import shutil
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional

import torch
import torch.distributed as dist

from megatron_tepo.checkpoint.store import (COMPLETE_MARKER, EXTRA_STATE, FORMAT, RNG_DIR, CheckpointError,
                                             PathLike, check_checkpoint_files, global_rank, fsync_dir,
                                             list_complete_checkpoints, read_marker, write_file_atomic)
from megatron_tepo.megatron.parallel import raise_if_any_rank_failed

__all__ = ["save_actor_checkpoint", "load_actor_checkpoint", "load_newest_checkpoint", "get_rng_state",
           "set_rng_state", "actor_layout", "AsyncSaves", "AsyncWriter", "choose_async_writer", "STAGINGS",
           "NVRX_WORKER_CONTEXT_GIB"]

DIST_OPT_METADATA = {"distrib_optim_sharding_type": "dp_reshardable"}


# ---------------------------------------------------------------------------------------------
# RNG
# ---------------------------------------------------------------------------------------------
def get_rng_state() -> Dict[str, Any]:
    """Python, numpy, torch CPU, CUDA (when available) and megatron's model-parallel RNG tracker
    states of this process (the tracker holds CPU generator states under the CPU patches)."""
    import numpy as np
    from megatron.core.tensor_parallel.random import get_cuda_rng_tracker

    state = {
        "python": random.getstate(),
        "numpy": np.random.get_state(),
        "torch_cpu": torch.get_rng_state(),
        "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None,
        "tracker": {k: v.clone() for k, v in get_cuda_rng_tracker().get_states().items()},
    }
    return state


def set_rng_state(state: Dict[str, Any]) -> None:
    import numpy as np
    from megatron.core.tensor_parallel.random import get_cuda_rng_tracker

    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch_cpu"])
    if state.get("cuda") is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])
    get_cuda_rng_tracker().set_states({k: v.clone() for k, v in state["tracker"].items()})


# ---------------------------------------------------------------------------------------------
# save / load
# ---------------------------------------------------------------------------------------------
def _barrier() -> None:
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.barrier()


def _broadcast_obj(obj):
    if dist.is_initialized() and dist.get_world_size() > 1:
        box = [obj]
        dist.broadcast_object_list(box, src=0)
        return box[0]
    return obj


def _agree_ok(error: Optional[BaseException]) -> None:
    """Raise on every rank if any rank failed (so no rank is left waiting in a collective)."""
    raise_if_any_rank_failed(error, "checkpoint", CheckpointError)


def actor_layout(actor) -> Dict[str, Any]:
    ps = actor._ps
    return {
        "world_size": dist.get_world_size() if dist.is_initialized() else 1,
        "tp": ps.get_tensor_model_parallel_world_size(),
        "pp": ps.get_pipeline_model_parallel_world_size(),
        "ep": ps.get_expert_model_parallel_world_size(),
        "dp": ps.get_data_parallel_world_size(),
        "distributed_optimizer": bool(actor.optim_cfg.use_distributed_optimizer),
        "precision": actor.settings.precision,
        "model_builder": actor.settings.model_builder,
    }


def _model_sharded_state_dict(actor):
    chunks = [c.module for c in actor.model]  # (megatron DDP has no sharded_state_dict of its own)
    if len(chunks) != 1:
        raise NotImplementedError("checkpointing supports one model chunk per rank (no virtual PP)")
    return chunks[0].sharded_state_dict()


def _optimizer_metadata(actor) -> Optional[dict]:
    return dict(DIST_OPT_METADATA) if actor.optim_cfg.use_distributed_optimizer else None


def _ensure_torch_adam_state(actor) -> None:
    """A fresh distributed optimizer without apex/TE (torch Adam) cannot build its sharded state
    dict: ``DistributedOptimizer.state_dict`` reads the per-param ``step`` of a state that only
    exists after a first step. Give every param placeholder Adam state (zeros, step 0); the load
    overwrites all of it. No-op for optimizers that already stepped, or are not torch Adam/AdamW."""
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    for opt in getattr(actor.optimizer, "chained_optimizers", [actor.optimizer]):
        inner = getattr(opt, "optimizer", None)
        if not isinstance(opt, DistributedOptimizer) or not isinstance(inner, (torch.optim.Adam, torch.optim.AdamW)):
            continue
        for group in inner.param_groups:
            for p in group["params"]:
                if p not in inner.state or "step" not in inner.state[p]:
                    st = {"step": torch.tensor(0.0), "exp_avg": torch.zeros_like(p),
                          "exp_avg_sq": torch.zeros_like(p)}
                    if group.get("amsgrad"):
                        st["max_exp_avg_sq"] = torch.zeros_like(p)
                    inner.state[p] = st


def _saved_adam_steps(actor, loaded_optimizer) -> List[Optional[float]]:
    """Per sub-optimizer: the Adam step saved with a distributed optimizer's param groups (torch
    Adam, no apex/TE), else None. Read BEFORE ``load_state_dict`` (which may consume the dict)."""
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    subs = getattr(actor.optimizer, "chained_optimizers", [actor.optimizer])
    out: List[Optional[float]] = []
    for idx, opt in enumerate(subs):
        inner = getattr(opt, "optimizer", None)
        step = None
        if isinstance(opt, DistributedOptimizer) and isinstance(inner, (torch.optim.Adam, torch.optim.AdamW)):
            sd = loaded_optimizer if len(subs) == 1 else loaded_optimizer[idx]
            steps = {g.get("step") for g in sd["optimizer"]["param_groups"]} - {None}
            if len(steps) > 1:
                raise CheckpointError(f"inconsistent optimizer steps in the checkpoint: {sorted(steps)}")
            step = float(steps.pop()) if steps else None
        out.append(step)
    return out


def _fix_torch_adam_steps(actor, saved_steps: List[Optional[float]]) -> None:
    """Two megatron-core 0.16 faults of the distributed optimizer on torch Adam (no apex/TE), both
    about Adam's per-param ``step``:

    * the ``dp_reshardable`` param state carries ``step`` as a non-persistent object, so the load
      copies the TEMPLATE's step (the fresh optimizer's) over the restored one;
    * ``DistributedOptimizer.load_state_dict`` puts ONE step tensor into every param's state, and
      torch Adam increments it in place once per param per step (wrong bias correction).

    The true step is the one saved with the param groups (common state): give every param its own
    tensor of that value. Other optimizers restore ``step`` correctly; their step tensors are only
    un-shared, as a guard."""
    subs = getattr(actor.optimizer, "chained_optimizers", [actor.optimizer])
    for opt, step in zip(subs, saved_steps):
        inner = getattr(opt, "optimizer", None)
        if not isinstance(inner, torch.optim.Optimizer):
            continue
        for st in inner.state.values():
            old = st.get("step")
            if isinstance(old, torch.Tensor):
                st["step"] = (torch.tensor(step, dtype=old.dtype, device=old.device)
                              if step is not None else old.clone())


def _sharded_state_dict(actor, is_loading: bool, with_optimizer: bool = True) -> Dict[str, Any]:
    model_sd = _model_sharded_state_dict(actor)
    if with_optimizer and is_loading:
        _ensure_torch_adam_state(actor)
    state: Dict[str, Any] = {"model": model_sd}
    if with_optimizer:
        state["optimizer"] = actor.optimizer.sharded_state_dict(
            model_sd, is_loading=is_loading, metadata=_optimizer_metadata(actor))
        state["scheduler"] = actor.scheduler.state_dict()
    return state


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


def _nvrx_stages_in_host_memory() -> bool:
    """Whether this megatron-core and nvidia-resiliency-ext can stage a save's GPU tensors in host
    shared memory (megatron-core's ``TorchDistSaveShardedStrategy(cpu_shm_mode=)`` from 0.19.2,
    NVRx's ``FileSystemWriterAsync(use_cpu_shm_for_gpu_tensors=)`` from 0.7)."""
    import inspect

    from megatron.core.dist_checkpointing.strategies.torch import TorchDistSaveShardedStrategy

    if "cpu_shm_mode" not in inspect.signature(TorchDistSaveShardedStrategy.__init__).parameters:
        return False
    try:
        from nvidia_resiliency_ext.checkpointing.async_ckpt.filesystem_async import FileSystemWriterAsync
    except ImportError:
        return False
    return "use_cpu_shm_for_gpu_tensors" in inspect.signature(FileSystemWriterAsync.__init__).parameters


def _host_shm_strategy():
    from megatron.core.dist_checkpointing.strategies.torch import TorchDistSaveShardedStrategy

    return TorchDistSaveShardedStrategy(cpu_shm_mode=True)


def choose_async_writer(save_fn=None, nvrx_version: Optional[str] = "probe",
                        wanted: Optional[str] = None, expandable: Optional[bool] = None,
                        host_shm: Optional[bool] = None, on_gpu: Optional[bool] = None) -> AsyncWriter:
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
    that, megatron-core's own writer (host copies, a forked writer) is used instead; CUDA IPC
    (``cuda_ipc``) only with ordinary segments. Without CUDA the tensors are on the host already
    (``host_copy``: NVRx's writer gets copies, and makes no CUDA context).

    ``save_fn`` (default megatron-core's ``dist_checkpointing.save``), ``nvrx_version`` (default:
    probed; None: not installed), ``wanted`` (default ``$MTEPO_ASYNC_WRITER`` or ``auto``),
    ``expandable`` (default: the CUDA allocator's setting now), ``host_shm`` (whether the stack can
    stage in host shared memory; default: probed) and ``on_gpu`` (default: whether CUDA is there) are
    for tests."""
    import inspect

    from megatron_tepo.cuda_alloc import expandable_segments_on
    from megatron_tepo.megatron.compat import async_save_kwargs, mcore_version

    if save_fn is None:
        from megatron.core.dist_checkpointing import save as save_fn
    wanted = wanted or os.environ.get(ASYNC_WRITER_ENV) or "auto"
    if wanted not in ("auto", "mcore", "nvrx"):
        raise CheckpointError(f"{ASYNC_WRITER_ENV}={wanted!r}: expected auto, mcore or nvrx")
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
            if host_shm:
                return AsyncWriter("nvrx", {**kwargs, "sharded_strategy": _host_shm_strategy()},
                                   f"{named}; GPU tensors staged in host shared memory: expandable segments cannot "
                                   f"go by CUDA IPC where pidfd_getfd is refused", "host_shm")
            why = (f"{named} with megatron-core {mcore_version()} cannot stage GPU tensors in host shared memory "
                   f"(NVRx >= 0.7's use_cpu_shm_for_gpu_tensors, megatron-core >= 0.19.2's cpu_shm_mode), and "
                   f"expandable segments cannot go by CUDA IPC where pidfd_getfd is refused (pytorch#165685)")
    if wanted == "nvrx":
        raise CheckpointError(f"{ASYNC_WRITER_ENV}=nvrx: NVRx's writer cannot be had here: {why}")
    return AsyncWriter(mcore.name, mcore.save_kwargs, why, mcore.staging)


_ANNOUNCED: List[str] = []  # the writer this process said it uses (once)


def _announce(writer: AsyncWriter) -> None:
    if not _ANNOUNCED and global_rank() == 0:
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
    ranks call it at the same point)."""

    def __init__(self, writer: Optional[AsyncWriter] = None):
        from megatron_tepo.children import checkpoint_results_queue

        self.writer = writer or choose_async_writer()
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


def save_actor_checkpoint(actor, directory: PathLike, extra_state: Optional[dict] = None,
                          write_extra: Optional[Callable[[Path], None]] = None,
                          saves: Optional[AsyncSaves] = None,
                          on_publish: Optional[Callable[[Path], None]] = None) -> Path:
    """Collective: write ``actor``'s full training state to ``directory`` atomically (see module doc).
    An existing ``directory`` is replaced (only once the new checkpoint is complete).
    ``write_extra(tmp_dir)`` runs on rank 0 before the marker: more files that are part of the
    checkpoint (the trainer's run config and conversion sidecars); ``on_publish(directory)`` runs on
    rank 0 once it is complete (the trainer prunes older checkpoints there).

    ``saves`` (:class:`AsyncSaves`): the model and optimizer tensors are written asynchronously.
    The state is captured now (on a GPU: copied to host memory; the writer is a forked process
    that writes from its own copy of it, so training may change the weights at once); this call
    returns before the files are written, and the checkpoint is published -- the ``complete``
    marker written last, the temporary directory renamed -- by the :meth:`AsyncSaves.finalize`
    call that finds the writes done. A save still in flight when the next one starts is finished
    first: at most one is in flight. Until it is published the checkpoint is a ``*.tmp-*``
    directory, which a resume never takes."""
    from megatron.core import dist_checkpointing

    if saves is not None:
        saves.finalize(blocking=True)  # at most one save in flight
    final = Path(directory).absolute()
    extra_json = json.dumps(extra_state if extra_state is not None else {}, sort_keys=True)  # fail early
    layout = actor_layout(actor)
    tag = _broadcast_obj(f"{os.getpid()}-{uuid.uuid4().hex[:8]}" if global_rank() == 0 else None)
    tmp = final.with_name(f"{final.name}.tmp-{tag}")

    err = None
    if global_rank() == 0:
        try:
            final.parent.mkdir(parents=True, exist_ok=True)
            tmp.mkdir()  # empty: megatron-core warns of an "incomplete / corrupted checkpoint" otherwise
        except OSError as e:
            err = e
    _agree_ok(err)  # (also the barrier: the directory exists everywhere before anyone writes)

    # The RNG states as they are now; restored right after the save so that saving is
    # RNG-neutral (the run continues exactly as a run resumed from this checkpoint does).
    rng = get_rng_state()
    state = _sharded_state_dict(actor, is_loading=False)
    request = dist_checkpointing.save(state, str(tmp), content_metadata={"format": FORMAT},
                                      **(saves.writer.save_kwargs if saves is not None else {}))
    set_rng_state(rng)
    (tmp / RNG_DIR).mkdir(exist_ok=True)  # by every rank: no extra collective
    torch.save(rng, tmp / RNG_DIR / f"rank{global_rank()}.pt")

    def publish() -> None:  # collective; after every rank's files are written
        _barrier()
        err = None
        if global_rank() == 0:
            try:
                if write_extra is not None:
                    write_extra(tmp)
                write_file_atomic(tmp / EXTRA_STATE, extra_json)
                marker = {"format": FORMAT, "step": (extra_state or {}).get("step"), "time": time.time(),
                          "layout": layout}
                fsync_dir(tmp / RNG_DIR)
                write_file_atomic(tmp / COMPLETE_MARKER, json.dumps(marker, sort_keys=True))  # last
                fsync_dir(tmp)
                old = None
                if final.exists():
                    old = final.with_name(f"{final.name}.tmp-old-{tag}")
                    os.replace(final, old)
                os.replace(tmp, final)
                fsync_dir(final.parent)
                if old is not None:
                    shutil.rmtree(old, ignore_errors=True)
                if on_publish is not None:
                    on_publish(final)
            except Exception as e:  # noqa: BLE001 -- agreed on below, so no rank is left waiting
                err = e
        _agree_ok(err)

    if saves is None:
        publish()
    else:
        request.add_finalize_fn(publish)  # after megatron's own (the DCP metadata, metadata.json)
        saves.schedule(request)
    return final


def load_actor_checkpoint(actor, directory: PathLike, model_only: bool = False) -> dict:
    """Collective: restore ``actor`` from ``directory``; returns the saved ``extra_state``.

    Full load (default): model, optimizer, LR scheduler and this rank's RNG states; the layout
    (TP/PP/EP/DP, world size, distributed optimizer) must equal the saved one. ``model_only``:
    only the model weights, resharded by dist_checkpointing to this actor's TP/PP."""
    from megatron.core import dist_checkpointing

    from megatron_tepo.megatron.fast_paths import refresh_fused_adam

    d = Path(directory).absolute()
    err, info = None, None
    try:
        info = read_marker(d)
        info["layout"].setdefault("precision", "fp32")  # (written before bf16 existed)
        info["layout"].setdefault("model_builder", "gpt")  # (written when every model was a GPTModel)
        saved_builder, builder = info["layout"]["model_builder"], actor.settings.model_builder
        if saved_builder != builder:  # megatron's sharded keys differ between the two models
            raise CheckpointError(
                f"{d} was written by a {saved_builder} model and this actor builds a {builder} one "
                f"(actor.model_builder): their parameters are stored under other names; resume with "
                f"actor.model_builder: {saved_builder}")
        if not model_only and info["layout"] != actor_layout(actor):
            raise CheckpointError(
                f"{d} was saved at layout {info['layout']}, this actor is {actor_layout(actor)}: a full "
                f"load (optimizer, scheduler, RNG) needs the same layout; pass model_only=True to load "
                f"only the model weights (resharded)")
        check_checkpoint_files(d, rng=not model_only)
    except (CheckpointError, OSError) as e:
        err = e
    _agree_ok(err)

    state = _sharded_state_dict(actor, is_loading=True, with_optimizer=not model_only)
    # no_grad: the distributed optimizer copies into fp32 main params that view leaf parameters
    with torch.no_grad():
        loaded = dist_checkpointing.load(state, str(d))
        for chunk in actor.model:
            chunk.module.load_state_dict(loaded["model"])
        if not model_only:
            loaded_optimizer = loaded["optimizer"]
            saved_steps = _saved_adam_steps(actor, loaded_optimizer)
            if getattr(actor, "keep_optim_settings", False):  # this run's LR replaces the saved one below
                from megatron_tepo.megatron.compat import adopt_current_lr_in_saved_groups

                adopt_current_lr_in_saved_groups(loaded_optimizer, actor.optimizer)
            actor.optimizer.load_state_dict(loaded_optimizer)
            _fix_torch_adam_steps(actor, saved_steps)
            refresh_fused_adam(actor.optimizer)  # fused AdamW reads its step counts on the device
            actor.scheduler.num_steps = 0  # load_state_dict ADDS the saved step count
            actor.scheduler.load_state_dict(loaded["scheduler"])
            if getattr(actor, "keep_optim_settings", False):  # (see MegatronActor.prefer_settings_over_checkpoint)
                actor.apply_optim_settings()
                actor.scheduler.step(increment=0)  # this actor's LR / weight decay from the next step on
    if not model_only:
        set_rng_state(torch.load(d / RNG_DIR / f"rank{global_rank()}.pt", weights_only=False))
    _barrier()
    return json.loads((d / EXTRA_STATE).read_text())


def load_newest_checkpoint(actor, root: PathLike, report: Optional[Callable[[str], None]] = None):
    """Collective: load the newest complete checkpoint under ``root`` whose files are all there
    and readable (:func:`check_checkpoint_files`, on every rank; the ranks agree). A damaged one
    is reported in one line naming the file (``report``) and the next older one is tried.
    Returns ``(path, extra_state)``, or ``(None, None)`` when there is no checkpoint; raises
    :class:`CheckpointError` when every one is damaged."""
    candidates = list(reversed(list_complete_checkpoints(root)))
    problems = []
    for d in candidates:
        err = None
        try:
            check_checkpoint_files(d)
        except CheckpointError as e:
            err = e
        errs = [str(err) if err else None] * (dist.get_world_size() if dist.is_initialized() else 1)
        if dist.is_initialized() and dist.get_world_size() > 1:
            dist.all_gather_object(errs, str(err) if err else None)
        bad = next((e for e in errs if e), None)
        if bad is None:
            return d, load_actor_checkpoint(actor, d)
        problems.append(bad)
        if report is not None:
            report(f"checkpoint {d.name} is damaged, not resuming from it: {bad}")
    if problems:
        raise CheckpointError(f"no usable checkpoint under {root}: " + "; ".join(problems))
    return None, None

