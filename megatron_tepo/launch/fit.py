"""The fit check: is a launch layout valid (:func:`check_layout`: the actor's layout rules of
:func:`megatron_tepo.layout.validate_layout`, the only copy, and the fleet's own rule) and does it
fit in GPU memory (:func:`check_fit`: :mod:`megatron_tepo.launch.memory`'s numbers against
``launch.gpu_mem_gib`` and SGLang's static pool, in a :class:`~megatron_tepo.launch.report.FitReport`)?
A colocated layout (``launch.rollout.placement: colocated`` on cuda) is checked per phase of the step
at the offload level in use; :func:`settle_colocated` picks that level (``actor.offload: auto``: the
least that fits) and the servers' ``mem_fraction_static`` and memory saver, before anything is written.
Pure arithmetic, run before anything starts; on CPU (``launch.device: cpu``) only the layout rules.
The formulas and what they leave out: docs/LAUNCH.md ("The fit-check arithmetic")."""
from __future__ import annotations

import copy
import os
import socket
from typing import Mapping, Optional

from megatron_tepo.config import RunConfig
from megatron_tepo.config.validation import episode_turns, sandbox_settings
from megatron_tepo.launch.memory import (SANDBOX_MEMORY_SHARE, TRAINER_ALLOC_CONF, GiB, HostMemory, actor_memory,
                                        colocated_memory, sandbox_memory, server_memory)
from megatron_tepo.launch.report import FitReport
from megatron_tepo.launch.schema import LaunchLayout
from megatron_tepo.launch.shape import ModelShape
from megatron_tepo.layout import validate_layout
from megatron_tepo.time_limits import request_limit_s, round_limit_s, waves

__all__ = ["FitError", "check_layout", "check_fit", "check_time_limits", "settle_colocated", "node_host_memory",
           "check_sandbox_memory"]


class FitError(ValueError):
    """The layout does not fit (or is inconsistent); the message names the setting to change."""


def check_layout(m: ModelShape, cfg: RunConfig, launch: LaunchLayout) -> None:
    """The actor's layout rules (:func:`megatron_tepo.layout.validate_layout`, the only copy) on the
    launch's actor world, and the fleet's own rule."""
    errors = []
    try:
        validate_layout(cfg.parallel, m, launch.actor_gpus, sequence_parallel=cfg.actor.sequence_parallel,
                        pack_sequences=cfg.actor.pack_sequences,
                        cpu=launch.device == "cpu",
                        world="the actor's ranks (launch.actor_nodes x launch.gpus_per_node)")
    except ValueError as exc:
        errors.append(str(exc).removeprefix("invalid parallel layout: "))
    r = launch.rollout
    if m.num_attention_heads % r.server.tp:
        errors.append(f"{r.key}.tp={r.server.tp} does not divide num_attention_heads={m.num_attention_heads}")
    if errors:
        raise FitError("invalid layout: " + "; ".join(errors))


def node_host_memory(launch: LaunchLayout, environ: Optional[Mapping[str, str]] = None,
                     meminfo: str = "/proc/meminfo") -> HostMemory:
    """The host memory per node that the pinned copies must fit in: ``launch.host_mem_gib`` when set
    (0: not checked); else, where the fit check runs inside the job (``SLURM_JOB_ID``, not a dry
    run), the job's memory per node (``SLURM_MEM_PER_NODE``, MiB) or this node's ``MemTotal``;
    elsewhere (a dry run, a login node) not checked. The source is said in the report."""
    env = os.environ if environ is None else environ
    if launch.host_mem_gib is not None:
        if not launch.host_mem_gib:
            return HostMemory(0.0, "launch.host_mem_gib: 0, not checked")
        return HostMemory(launch.host_mem_gib * GiB, "launch.host_mem_gib")
    if not env.get("SLURM_JOB_ID") or env.get("TEPO_DRY_RUN") == "1":
        return HostMemory(0.0, "not checked: not inside the job (a dry run reads no node); set launch.host_mem_gib")
    mem = env.get("SLURM_MEM_PER_NODE", "")
    if mem.isdigit() and int(mem) > 0:
        return HostMemory(int(mem) * 2 ** 20, "SLURM_MEM_PER_NODE, the job's memory per node")
    try:
        with open(meminfo, encoding="ascii") as f:
            kib = next(int(line.split()[1]) for line in f if line.startswith("MemTotal:"))
    except (OSError, StopIteration, ValueError, IndexError):
        return HostMemory(0.0, f"not checked: {meminfo} has no MemTotal; set launch.host_mem_gib")
    return HostMemory(kib * 1024.0, f"MemTotal of {socket.gethostname()}, where the fit check runs")


def check_time_limits(cfg: RunConfig, launch: LaunchLayout) -> None:
    """A sampling round's time limit (its waves of requests on the servers' slots x a request's:
    :mod:`megatron_tepo.time_limits`) fits the watchdog's generation phase; else :class:`FitError`
    naming ``fault.watchdog_generate_s``. (Further rounds of dynamic sampling draw the dropped
    groups again, fewer: one round is checked.)"""
    r, w = cfg.rollout, cfg.fault.watchdog_generate_s
    slots = launch.servers * launch.rollout.server.max_running_requests
    samples = r.prompts_per_step * r.n_samples
    turns, tool_s = episode_turns(cfg)
    need = round_limit_s(r, samples, slots, turns, tool_s)
    if w and need > w:
        per = f"{request_limit_s(r):.0f} s a request" + (f" + {tool_s:g} s a tool call, {turns} turns" if turns > 1 else "")
        raise FitError(f"fault.watchdog_generate_s: {w:g} s is shorter than one sampling round may take: "
                       f"{waves(samples, slots)} wave(s) of {samples} sequences on {slots} slots "
                       f"({launch.servers} servers x {launch.rollout.key}.max_running_requests) x {per} = {need:.0f} s; "
                       f"raise it (or 0: off), or add servers")


def check_sandbox_memory(cfg: RunConfig, launch: LaunchLayout, host: Optional[HostMemory] = None) -> None:
    """The tool sandboxes' worst case on the driver's node (:func:`~megatron_tepo.launch.memory.sandbox_memory`)
    within :data:`~megatron_tepo.launch.memory.SANDBOX_MEMORY_SHARE` of the node's memory (``host``,
    by default :func:`node_host_memory`: unknown outside the job, then not checked); else
    :class:`FitError` naming the fields. (Their rlimits bound each process, not the sum: this bounds
    the sum.)"""
    sb = sandbox_memory(cfg)
    host = node_host_memory(launch) if host is None else host
    if sb is None or not host.bytes or sb.total <= SANDBOX_MEMORY_SHARE * host.bytes:
        return
    s = sandbox_settings(cfg)
    raise FitError(
        f"environment.sandbox: the tool sandboxes can take {sb.total / GiB:.1f} GiB of the driver's node at once, "
        f"more than {SANDBOX_MEMORY_SHARE:.0%} of its {host.bytes / GiB:.1f} GiB ({host.source}): "
        f"{sb.concurrent} at once (the fewer of environment.tool_workers={cfg.environment.tool_workers} and "
        f"environment.sandbox.max_concurrent={s.max_concurrent}) x (environment.sandbox.processes={s.processes} x "
        f"environment.sandbox.memory_mb={s.memory_mb} MB + 2 x environment.sandbox.tmp_mb={s.tmp_mb} MB) = "
        f"{sb.per_sandbox / GiB:.2f} GiB each; lower them")


def check_fit(m: ModelShape, cfg: RunConfig, launch: LaunchLayout, raise_error: bool = True) -> FitReport:
    """Compute the report; raise :class:`FitError` naming the settings to change if it does not fit
    (the memory, the rollout's time limits against the watchdog, the tool sandboxes' host memory)."""
    check_layout(m, cfg, launch)
    if raise_error and cfg.rollout.engine == "sglang":
        check_time_limits(cfg, launch)
    if raise_error:
        check_sandbox_memory(cfg, launch)
    if launch.device == "cpu":
        return FitReport(m, None, None, launch, cfg)
    if launch.rollout.server.max_running_requests < 1:  # (0: SGLang's own number, which is not priced)
        raise FitError(f"{launch.rollout.key}.max_running_requests: must be >= 1 on cuda (the fit check prices "
                       f"the KV cache of that many sequences per server)")
    colocated = colocated_memory(m, cfg, launch, node_host_memory(launch)) if launch.colocated else None
    alloc = os.environ.get("PYTORCH_CUDA_ALLOC_CONF", TRAINER_ALLOC_CONF)  # (as slurm/lib.sh hands it on)
    report = FitReport(m, actor_memory(m, cfg, launch, alloc), server_memory(m, cfg, launch), launch, cfg, colocated)
    if cfg.actor.lora is not None:  # the same layout full-parameter, beside it in the report
        full = copy.deepcopy(cfg)
        full.actor.lora = None
        report.full_actor = actor_memory(m, full, launch, alloc)
        if launch.colocated:
            report.full_colocated = colocated_memory(m, full, launch, node_host_memory(launch))
    if raise_error:
        if colocated is not None:
            errors = [] if report.colocated_fits else [report.colocated_error()]
        else:
            errors = ([report.actor_error()] if not report.actor_fits else []) + \
                     ([report.server_error()] if not report.server_fits else [])
        if errors:
            raise FitError("\n".join(errors))
    return report


def settle_colocated(m: ModelShape, cfg: RunConfig, launch: LaunchLayout) -> None:
    """A colocated layout on cuda: what the fit check decides for the run and its servers, set in
    ``cfg`` and ``launch`` (before the run config and the serve command are written): the offload
    level (``actor.offload: auto`` -> the least that fits, else the one asked), the servers'
    ``mem_fraction_static`` (their weights + the KV cache of ``max_running_requests`` sequences +
    what a released server keeps) and SGLang's memory saver. Whether it fits is :func:`check_fit`'s.
    On CPU only the memory saver's absence (torch_memory_saver is CUDA's: release frees nothing)."""
    if not launch.colocated or launch.device != "cuda":
        return
    if launch.rollout.server.max_running_requests < 1:
        return  # check_fit says so
    c = colocated_memory(m, cfg, launch, node_host_memory(launch))
    cfg.actor.offload = c.level
    launch.rollout.server.mem_fraction_static = c.fraction
    launch.rollout.server.enable_memory_saver = True

