"""The RL loop, top to bottom: generate -> reward -> dynamic sampling -> advantages -> old
log-probs -> N policy updates -> weight sync -> log / evaluate.

:func:`train` is the whole loop on one screen; the helpers above it are small and separately
tested. Everything algorithmic comes from ``megatron_tepo.algorithms`` through the run config, so
every loss and ablation config runs through it unchanged.

Checkpoints hold the actor (model, optimizer, LR schedule, RNG: ``MegatronActor.save_checkpoint``)
plus the loop's own state (step, prompt order and RNG, the engine's sampling RNG, and with
one-step-off generation the next step's rollout), written atomically; a resumed run continues
exactly (tested with a SIGKILL). With ``train.async_save`` (the default) the tensors are written
in the background while the next steps train: each step publishes a save that is written by then,
a new save first finishes the one in flight, and the run finishes its last one before it returns.

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

Left out: a reference policy for ``kl_target: ref``; staleness beyond one step (fully
asynchronous generation); a resumed run whose ``train.steps`` was raised past a finished run
generates its next step on-policy (the finished run saved no pending rollout).
"""
from __future__ import annotations

import math
import queue
import random
import threading
import time
import warnings
from concurrent.futures import Future
from dataclasses import dataclass
from datetime import timedelta
from functools import partial
from pathlib import Path
from typing import Callable, Dict, List, NamedTuple, Optional, Sequence

import torch

from megatron_tepo.actor.checkpointing import load_newest_checkpoint
from megatron_tepo.checkpoint.store import prune_checkpoints, remove_partial_checkpoints
from megatron_tepo.algorithms import PolicyLoss, compute_group_advantages, filter_groups, get_loss_defaults
from megatron_tepo.algorithms.advantages import gpg_correction
from megatron_tepo.algorithms.drift import DriftCheck
from megatron_tepo.batch import RolloutBatch
from megatron_tepo.config import AlgorithmConfig, RunConfig
from megatron_tepo.rewards import RewardFn, scores_and_counts
from megatron_tepo.rollout.engine import Sample, gathered_tensors
from megatron_tepo.trainer.watchdog import Watchdog, process_group_timeout_s

try:
    import torch.distributed as dist
except ImportError:  # pragma: no cover
    dist = None


@dataclass
class Task:
    """What to train on: tokenized prompts with answers, a reward, and how responses end."""
    train_prompts: List[List[int]]
    train_answers: List[str]
    reward_fn: RewardFn  # (response token ids per sample, answer per sample) -> rewards (and counts)
    stop_token_ids: Sequence[int]
    pad_token_id: int = 0
    eval_prompts: Optional[List[List[int]]] = None
    eval_answers: Optional[List[str]] = None


class Generated(NamedTuple):
    """One step's rollout: kept prompts, their groups, their rewards (one tensor, group after group),
    the sampling statistics (the reward's counts included), and the weights that generated it
    (``weights_version`` k: the weights step k started from)."""
    prompts: List[List[int]]
    groups: list
    rewards: torch.Tensor
    stats: Dict
    weights_version: int


class Driver:
    """Global rank 0 drives the loop: it alone generates, scores, evaluates and logs; what it
    computes reaches the other ranks as pickled objects over a gloo group of its own (the actor's
    collectives keep theirs). In a one-process run everything is local."""

    def __init__(self, timeout_s: Optional[float] = None):
        on = dist is not None and dist.is_available() and dist.is_initialized()
        self.world = dist.get_world_size() if on else 1
        self.rank = dist.get_rank() if on else 0
        # timeout_s: the followers wait in its broadcast through a whole rollout (see watchdog.py)
        self._group = (dist.new_group(backend="gloo", timeout=timedelta(seconds=timeout_s) if timeout_s else None)
                       if self.world > 1 else None)
        self._jobs = None  # the background thread's queue, once started

    def start(self, fn: Callable[[], object]) -> Optional[Future]:
        """``fn()`` in the driver's background thread (one-step-off generation); None elsewhere.
        One thread for the driver's life: processes it starts (reward workers, which die with the
        thread that started them) outlive the job. It dies with the process (daemon): a failed
        run does not wait for it."""
        if not self.is_driver:
            return None
        if self._jobs is None:
            self._jobs = queue.SimpleQueue()
            threading.Thread(target=self._serve, args=(self._jobs,), name="mtepo-generate", daemon=True).start()
        job: Future = Future()
        self._jobs.put((fn, job))
        return job

    @staticmethod
    def _serve(jobs) -> None:
        while True:
            fn, job = jobs.get()
            try:
                job.set_result(fn())
            except BaseException as exc:  # noqa: BLE001 -- handed to the waiting rank
                job.set_exception(exc)

    def local(self, fn: Callable[[], object]):
        """``fn()`` on the driver, its result kept there (None elsewhere: nothing is sent); an
        error in it is raised on every rank, so no rank goes on into a collective alone."""
        box = [None]

        def call():
            box[0] = fn()

        self.run(call)
        return box[0]

    @property
    def is_driver(self) -> bool:
        return self.rank == 0

    def run(self, fn: Callable[[], object]):
        """``fn()`` on the driver, its result on every rank. An exception on the driver is raised
        there and, as a RuntimeError naming it, on every other rank (no rank is left waiting)."""
        if self.world == 1:
            return fn()
        box, error = [None], None
        if self.is_driver:
            try:
                box[0] = ("ok", fn())
            except BaseException as exc:  # noqa: BLE001 -- re-raised below on every rank
                error, box[0] = exc, ("error", f"{type(exc).__name__}: {exc}")
        dist.broadcast_object_list(box, src=0, group=self._group)
        status, value = box[0]
        if status == "error":
            if error is not None:
                raise error
            raise RuntimeError(f"the driver (global rank 0) failed: {value}")
        return value

    def combine_drift(self, local: Dict[str, float], check: DriftCheck, dp_size: int,
                      warn: bool = True) -> Dict[str, float]:
        """Drift metrics over the rows of every data-parallel rank (token-weighted mean, max);
        the driver warns over ``check``'s thresholds (``warn``)."""
        p = check.prefix
        t = torch.tensor([local[f"{p}_mean"] * local[f"{p}_tokens"], float(local[f"{p}_tokens"]), local[f"{p}_max"]],
                         dtype=torch.float64)
        dist.all_reduce(t[:2], group=self._group)
        mx = t[2:].clone()
        dist.all_reduce(mx, op=dist.ReduceOp.MAX, group=self._group)
        mean = float(t[0] / t[1]) if t[1] > 0 else 0.0
        tokens = int(t[1]) * dp_size // self.world  # each DP share is held by world / dp ranks (TP, PP)
        return check.report(mean, float(mx), tokens, warn=warn and self.is_driver)


class FollowerEngine:
    """What a rank other than the driver holds in place of the rollout engine: it takes part in
    the weight sync (the export is collective; with a fleet, ``weight_sync`` is a
    :class:`~megatron_tepo.rollout.sglang.weight_sync.WeightSync` with ``is_sender=False``, so its export
    calls match the sender's) and refuses to generate."""

    def __init__(self, weight_sync=None):
        self.weight_sync = weight_sync

    def update_weights(self, named_tensors) -> None:
        if self.weight_sync is not None:
            self.weight_sync.push(named_tensors)
        else:  # the driver's engine reads the export gathered to it: take part, keep nothing
            for _ in gathered_tensors(named_tensors):
                pass

    def generate(self, *args, **kwargs):
        raise RuntimeError("only the driver (global rank 0) generates; this rank follows")

    def close(self) -> None:
        if self.weight_sync is not None and hasattr(self.weight_sync, "close"):
            self.weight_sync.close()


def data_parallel_coords(actor) -> tuple:
    """(dp_rank, dp_size) of this process in the actor's layout."""
    size = int(getattr(actor, "dp_size", 1) or 1)
    if size == 1:
        return 0, 1
    from megatron.core import parallel_state

    return parallel_state.get_data_parallel_rank(), size


def generate_groups(engine, task: Task, indices: List[int], cfg: RunConfig, rng: random.Random):
    """Groups for ``prompts_per_step`` prompts, with DAPO dynamic sampling: groups whose rewards
    are all equal are dropped and fresh prompts drawn, for at most ``max_sampling_rounds`` rounds
    (counted). Returns (prompt ids, samples per group, the kept samples' rewards as one tensor in
    group order, stats: the sampling's and the reward's counts over every round)."""
    r = cfg.rollout
    want = r.prompts_per_step
    kept_prompts, kept_groups, kept_rewards = [], [], []  # kept_rewards: one tensor per round
    stats = {"sampling_rounds": 0, "groups_dropped": 0, "groups_generated": 0}
    queue = list(indices)
    while len(kept_prompts) < want and stats["sampling_rounds"] < r.max_sampling_rounds:
        stats["sampling_rounds"] += 1
        need = want - len(kept_prompts)
        batch_idx = [queue.pop(0) if queue else rng.randrange(len(task.train_prompts)) for _ in range(need)]
        prompts = [task.train_prompts[i] for i in batch_idx]
        groups = engine.generate(prompts, n=r.n_samples, temperature=r.temperature, top_p=r.top_p,
                                 max_new_tokens=r.max_new_tokens, stop_token_ids=task.stop_token_ids)
        flat = [s.token_ids for g in groups for s in g]
        answers = [task.train_answers[i] for i in batch_idx for _ in range(r.n_samples)]
        scores, counts = scores_and_counts(task.reward_fn(flat, answers))
        rewards = torch.tensor(scores, dtype=torch.float32)
        for k, v in counts.items():
            stats[k] = stats.get(k, 0) + v
        stats["groups_generated"] += len(groups)
        keep = filter_groups(rewards, r.n_samples).keep_groups.tolist() if r.dynamic_sampling else [True] * len(groups)
        kept = [g for g in range(len(groups)) if keep[g]]  # at most `need`: the round drew that many
        stats["groups_dropped"] += len(groups) - len(kept)
        kept_prompts += [task.train_prompts[batch_idx[g]] for g in kept]
        kept_groups += [groups[g] for g in kept]
        kept_rewards.append(rewards.view(len(groups), r.n_samples)[kept].flatten())
        stats.setdefault("reward_mean_all", float(rewards.mean()))
    return kept_prompts, kept_groups, torch.cat(kept_rewards), stats


def sync_weights(actor, engine) -> float:
    """The actor's weights into the engine (its update flushes its cache); returns seconds.
    Collective: the export gathers over the actor's groups, so every rank calls it; ranks other
    than the driver pass a :class:`FollowerEngine`."""
    t = time.time()
    engine.update_weights(actor.export_hf_state())
    return time.time() - t


def evaluate(engine, prompts, answers, reward_fn: RewardFn, stop_token_ids, *, n: int = 1,
             temperature: float = 1e-5, top_p: float = 1.0, max_new_tokens: int = 16) -> Dict[str, float]:
    """avg@n (mean reward) and pass@n (any sample correct) over held-out prompts, and the reward's
    counts when it gives them (:data:`~megatron_tepo.rewards.COUNT_NAMES`)."""
    groups = engine.generate(prompts, n=n, temperature=temperature, top_p=top_p, max_new_tokens=max_new_tokens,
                             stop_token_ids=stop_token_ids)
    flat = [s.token_ids for g in groups for s in g]
    scores, counts = scores_and_counts(reward_fn(flat, [a for a in answers for _ in range(n)]))
    rewards = torch.tensor(scores).view(len(prompts), n)
    return {f"avg@{n}": float(rewards.mean()), f"pass@{n}": float((rewards.max(1).values > 0).float().mean()),
            **counts}


def policy_update(actor, mb: RolloutBatch, loss: PolicyLoss) -> Dict[str, float]:
    """One optimizer step, skipped (and reported as ``skipped_update``) when the loss or a gradient
    is not finite (the actor checks the reduced gradients before its optimizer touches anything):
    the weights, and so any checkpoint, never see a NaN."""
    metrics = actor.forward_backward(mb, loss)
    if not math.isfinite(metrics["loss"]):
        actor.discard_gradients()
        metrics.update(skipped_update=1.0, grad_norm=math.nan)
        return metrics
    metrics.update({"skipped_update": 0.0, **actor.optimizer_step()})
    return metrics


def skipped_update_message(step: int, updates: List[Dict[str, float]], max_steps_without_update: int) -> str:
    """The one line a step with skipped updates prints: how many, why, and what stops a run that keeps
    skipping."""
    skipped = [u for u in updates if u["skipped_update"]]
    losses = sum(1 for u in skipped if not math.isfinite(u.get("loss", math.nan)))
    why = ", ".join(f"{n} with a non-finite {what}" for n, what in ((losses, "loss"),
                                                                  (len(skipped) - losses, "gradient (NaN or inf)")) if n)
    stop = (f"fault.max_steps_without_update={max_steps_without_update} stops a run without updates"
            if max_steps_without_update else "fault.max_steps_without_update: 0, the run goes on")
    return (f"step {step}: {len(skipped)} of {len(updates)} policy update(s) skipped: {why}; no weight changed "
            f"({stop})")


class NoUpdateError(RuntimeError):
    """The run stopped changing the policy: :func:`train` after ``fault.max_steps_without_update``
    steps in a row without an update, ``trainer/main.py`` when a whole run made none
    (``tools/train.py`` exits 3; the Slurm job does not requeue it: it would stall again)."""


def no_update_cause(metrics: dict, n_samples: int) -> str:
    """Why a step made no update, as far as its metrics tell (the reward's counts among them)."""
    if metrics.get("skipped_step"):
        answers = metrics.get("groups_generated", 0) * n_samples
        no_answer = metrics.get("reward_no_answer", 0)
        timeouts = metrics.get("reward_timeouts", 0)
        mean = metrics.get("reward_mean_all", 0.0)
        why = (f"every group had equal rewards in {metrics.get('sampling_rounds', 0):g} sampling round(s) "
               f"(reward mean {mean:.3f})")
        if answers and no_answer >= answers / 2:
            why += (f"; {no_answer} of {answers} responses had no \\boxed{{}} answer: check the prompt template "
                    f"and rollout.max_new_tokens")
        elif timeouts:
            why += f"; {timeouts} answers timed out (reward.timeout_s)"
        elif mean >= 1.0:
            why += "; every response was already right: the prompts are too easy"
        return why
    return "every update was skipped: the loss or the gradient norm was not finite"


def stalled_message(steps: int, last_step: int, metrics: dict, n_samples: int) -> str:
    """The stop of a run with no update in ``steps`` steps in a row (ending at ``last_step``): why, and
    what to change."""
    if metrics.get("skipped_step"):
        change = ("give it prompts whose samples differ in reward (harder or easier data, data.train_files), "
                  "more sampling (rollout.n_samples, rollout.temperature, rollout.max_sampling_rounds), or check "
                  "the reward (reward.kind)")
    else:
        change = "lower optim.lr, check the data for degenerate rows, or resume from an earlier checkpoint"
    return (f"no policy update for {steps} steps in a row (steps {last_step - steps + 1}-{last_step}, "
            f"fault.max_steps_without_update={steps}): {no_update_cause(metrics, n_samples)}; {change} "
            f"(fault.max_steps_without_update: 0 never stops)")


def _hang(step: int) -> None:
    """``fault.inject_hang_at_step`` (test only): block forever, as a rank stuck in a collective does."""
    print(f"[train] fault.inject_hang_at_step={step}: global rank 0 hangs now (test only)", flush=True)
    while True:
        time.sleep(3600)


PENDING_FILE = "pending_rollout.pt"
LOOP_KEYS = ("step", "rng", "order", "engine_rng", "pending_rollout", "steps_without_update")


def _loop_state(step: int, rng: random.Random, order: List[int], engine, extra: Dict,
                pending: Optional[Generated] = None, stalled: int = 0) -> Dict:
    """Everything besides the actor that a resumed run needs to continue exactly (JSON; the next
    step's rollout, generated one step off, goes into ``PENDING_FILE`` beside it)."""
    version, internal, gauss = rng.getstate()
    gen = getattr(engine, "generator", None)
    return {"step": step, "rng": [version, list(internal), gauss], "order": order,
            "engine_rng": gen.get_state().tolist() if gen is not None else None,
            "pending_rollout": PENDING_FILE if pending is not None else None,
            "steps_without_update": stalled, **extra}


def _write_pending(g: Generated, path: Path) -> None:
    torch.save({"prompts": g.prompts, "rewards": g.rewards, "stats": g.stats, "weights_version": g.weights_version,
                "groups": [[(s.token_ids, s.log_probs, s.finish_reason) for s in grp] for grp in g.groups]}, path)


def _read_pending(path: Path) -> Generated:
    try:
        d = torch.load(path, weights_only=True)
        groups = [[Sample(list(t), list(lp), fr) for t, lp, fr in grp] for grp in d["groups"]]
        rewards = d["rewards"]
        if isinstance(rewards, list):  # written before the rewards were one tensor: one per group
            rewards = torch.cat(rewards)
        return Generated(d["prompts"], groups, rewards, d["stats"], int(d["weights_version"]))
    except Exception as exc:  # noqa: BLE001 -- any unreadable file: one line naming it
        raise ValueError(f"{path}: the next step's rollout saved with this checkpoint cannot be read "
                         f"({type(exc).__name__}: {exc}); resume from an earlier checkpoint") from None


def _restore_loop_state(state: Dict, rng: random.Random, order: List[int], engine) -> int:
    version, internal, gauss = state["rng"]
    rng.setstate((version, tuple(internal), gauss))
    order[:] = state["order"]
    if state.get("engine_rng") is not None and getattr(engine, "generator", None) is not None:
        engine.generator.set_state(torch.tensor(state["engine_rng"], dtype=torch.uint8))
    return int(state["step"])


# Losses whose trust region is a sequence-level (geometric-mean) ratio. The widest range at which
# they were measured to train one step off as well as on-policy is their default (one value, in
# the loss registry): TEPO learned worse one step off at 0.2/0.28 on the tiny benchmark, and as
# well as on-policy at 3e-4/4e-4 and at 0.01/0.014, its default (docs/BENCHMARKS.md, "One step
# off", "A range in between"); a run with a wider range says so. A default moved without a
# one-step-off measurement would need its own measured range here.
SEQUENCE_RATIO_LOSSES = ("tepo",)
STALE_SEQUENCE_RATIO_WARNING = (
    "rollout.max_staleness={staleness} with algorithm.loss={loss} and clip {low}/{high}: on the tiny benchmark this "
    "loss learned worse one step off with its ratio clipped at 0.2/0.28, and as well as on-policy at {tight_low}/"
    "{tight_high} (docs/BENCHMARKS.md, 'One step off'); watch rollout_mismatch_kl and held-out accuracy")


def stale_sequence_ratio_warning(alg: AlgorithmConfig, max_staleness: int) -> Optional[str]:
    """The warning for a sequence-ratio loss trained off-policy with a wider clip range than was
    measured to work, or None."""
    if not max_staleness or alg.loss not in SEQUENCE_RATIO_LOSSES:
        return None
    defaults = get_loss_defaults(alg.loss)
    low = defaults["clip_low"] if alg.clip_low is None else alg.clip_low
    high = defaults["clip_high"] if alg.clip_high is None else alg.clip_high
    tight_low, tight_high = defaults["clip_low"], defaults["clip_high"]  # measured one step off (above)
    if low <= tight_low and high <= tight_high:
        return None
    return STALE_SEQUENCE_RATIO_WARNING.format(staleness=max_staleness, loss=alg.loss, low=low, high=high,
                                               tight_low=tight_low, tight_high=tight_high)


def train(cfg: RunConfig, actor, engine, task: Task, logger=None,
          on_step: Optional[Callable[[int, Dict], None]] = None,
          eval_fn: Optional[Callable[[], Dict[str, float]]] = None,
          checkpoint_root: Optional[Path] = None, extra_state: Optional[Dict] = None,
          checkpoint_files: Optional[Callable[[Path], None]] = None,
          report: Optional[Callable[[str], None]] = None) -> List[Dict[str, float]]:
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
    rng = random.Random(cfg.train.seed)
    order = list(range(len(task.train_prompts)))
    if cfg.algorithm.kl_target != "old":
        raise NotImplementedError("algorithm.kl_target: 'ref' needs a reference policy, not wired yet")
    loss = PolicyLoss.from_config(cfg.algorithm)  # the loss, built once: the actor only calls it
    n = cfg.rollout.n_samples
    history = []
    extra = extra_state if extra_state is not None else {}
    drift_check = DriftCheck(mean_threshold=cfg.rollout.drift_warn_mean, max_threshold=cfg.rollout.drift_warn_max,
                             prefix="drift")
    driver = Driver(timeout_s=process_group_timeout_s(cfg.fault))
    dp_rank, dp_size = data_parallel_coords(actor)
    rows_per_mb = cfg.train.mini_batch_prompts * n
    if rows_per_mb % dp_size:
        raise ValueError(f"train.mini_batch_prompts x rollout.n_samples = {rows_per_mb} rows per update must be "
                         f"divisible by the data-parallel size {dp_size}")
    if not driver.is_driver:
        logger = on_step = eval_fn = report = None
        engine = engine if engine is not None else FollowerEngine()
    start, pending = 1, None  # pending: the next step's rollout, on the driver (one-step-off)
    stalled = 0  # steps in a row without an update (fault.max_steps_without_update), kept across resumes
    if checkpoint_root:
        remove_partial_checkpoints(checkpoint_root)
    with Watchdog.from_config(cfg.fault, rank=driver.rank) as watchdog:  # this rank's (fault.watchdog_*)
        if checkpoint_root and cfg.train.resume:
            latest, state = load_newest_checkpoint(actor, checkpoint_root, report)
            if latest is not None:
                start = _restore_loop_state(state, rng, order, engine) + 1
                stalled = int(state.get("steps_without_update", 0))  # (0 in checkpoints written before it was saved)
                extra.update({k: v for k, v in state.items() if k not in LOOP_KEYS})
                if state.get("pending_rollout"):
                    pending = driver.local(partial(_read_pending, Path(latest) / state["pending_rollout"]))
                extra["resumed_from"] = str(latest)
                with watchdog.phase("sync"):
                    sync_weights(actor, engine)
                if report is not None:
                    report(f"resumed from {latest}: continuing at step {start}")
        if start == 1 and report is not None:
            report("starting at step 1")
        stale_warning = stale_sequence_ratio_warning(cfg.algorithm, cfg.rollout.max_staleness)
        if driver.is_driver and stale_warning:
            warnings.warn(stale_warning, RuntimeWarning, stacklevel=2)
        if logger is not None:
            logger.truncate_after(start - 1)

        def generate(version: int) -> Generated:  # on the driver: the next prompts, sampled and scored
            rng.shuffle(order)
            prompts, groups, rewards, stats = generate_groups(engine, task, order[:cfg.rollout.prompts_per_step],
                                                              cfg, rng)
            health = getattr(engine, "health_metrics", dict)()  # servers lost, restarted, re-synced since
            return Generated(prompts, groups, rewards, {**stats, **health}, version)

        def finish(step: int, metrics: Dict, pending: Optional[Generated]) -> None:
            # 6. every step, with or without an update (a collapsed run is measured too): the held-out
            #    evaluation when due, the step's report, its checkpoint; a run that stopped updating stops
            nonlocal stalled
            if cfg.train.eval_every and step % cfg.train.eval_every == 0:
                with watchdog.phase("generate"):
                    metrics.update(driver.run(eval_fn or dict))
            if on_step is not None:
                on_step(step, metrics)
            if logger is not None:
                logger.log(step, metrics)
            stalled = stalled + 1 if metrics["updates"] == 0 else 0
            with watchdog.phase("collective"):
                _finalize_saves(actor)  # an asynchronous save written by now is published
                _save(cfg, actor, checkpoint_root, step, _loop_state(step, rng, order, engine, extra, pending, stalled),
                      checkpoint_files, driver, pending)
            history.append(metrics)
            if cfg.fault.max_steps_without_update and stalled >= cfg.fault.max_steps_without_update:
                with watchdog.phase("collective"):
                    _finalize_saves(actor, blocking=True)  # the last checkpoint complete before the stop
                raise NoUpdateError(stalled_message(stalled, step, metrics, n))

        for step in range(start, cfg.train.steps + 1):
            t0 = time.time()
            # 1. generate -> reward -> dynamic sampling; one-step-off: this step's rollout was generated
            #    while the previous step trained, and the next one's starts now, with this step's weights
            with watchdog.phase("generate"):
                prompts, groups, reward, gen, version = driver.run(lambda: pending or generate(step))
            rollout_s = time.time() - t0  # waiting for the rollout (generating it, when not done ahead)
            # (every rank knows whether a rollout runs ahead: waiting for it is a collective)
            overlap = bool(cfg.rollout.max_staleness) and step < cfg.train.steps
            pending, ahead = None, driver.start(partial(generate, step)) if overlap else None
            gen = {**gen, "rollout_staleness": float(step - version)}
            if not prompts:  # every group had equal rewards for max_sampling_rounds rounds
                t = time.time()
                with watchdog.phase("generate"):
                    pending = driver.local(lambda: ahead.result()) if overlap else None
                finish(step, {"skipped_step": 1.0, "updates": 0.0, **gen, "rollout_s": rollout_s + time.time() - t,
                              "step_s": time.time() - t0}, pending)
                continue
            # 2. advantages (eq. 9), GPG's correction when configured
            adv = compute_group_advantages(reward, n, std_normalize=cfg.advantage.std_normalize, eps=cfg.advantage.eps)
            if cfg.advantage.gpg_correction:
                adv = adv * gpg_correction(reward, n)
            batch = RolloutBatch.from_groups(prompts, groups, task.pad_token_id, advantages=adv,
                                             temperature=cfg.rollout.temperature)
            response_length_mean = float(batch.response_mask.sum(1).mean())
            if dp_size > 1:  # this rank's share of every mini-batch (rows_per_mb is a multiple of dp_size)
                batch = batch.split_for_data_parallel(dp_rank, dp_size)
            # 3. old log-probs: the actor's (and its entropy), or the engine's own
            t_train, drift = time.time(), {}
            if cfg.algorithm.old_log_prob == "rollout":
                batch.old_log_probs = batch.rollout_log_probs
            else:
                with watchdog.phase("collective"):
                    batch.old_log_probs, batch.old_entropy = actor.compute_log_probs(batch)
                    fresh = step == version  # a batch of older weights differs by an update: reported, no warning
                    local = drift_check(batch.rollout_log_probs, batch.old_log_probs, batch.response_mask,
                                        warn=dp_size == 1 and fresh and driver.is_driver)
                    drift = local if dp_size == 1 else driver.combine_drift(local, drift_check, dp_size, warn=fresh)
            # 4. policy updates over mini-batches of prompts (each one progress for the watchdog)
            local_rows_per_mb = rows_per_mb // dp_size
            updates = []
            with watchdog.phase("collective"):
                if step == cfg.fault.inject_hang_at_step and start == 1 and driver.is_driver:
                    _hang(step)  # test only: the other ranks block in the update's collectives
                for _ in range(cfg.train.epochs_per_step):
                    for first in range(0, batch.batch_size, local_rows_per_mb):
                        mb = batch.select(range(first, min(first + local_rows_per_mb, batch.batch_size)))
                        updates.append(policy_update(actor, mb, loss))
                        watchdog.beat()
            # 5. weight sync to the rollout engine, once the next step's rollout is in (no request runs
            #    across a weight update)
            t = time.time()
            train_s = t - t_train
            with watchdog.phase("generate"):
                pending = driver.local(lambda: ahead.result()) if overlap else None
            rollout_s += time.time() - t
            with watchdog.phase("sync"):
                sync_s = sync_weights(actor, engine)
            if report is not None and any(u["skipped_update"] for u in updates):
                report(skipped_update_message(step, updates, cfg.fault.max_steps_without_update))
            done = [u for u in updates if not u["skipped_update"]] or updates
            metrics = {k: sum(u[k] for u in done) / len(done) for k in done[0] if isinstance(done[0][k], float)}
            metrics["skipped_update"] = float(sum(u["skipped_update"] for u in updates))
            metrics["updates"] = float(len(updates)) - metrics["skipped_update"]
            metrics.update(gen, reward_mean=float(reward.mean()), rollout_s=rollout_s, train_s=train_s, sync_s=sync_s,
                           step_s=time.time() - t0, response_length_mean=response_length_mean, **drift)
            finish(step, metrics, pending)
        with watchdog.phase("collective"):
            _finalize_saves(actor, blocking=True)  # every checkpoint complete before the run returns
        return history


def _finalize_saves(actor, blocking: bool = False) -> None:
    """Collective: publish the actor's asynchronous checkpoint saves that are written (``blocking``:
    wait for them)."""
    finalize = getattr(actor, "finalize_checkpoints", None)
    if finalize is not None:
        finalize(blocking=blocking)


def _save(cfg: RunConfig, actor, root: Optional[Path], step: int, state: Dict, files, driver: Driver,
          pending: Optional[Generated] = None) -> None:
    """Checkpoint every ``train.save_every`` steps and always at the last one; prune old ones.
    With one-step-off generation the next step's rollout is saved with it (``PENDING_FILE``)."""
    if not root or not (step == cfg.train.steps or (cfg.train.save_every and step % cfg.train.save_every == 0)):
        return

    def write_extra(tmp: Path) -> None:
        if files is not None:
            files(tmp)
        if pending is not None:
            _write_pending(pending, tmp / PENDING_FILE)

    def prune(_published: Path) -> None:  # once the new one is complete: the kept ones stay complete
        if cfg.train.keep_checkpoints:
            prune_checkpoints(root, cfg.train.keep_checkpoints)

    driver_only = driver.is_driver
    actor.save_checkpoint(Path(root) / f"step_{step}", state, write_extra=write_extra if driver_only else None,
                          asynchronous=cfg.train.async_save, on_publish=prune if driver_only else None)
