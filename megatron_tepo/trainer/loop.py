"""The RL loop, top to bottom: generate -> reward -> dynamic sampling -> advantages -> old
log-probs -> N policy updates -> weight sync -> log / evaluate / save.

:func:`train` is the whole loop on one screen: a :class:`Run` (the run's parts and state), then
for every step the phases of :data:`~megatron_tepo.trainer.step.STEP`, one verb each
(:mod:`megatron_tepo.trainer.step`). The parts are modules of their own: the driver / follower
protocol (:mod:`.driver`), the group producer (:mod:`.groups`: prompts, sampling, reward, dynamic
sampling, the step's statistics), the evaluation (:mod:`.rollouts`), the run state and
its checkpoint plumbing (:mod:`.run_state`), the stall messages (:mod:`.stalls`), the watchdog
(:mod:`.watchdog`). Everything algorithmic comes from ``megatron_tepo.algorithms`` through the run
config, so every loss and ablation config runs through it unchanged.

Checkpoints hold the actor (model, optimizer, LR schedule, RNG: ``MegatronActor.save_checkpoint``)
plus the loop's own state (step, the prompt stream: order and RNG, the engine's sampling RNG, and
with one-step-off generation the next step's rollout), written atomically; a resumed run continues
exactly (tested with a SIGKILL). With ``train.async_save`` (the default) the tensors are written
in the background while the next step generates: it is complete and published before that step's
first update (so a run stopped in that step resumes from it), and the run finishes its last one
before it returns.

One-step-off generation (``rollout.max_staleness: 1``): while the actor trains step k, the driver
generates step k+1's rollout in a background thread with the weights step k started from; the
weights are synced once it is complete, so no request runs across an update. Step k+1 then
trains on a batch one update older than its weights (``rollout_staleness`` 1; step 1 is
on-policy): the old log-probs are the actor's (the proximal policy, as in decoupled PPO) and the
rollout correction (``algorithm.rollout_correction``) covers the behaviour policy's difference.

Several processes (torchrun: TP / PP / DP actor): global rank 0 is the *driver* (:class:`Driver`):
it alone holds the rollout engine, generates, scores, evaluates and logs, and broadcasts each
step's groups to the other ranks; every rank runs the actor's collectives (old log-probs, updates,
the weight export, checkpoints). Data-parallel ranks each train on their share of every
mini-batch (rows ``i % dp == dp_rank``); the loss normaliser is global (the actor's).

Hangs and stalls (``cfg.fault``, docs/FAULT_TOLERANCE.md): every rank runs a
:class:`~megatron_tepo.trainer.watchdog.Watchdog` over the waits for a rollout (``generate``), the
actor's collectives (``collective``: old log-probs, each policy update, a checkpoint) and the weight
sync (``sync``); a run without a policy update for ``fault.max_steps_without_update`` steps in a
row stops with :class:`NoUpdateError` on every rank (the count is saved with each checkpoint: a
resumed run goes on counting).

Partial rollout (``rollout.partial_rollout``, any ``max_staleness``): the driver's
:class:`~megatron_tepo.trainer.partial.RolloutBuffer` keeps the engine generating across steps; a step
takes its complete groups, and its weight sync interrupts the requests in flight and resumes them
under the new weights. Each of the three schedules is a rollout source
(:mod:`megatron_tepo.trainer.sources`): the step's phases call it and do not branch on it.

Left out: a reference policy for ``kl_target: ref``; a resumed run whose ``train.steps`` was raised past a finished run
generates its next step on-policy (the finished run saved no pending rollout).
"""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Callable, Dict, List, Optional

from megatron_tepo.algorithms import PolicyLoss, stale_sequence_ratio_warning
from megatron_tepo.algorithms.drift import DriftCheck
from megatron_tepo.config import RunConfig
from megatron_tepo.rollout.engine import RolloutEngine
from megatron_tepo.trainer.driver import Driver, FollowerEngine
from megatron_tepo.trainer.policy import Policy
from megatron_tepo.trainer.groups import Generated, GroupProducer, Task, generate_groups
from megatron_tepo.trainer.rollouts import evaluate, sync_weights
from megatron_tepo.trainer.run_state import Checkpoints, RunState
from megatron_tepo.trainer.sources import RolloutSource, source_of
from megatron_tepo.trainer.stalls import NoUpdateError, no_update_cause, stalled_message
from megatron_tepo.trainer.step import Mode, Step, mode_of, policy_update
from megatron_tepo.trainer.watchdog import Watchdog

__all__ = ["train", "Run", "Task", "NoUpdateError", "generate_groups", "evaluate", "sync_weights",
           "policy_update", "no_update_cause", "stalled_message", "Driver", "FollowerEngine", "data_parallel_coords"]


def train(cfg: RunConfig, actor: Policy, engine: Optional[RolloutEngine], task: Task, logger=None,
          on_step: Optional[Callable[[int, Dict], None]] = None,
          eval_fn: Optional[Callable[[], Dict[str, float]]] = None,
          checkpoint_root: Optional[Path] = None, extra_state: Optional[Dict] = None,
          checkpoint_files: Optional[Callable[[Path], None]] = None,
          report: Optional[Callable[[str], None]] = None, mode: Optional[Mode] = None) -> List[Dict[str, float]]:
    """The RL loop. Returns the per-step metrics (also logged). ``eval_fn`` runs every
    ``train.eval_every`` steps (0: never) and its results join that step's metrics. With
    ``checkpoint_root``, a checkpoint is written every ``train.save_every`` steps and at the last
    step (``checkpoint_files(dir)`` adds files to each, on the driver), and with ``train.resume``
    the run continues from the newest complete checkpoint there that loads (a damaged one is
    reported through ``report`` and the one before it is used; leftovers of interrupted saves are
    removed first); ``extra_state`` (JSON) is saved with it and read back into the same dict
    (with ``resumed_from``: the checkpoint the run continued from). The
    metrics log keeps exactly the steps before the one the run starts at.

    A step that makes no update (every group dropped, or every update skipped as non-finite) is
    logged, checkpointed and passed to ``on_step`` like the others (``skipped_step``, ``updates``);
    after ``fault.max_steps_without_update`` such steps in a row :class:`NoUpdateError` is raised
    on every rank, saying why and what to change. Every rank watches its own progress
    (:class:`~megatron_tepo.trainer.watchdog.Watchdog`, ``fault.watchdog_*_s``): a hung phase stops
    the process with every thread's stack in its log and exit status 75.

    With several processes, call it on every rank: ``engine``, ``logger``, ``on_step``, ``report``
    and ``eval_fn`` are used on the driver (global rank 0) only and may be None elsewhere; the
    returned metrics are the same on every rank."""
    mode = mode or mode_of(cfg)  # SEPARATE, or COLOCATED (rollout.colocated): trainer/step.py
    run = Run(cfg, actor, engine, task, logger=logger, on_step=on_step, eval_fn=eval_fn, report=report,
              checkpoints=(checkpoint_root, checkpoint_files), extra_state=extra_state)
    with run.watchdog:
        run.resume()  # the newest checkpoint that loads
        try:
            for phase in mode.start:  # the engine ready to generate (a resumed run's weights pushed to it)
                phase(run, Step(run.state.start - 1))
            for number in range(run.state.start, cfg.train.steps + 1):
                step = Step(number)
                for phase in mode.step:  # generate -> advantages -> old log-probs -> update -> sync -> log -> save
                    phase(run, step)
            with run.watchdog.phase("collective"):
                run.checkpoints.finish()  # every checkpoint complete before the run returns
            for phase in mode.end:  # colocated: the actor back on its devices; every mode: the source stopped
                phase(run, Step(cfg.train.steps))
        finally:
            run.source.close(run)  # (a failed run's requests stopped too)
    return run.history


class Run:
    """One run's parts and state, as the phases of a step read and change them: the config, the
    actor, the engine (a :class:`FollowerEngine` on ranks other than the driver), the task, the
    loss (built once), the group producer (:class:`~megatron_tepo.trainer.groups.GroupProducer`,
    drawing from the run state's prompt stream), the schedule's rollout source
    (:mod:`~megatron_tepo.trainer.sources`), the :class:`Driver`, this rank's :class:`Watchdog`, the
    data-parallel coordinates, the
    :class:`~megatron_tepo.trainer.run_state.RunState` and its
    :class:`~megatron_tepo.trainer.run_state.Checkpoints`, the hooks (``logger``, ``on_step``,
    ``eval_fn``, ``report``: the driver's only) and the metrics so far (``history``)."""

    def __init__(self, cfg: RunConfig, actor: Policy, engine: Optional[RolloutEngine], task: Task, *, logger=None,
                 on_step=None, eval_fn=None, report=None, checkpoints=(None, None), extra_state: Optional[Dict] = None):
        if cfg.algorithm.kl_target != "old":
            raise NotImplementedError("algorithm.kl_target: 'ref' needs a reference policy, not wired yet")
        self.cfg, self.actor, self.task = cfg, actor, task
        self.loss = PolicyLoss.from_config(cfg.algorithm)  # the loss, built once: the actor only calls it
        self.state = RunState.new(cfg, len(task.train_prompts), extra_state)
        self.producer = GroupProducer(task, cfg, self.state.stream)  # every schedule's groups
        self.history: List[Dict[str, float]] = []
        self.drift_check = DriftCheck(mean_threshold=cfg.rollout.drift_warn_mean,
                                      max_threshold=cfg.rollout.drift_warn_max, prefix="drift")
        self.driver = Driver(timeout_s=cfg.fault.process_group_timeout_s())
        self.dp_rank, self.dp_size = data_parallel_coords(actor)
        self.rows_per_mb = cfg.train.mini_batch_prompts * cfg.rollout.n_samples
        if self.rows_per_mb % self.dp_size:
            raise ValueError(f"train.mini_batch_prompts x rollout.n_samples = {self.rows_per_mb} rows per update must "
                             f"be divisible by the data-parallel size {self.dp_size}")
        if not self.driver.is_driver:
            logger = on_step = eval_fn = report = None
            engine = engine if engine is not None else FollowerEngine()
        self.engine, self.logger, self.on_step, self.eval_fn, self.report = engine, logger, on_step, eval_fn, report
        self.checkpoints = Checkpoints(cfg, actor, checkpoints[0], checkpoints[1], self.driver)
        self.checkpoints.clean()
        self.watchdog = Watchdog.from_config(cfg.fault, rank=self.driver.rank)  # this rank's (fault.watchdog_*)
        self.resumed_from: Optional[Path] = None
        # colocated mode: what the actor moves to host memory while the engine generates
        self.offload_parts = cfg.actor.offload_parts(cfg.rollout.colocated)
        # where each step's rollout comes from: synchronous, one step off, or partial rollout
        self.source: RolloutSource = source_of(cfg)

    def actor_offloaded(self) -> bool:
        return bool(self.actor.offloaded)

    def resume(self) -> None:
        """The newest checkpoint that loads (``train.resume``; the mode's start pushes its weights
        to the engine); the warnings and log state of the run's start."""
        latest = self.resumed_from = self.checkpoints.resume(self.state, self.engine, self.report, self.source)
        if latest is not None:
            if self.report is not None:
                self.report(f"resumed from {latest}: continuing at step {self.state.start}")
        if self.state.start == 1 and self.report is not None:
            self.report("starting at step 1")
        stale_warning = stale_sequence_ratio_warning(self.cfg.algorithm, self.cfg.rollout.max_staleness)
        if self.driver.is_driver and stale_warning:
            warnings.warn(stale_warning, RuntimeWarning, stacklevel=3)
        if self.logger is not None:
            self.logger.truncate_after(self.state.start - 1)

    def generate_rollout(self, version: int) -> Generated:
        """On the driver: the next step's groups, generated now with the weights ``version``."""
        return self.producer.step(self.engine, version)


def data_parallel_coords(actor: Policy) -> tuple:
    """(dp_rank, dp_size) of this process in the policy's layout."""
    size = int(actor.dp_size)
    return (int(actor.dp_rank), size) if size > 1 else (0, 1)
