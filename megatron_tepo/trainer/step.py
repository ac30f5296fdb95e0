"""One step of the RL loop as its phases, in order (:data:`STEP`): generate (with the reward and
dynamic sampling, on the driver) -> advantages -> old log-probs -> policy updates -> weight sync
-> log (evaluation, the step's report and log) -> save (its checkpoint, the stall check). The
reward and the dynamic-sampling filter run inside ``generate``: a filtered-out group is replaced by
sampling more, so they are a loop within the generation, not phases after it.

Each phase is ``phase(run, step)``: ``run`` is the run's parts and state
(:class:`~megatron_tepo.trainer.loop.Run`), ``step`` the :class:`Step` the phases hand on to each
other. :func:`~megatron_tepo.trainer.loop.train` runs the phases of :data:`STEP` for every step;
a mode with more to do per step passes a longer list (colocated mode: the engine releases its
memory after ``generate`` and takes it back around ``sync``, the actor offloads after ``update``).
A step whose rollout kept no group (every group had equal rewards for ``max_sampling_rounds``
rounds) is *skipped*: the phases between ``generate`` and ``log`` do nothing for it.

Waits are watched (:class:`~megatron_tepo.trainer.watchdog.Watchdog` phases ``generate``,
``collective``, ``sync``). The schedule is not a branch here: ``generate``, ``sync`` and ``log``
ask the run's rollout source (:mod:`megatron_tepo.trainer.sources`: synchronous, one step off,
partial rollout) for the step's rollout, for the weight sync with nothing generating, and for
the evaluation with nothing generating.

Left out: what each phase computes beyond calling the parts (losses, advantages, the actor and the
engines are their own modules).
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable, Dict, List, Optional

from megatron_tepo.algorithms import compute_group_advantages
from megatron_tepo.algorithms.advantages import gpg_correction
from megatron_tepo.batch import RolloutBatch
from megatron_tepo.rollout.engine import MEMORY_TAGS
from megatron_tepo.trainer.rollouts import starts_from_adapter, sync_weights
from megatron_tepo.trainer.stalls import NoUpdateError, skipped_update_message, stalled_message

__all__ = ["Step", "STEP", "COLOCATED_STEP", "Mode", "SEPARATE", "COLOCATED", "mode_of", "generate", "advantages",
           "old_log_probs", "update", "sync", "log", "save", "policy_update"]


@dataclass
class Step:
    """What one step's phases hand on to each other."""
    number: int
    t0: float = field(default_factory=time.time)
    prompts: list = field(default_factory=list)
    groups: list = field(default_factory=list)
    rewards: object = None  # one tensor, group after group
    records: Optional[list] = None  # each group's prompt record (the data row's other fields; None: none)
    version: int = 0  # the weights the rollout was generated with (step k: the weights step k started from)
    gen: Dict = field(default_factory=dict)  # the rollout's statistics
    skipped: bool = False  # no group kept: nothing to train on
    rollout_s: float = 0.0
    batch: Optional[RolloutBatch] = None  # this rank's share
    response_length_mean: float = 0.0
    response_tokens: float = 0.0  # the response tokens trained on (tokens_per_s: over the step's time)
    t_train: float = 0.0
    drift: Dict = field(default_factory=dict)
    # the old-log-prob pass's routing gates with actor.routing_replay r3 (``old_routing_*``; the
    # training passes' are in ``updates``); none with r2 (that pass records) or off
    old_pass: Dict = field(default_factory=dict)
    updates: List[Dict] = field(default_factory=list)
    metrics: Dict = field(default_factory=dict)
    memory: Dict = field(default_factory=dict)  # colocated mode: the memory phases' times and bytes


def generate(run, step: Step) -> None:
    """1. the step's rollout (generate -> reward -> dynamic sampling, on the driver) from the
    schedule's source (:mod:`~megatron_tepo.trainer.sources`): generated now, generated while the
    previous step trained (one step off), or the buffer's complete groups (partial rollout)."""
    with run.watchdog.phase("generate"):
        got = run.source.take(run, step)
    step.rollout_s = time.time() - step.t0  # waiting for the rollout (generating it, when not done ahead)
    step.prompts, step.groups, step.rewards, step.version = got.prompts, got.groups, got.rewards, got.weights_version
    step.records = got.records
    step.gen = {**got.stats, "rollout_staleness": float(step.number - got.weights_version)}
    if not got.prompts:  # every group had equal rewards for max_sampling_rounds rounds
        run.source.settle(run, step)
        step.skipped = True
        step.metrics = {"skipped_step": 1.0, "updates": 0.0, **step.gen, "rollout_s": step.rollout_s,
                        "step_s": time.time() - step.t0}


def advantages(run, step: Step) -> None:
    """2. group advantages (eq. 9), GPG's correction when configured; the batch, this rank's share."""
    if step.skipped:
        return
    cfg, n = run.cfg, run.cfg.rollout.n_samples
    adv = compute_group_advantages(step.rewards, n, std_normalize=cfg.advantage.std_normalize, eps=cfg.advantage.eps)
    if cfg.advantage.gpg_correction:
        adv = adv * gpg_correction(step.rewards, n)
    batch = RolloutBatch.from_groups(step.prompts, step.groups, run.task.pad_token_id, advantages=adv,
                                     temperature=cfg.rollout.temperature)
    step.response_length_mean = float(batch.response_mask.sum(1).mean())
    step.response_tokens = float(batch.response_mask.sum())
    if run.dp_size > 1:  # this rank's share of every mini-batch (rows_per_mb is a multiple of dp_size)
        batch = batch.split_for_data_parallel(run.dp_rank, run.dp_size)
    step.batch = batch


def old_log_probs(run, step: Step) -> None:
    """3. old log-probs: the actor's (and its entropy, and the drift against the engine's), or the
    engine's own."""
    if step.skipped:
        return
    step.t_train, batch = time.time(), step.batch
    if run.cfg.algorithm.old_log_prob == "rollout":
        batch.old_log_probs = batch.rollout_log_probs
        return
    with run.watchdog.phase("collective"):
        batch.old_log_probs, batch.old_entropy = run.actor.compute_log_probs(batch)
        step.old_pass = {f"old_{k}": v for k, v in run.actor.routing_metrics.items()}  # (summed over every rank)
        # tokens of older weights differ by an update: the drift is measured on the tokens of the
        # weights this step starts from (every token, without per-token versions, when the whole
        # batch is; reported, with no warning, when it is older)
        mask, fresh = batch.response_mask, step.number == step.version
        if batch.policy_versions is not None:
            mask, fresh = mask * (batch.policy_versions == step.number), True
        local = run.drift_check(batch.rollout_log_probs, batch.old_log_probs, mask,
                                warn=run.dp_size == 1 and fresh and run.driver.is_driver)
        step.drift = local if run.dp_size == 1 else run.driver.combine_drift(local, run.drift_check, run.dp_size,
                                                                            warn=fresh)


def update(run, step: Step) -> None:
    """4. policy updates over mini-batches of prompts, ``train.epochs_per_step`` passes (each update
    is progress for the watchdog); first, the previous step's checkpoint published."""
    if step.skipped:
        return
    cfg, batch = run.cfg, step.batch
    local_rows_per_mb = run.rows_per_mb // run.dp_size
    with run.watchdog.phase("collective"):
        # the previous step's asynchronous checkpoint, written while this step generated, is
        # complete and published before the weights change again (a run stopped in this step
        # resumes from it)
        run.checkpoints.finish()
        if step.number == cfg.fault.inject_hang_at_step and run.state.start == 1 and run.driver.is_driver:
            _hang(step.number)  # test only: the other ranks block in the update's collectives
        for _ in range(cfg.train.epochs_per_step):
            for first in range(0, batch.batch_size, local_rows_per_mb):
                mb = batch.select(range(first, min(first + local_rows_per_mb, batch.batch_size)))
                step.updates.append(policy_update(run.actor, mb, run.loss))
                run.watchdog.beat()


def sync(run, step: Step) -> None:
    """5. the weight sync to the rollout engine with nothing generating (the source waits for the
    rollout running ahead, or interrupts the requests in flight and resumes them after it: no
    request runs across a weight update); the step's metrics."""
    if step.skipped:
        return
    train_s = time.time() - step.t_train
    sync_s, counts = run.source.around_sync(run, step, lambda: sync_weights(run.actor, run.engine))
    step.gen.update(counts)
    updates = step.updates
    if run.report is not None and any(u["skipped_update"] for u in updates):
        run.report(skipped_update_message(step.number, updates, run.cfg.fault.max_steps_without_update))
    done = [u for u in updates if not u["skipped_update"]] or updates
    metrics = {k: sum(u[k] for u in done) / len(done) for k in done[0] if isinstance(done[0][k], float)}
    metrics["skipped_update"] = float(sum(u["skipped_update"] for u in updates))
    metrics["updates"] = float(len(updates)) - metrics["skipped_update"]
    step_s = time.time() - step.t0
    metrics.update(step.gen, reward_mean=float(step.rewards.mean()), rollout_s=step.rollout_s, train_s=train_s,
                   sync_s=sync_s, step_s=step_s, response_length_mean=step.response_length_mean,
                   tokens_per_s=step.response_tokens / max(step_s, 1e-9), **step.drift, **step.old_pass)
    step.metrics = metrics


def log(run, step: Step) -> None:
    """6. every step, with or without an update (a collapsed run is measured too): the held-out
    evaluation when due, the step's report and its line in the metrics log."""
    cfg, metrics = run.cfg, step.metrics
    if not step.skipped:  # (after the phases between the sync and here: colocated mode's memory phases)
        metrics["step_s"] = time.time() - step.t0
    if cfg.train.eval_every and step.number % cfg.train.eval_every == 0:
        with run.watchdog.phase("generate"):
            metrics.update(run.source.quiet(run, run.eval_fn or dict))
    metrics.update(step.memory)
    if run.on_step is not None:
        run.on_step(step.number, metrics)
    if run.logger is not None:
        run.logger.log(step.number, metrics)


def save(run, step: Step) -> None:
    """7. the step's checkpoint (when due) and its metrics kept; a run that stopped updating stops
    (:class:`~megatron_tepo.trainer.stalls.NoUpdateError`, its last checkpoint complete)."""
    cfg, state, metrics = run.cfg, run.state, step.metrics
    state.stalled = state.stalled + 1 if metrics["updates"] == 0 else 0
    with run.watchdog.phase("collective"):
        run.checkpoints.save(step.number, state, run.engine, run.source)
    run.history.append(metrics)
    if cfg.fault.max_steps_without_update and state.stalled >= cfg.fault.max_steps_without_update:
        with run.watchdog.phase("collective"):
            run.checkpoints.finish()  # the last checkpoint complete before the stop
        raise NoUpdateError(stalled_message(state.stalled, step.number, metrics, cfg.rollout.n_samples))


#: one step, in order (see the module docstring)
STEP: tuple = (generate, advantages, old_log_probs, update, sync, log, save)


# ---------------------------------------------------------------------- colocated mode's phases
# The engine and the actor take turns with the GPUs' memory (rollout.colocated). Each phase
# returns once the memory it frees is free (the engine's release on every server: the driver's call
# is awaited by every rank; the actor's offload on this rank); a phase that takes memory back on
# the servers starts only once every rank has got there (a barrier first: each rank's offload has
# returned). A skipped step keeps the memory as it is: the engine still holds it for the next
# generation.

def _engine_memory(run, step: Step, key: str, call, after_every_rank: bool = False) -> None:
    """``call()`` on the driver (the engine's memory), every rank waiting for it; timed as ``key``
    (a skipped step: nothing). ``after_every_rank``: the driver calls it only once every rank got
    here (a resume takes memory that each rank's offload frees: every rank's must have returned)."""
    if step.skipped:
        return
    t0 = time.time()
    with run.watchdog.phase("sync"):
        if after_every_rank:
            run.driver.barrier()
        run.driver.run(call)
    step.memory[key] = step.memory.get(key, 0.0) + time.time() - t0


def _actor_memory(run, step: Step, parts) -> None:
    """The actor's ``parts`` offloaded (None: what is offloaded brought back), every rank."""
    if step.skipped or (parts is not None and not parts):
        return
    t0 = time.time()
    with run.watchdog.phase("collective"):
        moved = run.actor.onload() if parts is None else run.actor.offload(parts)
    way = "onload" if parts is None else "offload"
    step.memory[f"actor_{way}_gb"] = step.memory.get(f"actor_{way}_gb", 0.0) + moved / 1e9
    step.memory[f"actor_{way}_s"] = step.memory.get(f"actor_{way}_s", 0.0) + time.time() - t0


def release_engine(run, step: Step) -> None:
    """The engine frees its KV cache, CUDA graphs and weights (every server), for the actor."""
    _engine_memory(run, step, "engine_release_s", lambda: run.engine.release_memory(MEMORY_TAGS))


def onload_actor(run, step: Step) -> None:
    """The actor's offloaded parts back on its devices."""
    _actor_memory(run, step, None)


def offload_actor(run, step: Step) -> None:
    """After the updates: the actor's optimizer states and gradients (as ``actor.offload`` says) to
    host memory; the parameters stay for the weight sync."""
    _actor_memory(run, step, [p for p in run.offload_parts if p != "params"])


def resume_engine_weights(run, step: Step) -> None:
    """The engine takes its weights' memory back (their content is garbage until the sync: the
    engine serves nothing until the sync has ended)."""
    _engine_memory(run, step, "engine_resume_s", lambda: run.engine.resume_memory(("weights",)), after_every_rank=True)


def offload_params(run, step: Step) -> None:
    """After the sync: the actor's parameters to host memory too, when ``actor.offload`` says so."""
    _actor_memory(run, step, [p for p in run.offload_parts if p == "params"])


def resume_engine_cache(run, step: Step) -> None:
    """The engine takes its KV cache and CUDA graphs back: ready to generate."""
    _engine_memory(run, step, "engine_resume_s", lambda: run.engine.resume_memory(("kv_cache", "cuda_graph")),
                   after_every_rank=True)


def save_colocated(run, step: Step) -> None:
    """:func:`save`, with the actor back on its devices for a checkpoint (written before it leaves
    again: an asynchronous writer must not read memory that an offload frees)."""
    if not run.checkpoints.due(step.number) or not run.actor_offloaded():
        return save(run, step)
    with run.watchdog.phase("collective"):
        run.actor.onload()
    try:
        save(run, step)
    finally:
        with run.watchdog.phase("collective"):
            run.checkpoints.finish()
            run.actor.offload(run.offload_parts)


#: one step in colocated mode (see the phases above)
COLOCATED_STEP: tuple = (generate, release_engine, onload_actor, advantages, old_log_probs, update, offload_actor,
                         resume_engine_weights, sync, offload_params, resume_engine_cache, log, save_colocated)


def sync_resumed(run, step: Step) -> None:
    """A resumed run's weights pushed to the engine before the first generation (and a fresh run's
    that starts from a PEFT adapter: ``actor.lora.init_from``)."""
    if run.resumed_from is not None or starts_from_adapter(run.actor):
        with run.watchdog.phase("sync"):
            sync_weights(run.actor, run.engine)


def first_sync(run, step: Step) -> None:
    """The actor's weights pushed to the engine (colocated mode's start, resumed or not)."""
    with run.watchdog.phase("sync"):
        sync_weights(run.actor, run.engine)


@dataclass(frozen=True)
class Mode:
    """How a run's steps go: ``start``, once, after the checkpoint is loaded (it leaves the engine
    ready to generate), then ``step`` for every step, then ``end``, once the last checkpoint is
    complete (it leaves the actor as the caller built it)."""
    name: str
    start: tuple
    step: tuple
    end: tuple = ()


def start_source(run, step: Step) -> None:
    """The schedule's rollout source starts (partial rollout: the buffer, a resumed run's from its
    checkpoint, generates with the weights the engine holds)."""
    run.source.start(run, step.number + 1)


def stop_source(run, step: Step) -> None:
    """Everything the rollout source runs in the background stopped; the engine idle for the caller."""
    run.source.close(run)


#: the engine and the actor on their own devices; the source starts once the resumed weights
#: reached the engine
SEPARATE = Mode("separate", start=(sync_resumed, start_source), step=STEP, end=(stop_source,))
#: the engine and the actor share the GPUs (``rollout.colocated``). The start goes from whatever
#: state the two are in (each release, resume, offload and onload changes only what it must) to the
#: one every step starts from: the actor offloaded, the engine holding the actor's weights and its
#: cache
COLOCATED = Mode("colocated", start=(release_engine, onload_actor, offload_actor, resume_engine_weights, first_sync,
                                     offload_params, resume_engine_cache, start_source), step=COLOCATED_STEP,
                 end=(stop_source, release_engine, onload_actor))


def mode_of(cfg) -> Mode:
    """Colocated or separate: how the engine and the actor share the devices. (The schedule, where
    each step's rollout comes from, is the rollout source: :func:`~megatron_tepo.trainer.sources.source_of`.)"""
    return COLOCATED if cfg.rollout.colocated else SEPARATE


def policy_update(actor, mb: RolloutBatch, loss) -> Dict[str, float]:
    """One optimizer step, skipped (and reported as ``skipped_update``) when the loss or a gradient
    is not finite (the actor checks the reduced gradients before its optimizer touches anything):
    the weights, and so any checkpoint, never see a NaN."""
    import math

    metrics = actor.forward_backward(mb, loss)
    if not math.isfinite(metrics["loss"]):
        actor.discard_gradients()
        metrics.update(skipped_update=1.0, grad_norm=math.nan)
        return metrics
    metrics.update({"skipped_update": 0.0, **actor.optimizer_step()})
    return metrics


def _hang(number: int) -> None:
    """``fault.inject_hang_at_step`` (test only): block forever, as a rank stuck in a collective does."""
    print(f"[train] fault.inject_hang_at_step={number}: global rank 0 hangs now (test only)", flush=True)
    while True:
        time.sleep(3600)


Phase = Callable[[object, Step], None]
