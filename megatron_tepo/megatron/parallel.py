"""megatron's process groups for a :class:`~megatron_tepo.layout.ParallelLayout`.

:func:`validate_layout_here` checks the layout with the rules of :mod:`megatron_tepo.layout` (the
only copy) and the facts of this machine, BEFORE any process group exists.
:func:`initialize_parallel` validates, then pins one compute thread (CPU; on a GPU at most the CPUs this
process may use), applies the CPU patches when there is no CUDA and the fast paths
(:mod:`.fast_paths`) everywhere, joins the default process group (gloo on CPU, nccl on GPU) if
needed, builds megatron's ``parallel_state`` groups and seeds the model-parallel RNG tracker.
:func:`parallel_sizes`, :func:`pipeline_ends`, :func:`pipeline_group` and :func:`expert_group` read
them back for the rest of the package (which imports nothing of megatron-core itself).

Left out: virtual pipeline stages, expert-tensor parallelism.
"""
from __future__ import annotations

import math
import os
from datetime import timedelta
from typing import Dict, Optional, Tuple

import torch
import torch.distributed as dist

from megatron_tepo.layout import ParallelLayout, validate_layout
from megatron_tepo.net import single_process_env  # noqa: F401 -- (imported from here too)


def world_size_here(world_size: Optional[int] = None) -> int:
    """``world_size``, else the default process group's, else torchrun's ``WORLD_SIZE`` (1 outside it)."""
    if world_size is not None:
        return world_size
    if dist.is_available() and dist.is_initialized():
        return dist.get_world_size()
    return int(os.environ.get("WORLD_SIZE", "1"))


def validate_layout_here(layout: ParallelLayout, family_cfg, world_size: Optional[int] = None,
                         sequence_parallel: bool = False, pack_sequences: bool = True) -> int:
    """:func:`megatron_tepo.layout.validate_layout` with the facts of this machine: its world size
    (see :func:`world_size_here`) and whether CUDA is there. Returns the data-parallel size."""
    return validate_layout(layout, family_cfg.dims(), world_size_here(world_size),
                           sequence_parallel=sequence_parallel, pack_sequences=pack_sequences,
                           cpu=not torch.cuda.is_available())


def initialize_parallel(layout: ParallelLayout, family_cfg, seed: int = 1234,
                        backend: Optional[str] = None, sequence_parallel: bool = False,
                        timeout_s: Optional[float] = None, pack_sequences: bool = True) -> int:
    """Validate, then start the process groups; returns the data-parallel size. Idempotent only in
    the sense that an already-initialized default group is reused. ``timeout_s``: how long every
    group (the default one, megatron's) waits in one collective (None: torch's and megatron's
    defaults, 10 / 30 minutes); the trainer derives it from the watchdog's settings
    (:func:`megatron_tepo.trainer.watchdog.process_group_timeout_s`)."""
    dp = validate_layout_here(layout, family_cfg, sequence_parallel=sequence_parallel, pack_sequences=pack_sequences)
    on_gpu = torch.cuda.is_available()
    torch.set_num_threads(1 if not on_gpu else min(torch.get_num_threads(), usable_cpus()))
    from megatron_tepo.megatron import apply_cpu_patches
    from megatron_tepo.megatron.fast_paths import apply_fast_paths

    apply_cpu_patches()  # each work-around on its own condition (no CUDA / no TE), GPU included
    apply_fast_paths()  # megatron's slow local paths (RoPE THD, no-apex grad norm, ...), every device
    if not dist.is_initialized():
        if on_gpu:
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        dist.init_process_group(backend or ("nccl" if on_gpu else "gloo"),
                                timeout=timedelta(seconds=timeout_s) if timeout_s else None)
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    if parallel_state.model_parallel_is_initialized():
        parallel_state.destroy_model_parallel()
    minutes = {"distributed_timeout_minutes": max(1, math.ceil(timeout_s / 60))} if timeout_s else {}
    parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=layout.tp, pipeline_model_parallel_size=layout.pp,
        context_parallel_size=layout.cp, expert_model_parallel_size=layout.ep, **minutes)
    model_parallel_cuda_manual_seed(seed, force_reset_rng=True)
    return dp


def parallel_sizes() -> Dict[str, int]:
    """This rank's tensor, pipeline and expert parallel sizes (``tp``, ``pp``, ``ep``), from megatron's
    ``parallel_state`` (initialised)."""
    from megatron.core import parallel_state as ps

    return {"tp": ps.get_tensor_model_parallel_world_size(), "pp": ps.get_pipeline_model_parallel_world_size(),
            "ep": ps.get_expert_model_parallel_world_size()}


def pipeline_ends() -> Tuple[bool, bool]:
    """Whether this rank's pipeline stage is the first, and whether it is the last."""
    from megatron.core import parallel_state as ps

    return ps.is_pipeline_first_stage(), ps.is_pipeline_last_stage()


def pipeline_group():
    """megatron's pipeline-parallel group of this rank; None before ``parallel_state`` is initialised."""
    from megatron.core import parallel_state as ps

    return ps.get_pipeline_model_parallel_group(check_initialized=False)


def expert_group():
    """megatron's expert-parallel group of this rank; None before ``parallel_state`` is initialised."""
    from megatron.core import parallel_state as ps

    return ps.get_expert_model_parallel_group(check_initialized=False)


def usable_cpus() -> int:
    """The CPUs this process may run on (its affinity: what Slurm's ``--cpus-per-task`` leaves it),
    not the machine's count, which torch's default thread pool assumes."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except (AttributeError, OSError):
        return max(1, os.cpu_count() or 1)


def group_timeouts() -> Dict[str, timedelta]:
    """The time-out of torch's default group and of each of megatron's groups here, by name (what
    the tests read back)."""
    from megatron.core import parallel_state as ps

    groups = {"default": dist.distributed_c10d._get_default_group(),
              "tensor": ps.get_tensor_model_parallel_group(), "pipeline": ps.get_pipeline_model_parallel_group(),
              "data": ps.get_data_parallel_group(), "model": ps.get_model_parallel_group()}
    return {name: group_timeout(group) for name, group in groups.items()}


def group_timeout(group) -> timedelta:
    """One process group's time-out (its CPU backend's options; its CUDA one's with NCCL)."""
    device = torch.device("cuda" if torch.cuda.is_available() and dist.get_backend(group) == "nccl" else "cpu")
    return group._get_backend(device).options._timeout


def destroy_parallel() -> None:
    """Tear down megatron's groups and the default process group (for tests / clean exits)."""
    from megatron.core import parallel_state

    if parallel_state.model_parallel_is_initialized():
        parallel_state.destroy_model_parallel()
    if dist.is_initialized():
        dist.destroy_process_group()


def raise_if_any_rank_failed(error: Optional[BaseException], what: str,
                             exc_type: type = RuntimeError) -> None:
    """Collective: re-raise ``error`` on the rank that hit it and raise ``exc_type`` naming the
    failed rank(s) and their errors on every other rank, so that no rank is left waiting in a
    later collective. A no-op when every rank succeeded."""
    if dist.is_initialized() and dist.get_world_size() > 1:
        errs = [None] * dist.get_world_size()
        dist.all_gather_object(errs, None if error is None else f"{type(error).__name__}: {error}")
        bad = [(r, e) for r, e in enumerate(errs) if e is not None]
        if bad and error is None:
            raise exc_type(f"{what} failed on rank(s) " + "; ".join(f"{r}: {e}" for r, e in bad))
    if error is not None:
        raise error
