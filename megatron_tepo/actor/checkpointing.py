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

A LoRA actor (``actor.lora``) built from an HF folder saves the adapters of the model and not its
frozen base, beside ``lora_base.json`` (the folder's path and fingerprint); a load checks the
fingerprint (a changed base is a one-line :class:`CheckpointError`) and reads the base from the
folder when the actor holds another (:mod:`megatron_tepo.actor.lora_checkpoint`). A base that
cannot be referenced (random init, a state dict) is saved in full, and ``lora_base.json`` says so.
A LoRA actor without the distributed optimizer may fully load a checkpoint of another TP / PP
(same EP, precision, builder): the adapters and their Adam states are resharded, the scheduler
loaded, the per-rank RNG states left as this run's.

Assumes a file system shared by all ranks (every rank writes its own shards and RNG file).

This module is the checkpoint's format and its steps; megatron-core's part is
:mod:`megatron_tepo.megatron.dist_checkpoint` (the save and load, the RNG states with megatron's
tracker, the distributed optimizer's Adam steps) and :mod:`megatron_tepo.megatron.async_save` (the
asynchronous saves' writer, :func:`choose_async_writer` here refusing with a :class:`CheckpointError`).
"""
from __future__ import annotations

import json
import os
import shutil
import time
import uuid
from pathlib import Path
from typing import Any, Callable, Dict, Optional

import torch
import torch.distributed as dist

from megatron_tepo.config import OptimConfig
from megatron_tepo.checkpoint.store import (COMPLETE_MARKER, EXTRA_STATE, FORMAT, RNG_DIR, CheckpointError,
                                             PathLike, check_checkpoint_files, global_rank, fsync_dir,
                                             list_complete_checkpoints, read_marker, write_file_atomic)
from megatron_tepo.actor import lora_checkpoint
from megatron_tepo.megatron import async_save, dist_checkpoint
from megatron_tepo.megatron.async_save import NVRX_WORKER_CONTEXT_GIB, STAGINGS, AsyncSaves, AsyncWriter
from megatron_tepo.megatron.dist_checkpoint import get_rng_state, set_rng_state
from megatron_tepo.megatron.parallel import raise_if_any_rank_failed

__all__ = ["save_actor_checkpoint", "load_actor_checkpoint", "load_newest_checkpoint", "lora_tp_problem",
           "get_rng_state", "set_rng_state", "actor_layout", "AsyncSaves", "AsyncWriter", "choose_async_writer",
           "STAGINGS", "NVRX_WORKER_CONTEXT_GIB"]

DIST_OPT_METADATA = {"distrib_optim_sharding_type": "dp_reshardable"}


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


def actor_layout(train_model, optim: OptimConfig) -> Dict[str, Any]:
    """The layout a checkpoint of ``train_model`` records (and a full load must find again)."""
    ps = train_model._ps
    return {
        "world_size": dist.get_world_size() if dist.is_initialized() else 1,
        "tp": ps.get_tensor_model_parallel_world_size(),
        "pp": ps.get_pipeline_model_parallel_world_size(),
        "ep": ps.get_expert_model_parallel_world_size(),
        "dp": ps.get_data_parallel_world_size(),
        "distributed_optimizer": bool(optim.use_distributed_optimizer),
        "precision": train_model.settings.precision,
        "model_builder": train_model.settings.model_builder,
    }


def _model_sharded_state_dict(train_model):
    chunks = [c.module for c in train_model.model]  # (megatron DDP has no sharded_state_dict of its own)
    if len(chunks) != 1:
        raise NotImplementedError("checkpointing supports one model chunk per rank (no virtual PP)")
    return chunks[0].sharded_state_dict()


def _optimizer_metadata(optim: OptimConfig) -> Optional[dict]:
    return dict(DIST_OPT_METADATA) if optim.use_distributed_optimizer else None


def _sharded_state_dict(train_model, optim: OptimConfig, is_loading: bool,
                        with_optimizer: bool = True, adapters_only: bool = False) -> Dict[str, Any]:
    model_sd = _model_sharded_state_dict(train_model)
    if adapters_only:  # a LoRA model whose base is referenced (actor/lora_checkpoint.py)
        model_sd = lora_checkpoint.adapters_only(model_sd)
    if with_optimizer and is_loading:
        dist_checkpoint.ensure_torch_adam_state(train_model.optimizer)
    state: Dict[str, Any] = {"model": model_sd}
    if with_optimizer:
        state["optimizer"] = train_model.optimizer.sharded_state_dict(
            model_sd, is_loading=is_loading, metadata=_optimizer_metadata(optim))
        state["scheduler"] = train_model.scheduler.state_dict()
    return state


def choose_async_writer(save_fn=None, nvrx_version: Optional[str] = "probe", wanted: Optional[str] = None,
                        expandable: Optional[bool] = None, host_shm: Optional[bool] = None,
                        on_gpu: Optional[bool] = None, staged_bytes: Optional[int] = None,
                        statvfs=None) -> AsyncWriter:
    """The asynchronous saves' writer (:func:`megatron_tepo.megatron.async_save.choose_async_writer`,
    the one choice; ``staged_bytes``: what this node's ranks stage in one save; the other arguments are
    for tests); one that cannot be had is a :class:`CheckpointError`."""
    return async_save.choose_async_writer(save_fn, nvrx_version, wanted, expandable, host_shm, on_gpu,
                                          error=CheckpointError, staged_bytes=staged_bytes, statvfs=statvfs)


def save_actor_checkpoint(train_model, directory: PathLike, extra_state: Optional[dict] = None,
                          write_extra: Optional[Callable[[Path], None]] = None,
                          saves: Optional[AsyncSaves] = None,
                          on_publish: Optional[Callable[[Path], None]] = None, *, optim: OptimConfig) -> Path:
    """Collective: write the full training state of ``train_model`` (the actor's
    :class:`~megatron_tepo.megatron.model.TrainModel`, its optimizer built from ``optim``) to
    ``directory`` atomically (see module doc).
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
    if saves is not None:
        saves.finalize(blocking=True)  # at most one save in flight
    final = Path(directory).absolute()
    extra_json = json.dumps(extra_state if extra_state is not None else {}, sort_keys=True)  # fail early
    layout = actor_layout(train_model, optim)
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
    lora = train_model.settings.lora is not None
    base = getattr(train_model, "lora_base", None) if lora else None
    state = _sharded_state_dict(train_model, optim, is_loading=False, adapters_only=base is not None)
    request = dist_checkpoint.save(state, tmp, content_metadata={"format": FORMAT},
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
                if lora:  # the base's folder, or why it is saved in full
                    write_file_atomic(tmp / lora_checkpoint.BASE_FILE, lora_checkpoint.base_file_text(base))
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


def load_actor_checkpoint(train_model, directory: PathLike, model_only: bool = False, *, optim: OptimConfig,
                          keep_settings: Optional[Callable[[], None]] = None) -> dict:
    """Collective: restore ``train_model`` (its optimizer built from ``optim``) from ``directory``;
    returns the saved ``extra_state``. ``keep_settings``: called after the optimizer's state is
    restored, to put this run's optimizer settings back in place of the saved ones
    (:meth:`MegatronActor.prefer_settings_over_checkpoint`); None keeps the saved ones.

    Full load (default): model, optimizer, LR scheduler and this rank's RNG states; the layout
    (TP/PP/EP/DP, world size, distributed optimizer) must equal the saved one, except for a LoRA
    actor without the distributed optimizer (TP / PP may change: everything but the RNG states
    resharded). ``model_only``: only the model weights, resharded by dist_checkpointing to this
    actor's TP/PP. A LoRA checkpoint that references its base: the base checked, and read from its
    folder when this actor holds another (module doc)."""
    from megatron_tepo.megatron.fast_paths import refresh_fused_adam

    d = Path(directory).absolute()
    err, info, base, reshard = None, None, None, False
    try:
        info = read_marker(d)
        info["layout"].setdefault("precision", "fp32")  # (written before bf16 existed)
        info["layout"].setdefault("model_builder", "gpt")  # (written when every model was a GPTModel)
        saved_builder, builder = info["layout"]["model_builder"], train_model.settings.model_builder
        if saved_builder != builder:  # megatron's sharded keys differ between the two models
            raise CheckpointError(
                f"{d} was written by a {saved_builder} model and this actor builds a {builder} one "
                f"(actor.model_builder): their parameters are stored under other names; resume with "
                f"actor.model_builder: {saved_builder}")
        mine = actor_layout(train_model, optim)
        reshard = not model_only and info["layout"] != mine
        if reshard and not _lora_reshardable(train_model, info["layout"], mine):
            raise CheckpointError(
                f"{d} was saved at layout {info['layout']}, this actor is {mine}: a full "
                f"load (optimizer, scheduler, RNG) needs the same layout (a LoRA actor without the distributed "
                f"optimizer: the same EP, precision and builder); pass model_only=True to load "
                f"only the model weights (resharded)")
        problem = lora_tp_problem(train_model, info["layout"], mine)
        if problem:
            raise CheckpointError(f"{d}: {problem}")
        check_checkpoint_files(d, rng=not (model_only or reshard))
        base = lora_checkpoint.read_base_file(d)
        if base is not None and train_model.settings.lora is None:
            raise CheckpointError(f"{d} holds LoRA adapters over the base {base['path']}, and this actor has no "
                                  f"actor.lora: load it with the actor.lora it was saved with")
        if base is not None:
            lora_checkpoint.check_base(d, base)
    except (CheckpointError, OSError) as e:
        err = e
    _agree_ok(err)

    if base is not None:  # the base from its folder where this actor holds another (the ranks agree)
        try:
            if getattr(train_model, "lora_base", None) != base:
                lora_checkpoint.load_base_into(train_model, base)
        except (ValueError, OSError) as e:
            err = CheckpointError(f"{d}: its LoRA base {base['path']} does not load: {e}")
        _agree_ok(err)
    state = _sharded_state_dict(train_model, optim, is_loading=True, with_optimizer=not model_only,
                                adapters_only=base is not None)
    # no_grad: the distributed optimizer copies into fp32 main params that view leaf parameters
    with torch.no_grad():
        loaded = dist_checkpoint.load(state, d)
        for chunk in train_model.model:
            if base is None:
                chunk.module.load_state_dict(loaded["model"])
            else:  # the adapters only: the base came from its folder
                _load_adapters(chunk.module, loaded["model"], d)
        if not model_only:
            optimizer, scheduler = train_model.optimizer, train_model.scheduler
            loaded_optimizer = loaded["optimizer"]
            saved_steps = dist_checkpoint.saved_adam_steps(optimizer, loaded_optimizer, CheckpointError)
            if keep_settings is not None:  # this run's LR replaces the saved one below
                from megatron_tepo.megatron.compat import adopt_current_lr_in_saved_groups

                adopt_current_lr_in_saved_groups(loaded_optimizer, optimizer)
            optimizer.load_state_dict(loaded_optimizer)
            dist_checkpoint.fix_torch_adam_steps(optimizer, saved_steps)
            refresh_fused_adam(optimizer)  # fused AdamW reads its step counts on the device
            scheduler.num_steps = 0  # load_state_dict ADDS the saved step count
            scheduler.load_state_dict(loaded["scheduler"])
            if keep_settings is not None:  # (see MegatronActor.prefer_settings_over_checkpoint)
                keep_settings()
                scheduler.step(increment=0)  # this actor's LR / weight decay from the next step on
    if not (model_only or reshard):  # (the RNG states are per rank: at another layout they stay this run's)
        set_rng_state(torch.load(d / RNG_DIR / f"rank{global_rank()}.pt", weights_only=False))
    _barrier()
    return json.loads((d / EXTRA_STATE).read_text())


#: what a LoRA actor's full load may find changed: the TP / PP sizes and so DP and the world size
_RESHARDABLE = ("world_size", "tp", "pp", "dp")


def _lora_reshardable(train_model, saved: Dict[str, Any], mine: Dict[str, Any]) -> bool:
    """Whether a full load may reshard a checkpoint saved at layout ``saved`` onto ``mine``: a LoRA
    actor without the distributed optimizer (its Adam states are then keyed like the adapters,
    which megatron's dist_checkpointing reshards over TP / PP), the rest of the layout the same."""
    if train_model.settings.lora is None or saved.get("distributed_optimizer") or mine["distributed_optimizer"]:
        return False
    return all(saved.get(k) == v for k, v in mine.items() if k not in _RESHARDABLE)


def lora_tp_problem(train_model, saved: Dict[str, Any], mine: Dict[str, Any]) -> str:
    """Why a load (full or weights only) may not reshard a LoRA checkpoint from the saved TP to this
    actor's, or "": a Gated DeltaNet ``in_proj``'s B is saved as plain rows, not per q/k/v/z/b/a
    section as megatron saves its weight (megatron/lora.py, "Left out")."""
    lora = train_model.settings.lora
    if lora is None or saved.get("tp") == mine["tp"] or not getattr(train_model, "gated_delta_net", False):
        return ""
    if "in_proj" not in lora.target_modules:
        return ""
    return (f"a LoRA checkpoint with Gated DeltaNet in_proj adapters loads at its own TP only (saved at TP "
            f"{saved.get('tp')}, this actor is TP {mine['tp']}): resume at parallel.tp: {saved.get('tp')}")


def _load_adapters(module, loaded: Dict[str, Any], d: Path) -> None:
    """Load a checkpoint's adapters into ``module``: every adapter found, nothing else in it."""
    result = module.load_state_dict(loaded, strict=False)
    missing = [k for k in result.missing_keys if k.rsplit(".", 1)[-1] in ("lora_A", "lora_B")]
    if missing or result.unexpected_keys:
        raise CheckpointError(f"{d}: the LoRA adapters do not match this model (missing {missing[:4]}, "
                              f"unexpected {result.unexpected_keys[:4]}): another actor.lora or model?")


def load_newest_checkpoint(train_model, root: PathLike, report: Optional[Callable[[str], None]] = None, *,
                           optim: OptimConfig, keep_settings: Optional[Callable[[], None]] = None):
    """Collective: load the newest complete checkpoint under ``root`` whose files are all there
    and readable (:func:`check_checkpoint_files`, on every rank; the ranks agree). A damaged one
    is reported in one line naming the file (``report``) and the next older one is tried.
    Returns ``(path, extra_state)``, or ``(None, None)`` when there is no checkpoint; raises
    :class:`CheckpointError` when every one is damaged."""
    candidates = list(reversed(list_complete_checkpoints(root)))
    problems = []
    world = dist.get_world_size() if dist.is_initialized() else 1
    for d in candidates:
        err = None
        try:  # (a checkpoint of another world size -- a LoRA resume at another layout -- has other RNG files)
            check_checkpoint_files(d, rng=read_marker(d)["layout"].get("world_size") == world)
        except CheckpointError as e:
            err = e
        errs = [str(err) if err else None] * world
        if world > 1:
            dist.all_gather_object(errs, str(err) if err else None)
        bad = next((e for e in errs if e), None)
        if bad is None:
            return d, load_actor_checkpoint(train_model, d, optim=optim, keep_settings=keep_settings)
        problems.append(bad)
        if report is not None:
            report(f"checkpoint {d.name} is damaged, not resuming from it: {bad}")
    if problems:
        raise CheckpointError(f"no usable checkpoint under {root}: " + "; ".join(problems))
    return None, None

