"""Where a step's rollout comes from: one :class:`RolloutSource` per schedule, which the step's
verbs (:mod:`megatron_tepo.trainer.step`) call without knowing which schedule runs.

* :class:`Synchronous` (``rollout.max_staleness: 0``): generation and training alternate; a step
  generates its rollout with the weights it starts from. It carries nothing between steps.
* :class:`OneStepOff` (``rollout.max_staleness: 1``): while the actor trains step k, the driver's
  background thread generates step k+1's rollout with the weights step k started from; the weight
  sync waits for it, so no request runs across an update. A checkpoint keeps that next rollout
  (:data:`PENDING_FILE`).
* :class:`Partial` (``rollout.partial_rollout``): the driver's
  :class:`~megatron_tepo.trainer.partial.RolloutBuffer` keeps the engine generating across steps;
  the weight sync interrupts the requests in flight and resumes them under the new weights. A
  checkpoint keeps the buffer (:data:`~megatron_tepo.trainer.partial.BUFFER_FILE`), and the prompt
  stream as it stood at that update (:meth:`RolloutSource.stream_state`).

Every schedule's groups come from the run's one group producer
(:class:`~megatron_tepo.trainer.groups.GroupProducer`: prompts, sampling parameters, reward, dynamic
sampling, the step's statistics); the sources differ only in when they ask it for groups.

Every rank holds the same source (the schedule is the config's); each method is called on every
rank at the same point and does its driver-side work through the run's
:class:`~megatron_tepo.trainer.driver.Driver`, so that the other ranks take part in its broadcasts.
What a source saves goes through one sample round trip
(:func:`~megatron_tepo.rollout.engine.to_state` / :func:`~megatron_tepo.rollout.engine.from_state`).

Left out: generating and scoring a rollout (:mod:`megatron_tepo.trainer.groups`, through
``Run.generate_rollout``), the buffer's own rules (:mod:`megatron_tepo.trainer.partial`), the
checkpoint plumbing that writes a source's state (:mod:`megatron_tepo.trainer.run_state`).
"""
from __future__ import annotations

import abc
import time
from concurrent.futures import Future
from functools import partial
from pathlib import Path
from typing import Any, Callable, Dict, Optional, Tuple

import torch

from megatron_tepo.rollout.engine import Sample, from_state, to_state
from megatron_tepo.trainer.partial import (BUFFER_FILE, STREAM_KEY, RolloutBuffer, read_buffer, staleness_metrics,
                                           write_buffer)
from megatron_tepo.trainer.groups import Generated, PromptStream

__all__ = ["RolloutSource", "Synchronous", "OneStepOff", "Partial", "source_of", "PENDING_FILE",
           "generated_to_state", "generated_from_state"]

#: one-step-off generation: the next step's rollout, saved with a checkpoint
PENDING_FILE = "pending_rollout.pt"


class RolloutSource(abc.ABC):
    """A schedule's rollout, as the step's verbs use it (see the module docstring). ``run`` is the
    :class:`~megatron_tepo.trainer.loop.Run`; ``step`` a :class:`~megatron_tepo.trainer.step.Step`."""

    #: the loop state's key and the checkpoint file of what it carries between steps (None: nothing)
    state_key: Optional[str] = None
    state_file: Optional[str] = None

    def start(self, run, version: int) -> None:
        """The engine holds weights ``version``; anything the schedule runs in the background starts."""

    @abc.abstractmethod
    def take(self, run, step) -> Generated:
        """Step ``step.number``'s rollout, on every rank (generated, or taken from what ran ahead)."""

    def settle(self, run, step) -> None:
        """A step with nothing to train on: what runs ahead for the next step is in (its waiting time
        added to ``step.rollout_s``); nothing else changes."""

    def around_sync(self, run, step, push: Callable[[], float]) -> Tuple[float, Dict[str, float]]:
        """``push()`` (the weight sync, collective) with nothing generating; returns its seconds and
        the schedule's counts of the update (partial rollout: the requests resumed)."""
        with run.watchdog.phase("sync"):
            return push(), {}

    def quiet(self, run, fn: Callable[[], Any]):
        """``fn()`` on the driver with nothing generating (the held-out evaluation); its result on
        every rank."""
        return run.driver.run(fn)

    def state(self) -> Optional[Any]:
        """On the driver: what a checkpoint written now keeps (None: nothing)."""
        return None

    def restore(self, payload: Any) -> None:
        """On the driver: :meth:`state` of a checkpoint, read back (before :meth:`start`)."""

    def write_state(self, payload: Any, path: Path) -> None:
        torch.save(payload, path)

    def read_state(self, path: Path) -> Any:
        raise NotImplementedError

    def stream_state(self, stream: PromptStream) -> Dict:
        """On the driver: the prompt stream's state a checkpoint written now keeps (as it stands)."""
        return stream.state()

    def close(self, run) -> None:
        """Everything the schedule runs in the background stopped (a failed run's too)."""


class Synchronous(RolloutSource):
    """Generation and training alternate: each step generates with the weights it starts from."""

    def take(self, run, step) -> Generated:
        return run.driver.run(lambda: run.generate_rollout(step.number))


class OneStepOff(RolloutSource):
    """The next step's rollout generated while this step trains, with the weights this step started
    from (``rollout.max_staleness: 1``); the weight sync waits for it."""

    state_key, state_file = "pending_rollout", PENDING_FILE

    def __init__(self):
        self.pending: Optional[Generated] = None  # on the driver: the next step's rollout, once in
        self.ahead: Optional[Future] = None  # on the driver: the one being generated
        self.overlap = False  # (every rank) whether one runs ahead: waiting for it is a collective

    def take(self, run, step) -> Generated:
        def this_step():
            got, self.pending = self.pending, None
            return got or run.generate_rollout(step.number)

        got = run.driver.run(this_step)
        # the next step's rollout starts now, with the weights this step started from
        self.overlap = step.number < run.cfg.train.steps
        self.ahead = run.driver.start(partial(run.generate_rollout, step.number)) if self.overlap else None
        return got

    def _wait_ahead(self, run, step) -> None:
        t = time.time()
        with run.watchdog.phase("generate"):
            if self.overlap:
                run.driver.local(self._collect)
            self.overlap = False
        step.rollout_s += time.time() - t

    def _collect(self) -> None:
        ahead, self.ahead = self.ahead, None
        self.pending = ahead.result()

    settle = _wait_ahead

    def around_sync(self, run, step, push):
        self._wait_ahead(run, step)  # no request runs across the update
        return super().around_sync(run, step, push)

    def state(self) -> Optional[Generated]:
        return self.pending

    def restore(self, payload: Generated) -> None:
        self.pending = payload

    def write_state(self, payload: Generated, path: Path) -> None:
        torch.save(generated_to_state(payload), path)

    def read_state(self, path: Path) -> Generated:
        return _read(path, "the next step's rollout saved with this checkpoint",
                     lambda d: generated_from_state(d, str(path)))


class Partial(RolloutSource):
    """The driver's rollout buffer generates across steps; an update interrupts and resumes it."""

    state_key, state_file = "rollout_buffer", BUFFER_FILE

    def __init__(self):
        self.buffer: Optional[RolloutBuffer] = None  # on the driver, from start() to close()
        self.saved: Optional[Dict] = None  # on the driver: the buffer at the last update (or the resumed one)
        self.first: Dict[str, float] = {}  # the first step's counts (resumed_from_checkpoint)

    def start(self, run, version: int) -> None:
        def start():
            root = run.checkpoints.root
            self.buffer = RolloutBuffer(run.engine, run.producer, version, snapshot=self.saved,
                                        ledger=Path(root) / "rollout_ledger.jsonl" if root else None)
            self.buffer.start()
            self.first = {"resumed_from_checkpoint": float(self.buffer.resumed_from_checkpoint)}

        with run.watchdog.phase("generate"):
            run.driver.local(start)

    def take(self, run, step) -> Generated:
        def take():
            indices, groups, rewards, stats = self.buffer.take(step.number)
            stats = {**stats, **staleness_metrics(groups, step.number), **self.first}
            self.first = {}
            versions = [v for g in groups for s in g for v in (s.versions or ())]
            return run.producer.generated(run.engine, indices, groups, rewards, stats,
                                          min(versions) if versions else step.number)

        return run.driver.run(take)

    def around_sync(self, run, step, push):
        with run.watchdog.phase("sync"):
            run.driver.local(lambda: self.buffer.pause())
            seconds = push()
            counts = run.driver.run(lambda: self.buffer.resume(step.number + 1))
            self.saved = run.driver.local(lambda: self.buffer.snapshot())
        return seconds, counts

    def quiet(self, run, fn):
        return run.driver.run(lambda: self.buffer.paused(fn))

    def state(self) -> Optional[Dict]:
        return self.saved

    def restore(self, payload: Dict) -> None:
        self.saved = payload

    def write_state(self, payload: Dict, path: Path) -> None:
        write_buffer({k: v for k, v in payload.items() if k != STREAM_KEY}, path)  # (the stream: in the run state)

    def stream_state(self, stream: PromptStream) -> Dict:
        """The stream as it stood at the last update, with the buffer's snapshot (the feeder has
        drawn on since)."""
        return self.saved[STREAM_KEY] if self.saved and STREAM_KEY in self.saved else stream.state()

    def read_state(self, path: Path) -> Dict:
        return read_buffer(path)

    def close(self, run) -> None:
        buffer, self.buffer = self.buffer, None
        if buffer is not None:
            buffer.close()


def source_of(cfg) -> RolloutSource:
    """The schedule's source: partial rollout, one step off, or synchronous."""
    if cfg.rollout.partial_rollout:
        return Partial()
    return OneStepOff() if cfg.rollout.max_staleness else Synchronous()


# ---------------------------------------------------------------------- a rollout's saved state
def generated_to_state(g: Generated) -> Dict:
    """A step's rollout as a checkpoint keeps it: every sample through :func:`to_state`."""
    return {"prompts": g.prompts, "rewards": g.rewards, "stats": g.stats, "weights_version": g.weights_version,
            "groups": [[to_state(s) for s in grp] for grp in g.groups], "records": g.records}


def generated_from_state(d: Dict, where: str) -> Generated:
    """:func:`generated_to_state` read back. (Files written before the round trip held each sample
    as ``(token_ids, log_probs, finish_reason)`` and the rewards one tensor per group, and files
    written before the groups carried their records none: read too.)"""
    groups = [[from_state(Sample, s, where) if isinstance(s, dict) else Sample(list(s[0]), list(s[1]), s[2])
               for s in grp] for grp in d["groups"]]
    rewards = d["rewards"]
    if isinstance(rewards, list):
        rewards = torch.cat(rewards)
    return Generated(d["prompts"], groups, rewards, d["stats"], int(d["weights_version"]), d.get("records"))


def _read(path: Path, what: str, parse: Callable[[Dict], Any]):
    try:
        return parse(torch.load(path, weights_only=True))
    except Exception as exc:  # noqa: BLE001 -- any unreadable file: one line naming it
        raise ValueError(f"{path}: {what} cannot be read ({type(exc).__name__}: {exc}); resume from an earlier "
                         f"checkpoint") from None
