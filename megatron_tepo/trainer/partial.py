"""Partial rollout with a staleness bound (``rollout.partial_rollout``): the driver's rollout buffer.

:class:`RolloutBuffer` keeps the engine generating while the actor trains, across steps:

* **Groups in flight.** Prompts are drawn one at a time from the run's prompt stream (the group
  producer's, :class:`~megatron_tepo.trainer.groups.GroupProducer`: a shuffled order read pass by
  pass); each drawn prompt is a *group* of ``n_samples`` requests
  (:class:`~megatron_tepo.rollout.engine.Request`, one sample each), submitted to the engine
  (:meth:`~megatron_tepo.rollout.engine.RolloutEngine.submit`). At most ``max_inflight_groups``
  groups are drawn and not yet handed to a step (generating, or complete and waiting); a feeder
  thread tops them up as groups leave and collects what the engine finished.
* **A group is complete when all its samples are**: it is then judged by the producer (the task's
  reward and, with DAPO's dynamic sampling, dropped when its rewards are all equal: a fresh prompt
  takes its place). :meth:`take` hands a step the ``want`` groups drawn first, in the order their
  prompts were drawn, once all of them are complete, or once ``(max_sampling_rounds - 1) x want`` groups
  (at least ``want``) were dropped since the last step (then the complete ones among them, as the
  synchronous loop trains on what its rounds kept). A group
  drawn later never overtakes an earlier one: taking whatever completes first would favour short
  responses (and, under the bound, starve the long ones). While a step waits for its groups no
  update happens, so they do not age; the engine meanwhile works on the groups drawn after them.
* **A weight update interrupts.** :meth:`pause` parks the feeder and interrupts the engine
  (:meth:`~megatron_tepo.rollout.engine.RolloutEngine.interrupt`): every request comes back with
  the tokens it generated, each with its log-prob and the version of the weights that produced it.
  The weights are written while nothing generates; :meth:`resume` then applies the staleness
  bound and submits every unfinished request again, as prompt + partial response, under the
  new weights.
* **The staleness bound.** Version ``v`` is the weights step ``v`` starts from. At the update to
  version ``V`` every sample in the buffer (partial or complete) whose oldest token is older than
  ``V - max_staleness`` is *regenerated*: its tokens are dropped and it starts again from its
  prompt under the new weights, so no token trained at step ``V`` or later is more than
  ``max_staleness`` versions old (counted: ``stale_regenerated``). Its group stays, so no prompt
  is lost and the group structure holds.
* **Exact resume.** :meth:`snapshot` is the buffer as :meth:`resume` left it (before anything was
  submitted again): every group not yet trained, with its samples' tokens, log-probs, versions
  and rewards, and the prompt stream's state then (:data:`STREAM_KEY`; a checkpoint keeps that in
  the run state, once). A checkpoint written at that step holds it; a run
  resumed from it continues the same groups (``resumed_from_checkpoint``: the partial responses
  it carried). The ledger (``rollout_ledger.jsonl`` beside the checkpoints) says, per step, which
  groups it trained on and which were dropped: every drawn prompt is trained once, dropped, or
  still in the buffer.

With an environment (multi-turn episodes: the engine is a
:class:`~megatron_tepo.rollout.episode.EpisodeEngine`) a request is a whole episode: the engine hands
it back when it ends, or at a clean point when interrupted (its turns, the environment's answers
and their loss mask kept: the snapshot holds them), and the reward reads its final turn.

Left out: routing replay (an interrupted request's routing is not returned; refused in the
config), colocated mode (the engine cannot generate while the actor holds the GPUs; refused),
priorities among groups beyond their drawing order.
"""
from __future__ import annotations

import json
import logging
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Dict, List, Optional, Tuple

import torch

from megatron_tepo.rollout.engine import (FINISH_ABORT, FINISH_LENGTH, FINISH_STOP, Request, RolloutEngine, Sample,
                                          from_state, to_state)
from megatron_tepo.trainer.groups import GroupProducer, add_counts

log = logging.getLogger(__name__)

__all__ = ["RolloutBuffer", "GroupState", "BUFFER_FILE", "STREAM_KEY", "staleness_metrics"]

BUFFER_FILE = "rollout_buffer.pt"
#: the snapshot's key of the prompt stream's state at the update (kept in the run state, not the file)
STREAM_KEY = "stream"


@dataclass
class GroupState:
    """One drawn prompt's group: its samples as requests, which have finished (and how)."""
    gid: int  # drawing order
    prompt_index: int
    requests: List[Request]
    finish: List[Optional[str]] = field(default_factory=list)  # per sample: None while generating
    rewards: Optional[torch.Tensor] = None  # once complete and scored
    counts: Dict = field(default_factory=dict)  # the reward's counts

    @property
    def complete(self) -> bool:
        return all(f is not None for f in self.finish)


class RolloutBuffer:
    """The driver's rollout across steps (see the module docstring): ``producer``'s groups generated
    by ``engine``. ``version``: the version of the weights the engine holds now; ``snapshot``: a
    :meth:`snapshot` to continue from."""

    def __init__(self, engine: RolloutEngine, producer: GroupProducer, version: int, snapshot: Optional[Dict] = None,
                 ledger: Optional[Path] = None):
        cfg = producer.cfg
        r = cfg.rollout
        if not engine.interruptible:
            raise ValueError(f"rollout.partial_rollout: the engine {type(engine).__name__} cannot interrupt and "
                             f"resume requests; set rollout.partial_rollout: false")
        self.engine, self.producer, self.task, self.cfg = engine, producer, producer.task, cfg
        self.stream = producer.stream
        self.n, self.want, self.bound = r.n_samples, r.prompts_per_step, r.max_staleness
        fitting = default_inflight_groups(r.max_staleness, r.prompts_per_step)
        self.max_groups = r.max_inflight_groups or fitting
        if self.max_groups > fitting:
            log.warning("partial rollout: rollout.max_inflight_groups %d is more than max_staleness x prompts_per_step "
                        "(%d): groups drawn more than %d step(s) ahead hold tokens too old to train on by then and "
                        "start again from their prompts (stale_regenerated)", self.max_groups, fitting,
                        max(1, r.max_staleness))
        self.params = producer.partial_params()
        self.version = version
        self.groups: Dict[int, GroupState] = {}
        self.next_gid = 0
        self.resumed_from_checkpoint = 0
        self.ledger = ledger
        self.dropped: List[List[int]] = []  # [gid, prompt index] dropped by dynamic sampling since the last take
        if snapshot is not None:
            self._load(snapshot)
        self._cv = threading.Condition()
        self._paused, self._parked, self._closing = True, False, False
        self._error: Optional[BaseException] = None
        self._stats = self._fresh_stats()
        self._inflight = 0
        self._idle_s, self._idle_since, self._window_start = 0.0, time.monotonic(), time.monotonic()
        self._tokens = 0
        self._snapshot: Optional[Dict] = None
        self._thread = threading.Thread(target=self._feed, name="mtepo-rollout-buffer", daemon=True)
        self._thread.start()

    # ------------------------------------------------------------------ the trainer's calls
    def start(self) -> Dict[str, float]:
        """Submit every unfinished request (a resumed buffer's included) and let the feeder run."""
        return self.resume(self.version)

    def take(self, step: int) -> Tuple[List[int], list, torch.Tensor, Dict[str, float]]:
        """Step ``step``'s groups: the ``want`` groups drawn first, once all are complete (fewer,
        the complete ones among them, when dynamic sampling ran out of rounds). Returns (their
        prompts' indices, samples per group, rewards as one tensor in group order, stats). With a
        ledger, one line says which groups (drawing order, prompt index) the step trains on and
        which dynamic sampling dropped since the last step."""
        # dynamic sampling's bound: a dropped group's place goes to the next one drawn, and after
        # (max_sampling_rounds - 1) x want drops (at least want) the step takes what is complete
        limit = max(self.cfg.rollout.max_sampling_rounds - 1, 1) * self.want
        with self._cv:
            self._cv.wait_for(lambda: self._error is not None or len(self._head()) == self.want
                              or self._stats["groups_dropped"] >= limit)
            self._raise()
            chosen = self._head()
            for g in chosen:
                del self.groups[g.gid]
            stats, self._stats = self._stats, self._fresh_stats()
            now = time.monotonic()
            window = max(now - self._window_start, 1e-9)
            idle = self._idle_s + (now - self._idle_since if self._idle_since is not None else 0.0)
            stats.update(engine_idle_fraction=min(idle / window, 1.0), generated_tokens_per_s=self._tokens / window)
            self._idle_s, self._tokens, self._window_start = 0.0, 0, now
            self._idle_since = now if self._idle_since is not None else None
            dropped, self.dropped = self.dropped, []
            self._cv.notify_all()  # room for more groups
        if self.ledger is not None:
            line = {"step": step, "version": self.version, "trained": [[g.gid, g.prompt_index] for g in chosen],
                    "dropped": dropped}
            self.ledger.parent.mkdir(parents=True, exist_ok=True)
            with open(self.ledger, "a") as f:
                f.write(json.dumps(line) + "\n")
        groups = [[r.to_sample(g.finish[k]) for k, r in enumerate(g.requests)] for g in chosen]
        rewards = torch.cat([g.rewards for g in chosen]) if chosen else torch.zeros(0)
        for g in chosen:
            add_counts(stats, g.counts)
        stats["sampling_rounds"] = 1.0
        if chosen:
            stats["reward_mean_all"] = float(rewards.mean())
        return [g.prompt_index for g in chosen], groups, rewards, stats

    def pause(self) -> None:
        """Park the feeder and interrupt the engine: when it returns nothing generates, and every
        request holds what it generated (its tokens, log-probs and versions)."""
        with self._cv:
            self._paused = True
            self._cv.notify_all()
            self._cv.wait_for(lambda: self._parked or self._closing)
        returned = self.engine.interrupt()
        with self._cv:
            for req, seg in returned:
                self._finished(req, seg)
            self._inflight = 0
            if self._idle_since is None:
                self._idle_since = time.monotonic()
        self._raise()

    def resume(self, version: int) -> Dict[str, float]:
        """The weights are version ``version`` now: apply the staleness bound, keep the snapshot
        a checkpoint of this step holds, submit every unfinished request again and let the feeder
        run. Returns the update's counts (``partial_resumed``, ``stale_regenerated``)."""
        with self._cv:
            self.version = version
            regenerated = 0
            oldest_allowed = version - self.bound
            for g in self.groups.values():
                for k, r in enumerate(g.requests):
                    if r.versions and min(r.versions) < oldest_allowed:
                        r.restart()
                        g.finish[k], g.rewards, g.counts = None, None, {}
                        regenerated += 1
            self._snapshot = self._state()
            todo = [r for g in self.groups.values() for k, r in enumerate(g.requests) if g.finish[k] is None]
            resumed = sum(1 for r in todo if r.token_ids)
            self._submit(todo)
            self._paused = False
            self._cv.notify_all()
        return {"partial_resumed": float(resumed), "stale_regenerated": float(regenerated)}

    def paused(self, fn):
        """``fn()`` with nothing generating (the held-out evaluation), then the buffer goes on
        under the same weights."""
        self.pause()
        try:
            return fn()
        finally:
            snapshot = self._snapshot
            self.resume(self.version)
            self._snapshot = snapshot  # (a checkpoint of this step keeps the update's)

    def snapshot(self) -> Optional[Dict]:
        """The buffer as the last :meth:`resume` left it (see the module docstring)."""
        return self._snapshot

    def close(self) -> None:
        """Stop the feeder and every request (the engine stays usable)."""
        if self._closing:
            return
        try:
            self.pause()
        except Exception as exc:  # noqa: BLE001 -- a failed run's close must not hide why it failed
            log.warning("partial rollout: stopping the buffer: %s", exc)
        finally:
            with self._cv:
                self._closing = True
                self._cv.notify_all()
            self._thread.join(timeout=60)

    # ------------------------------------------------------------------ the feeder thread
    def _feed(self) -> None:
        while True:
            with self._cv:
                while self._paused and not self._closing:
                    self._parked = True
                    self._cv.notify_all()
                    self._cv.wait()
                self._parked = False
                if self._closing:
                    return
                try:
                    self._top_up()
                except BaseException as exc:  # noqa: BLE001 -- raised in the trainer's next call
                    self._fail(exc)
                    continue
            try:
                finished = self.engine.collect(timeout=0.2)
            except BaseException as exc:  # noqa: BLE001
                with self._cv:
                    self._fail(exc)
                continue
            if finished:
                with self._cv:
                    try:
                        for req, seg in finished:
                            self._finished(req, seg)
                            self._inflight -= 1
                        if self._inflight == 0 and self._idle_since is None:
                            self._idle_since = time.monotonic()
                    except BaseException as exc:  # noqa: BLE001
                        self._fail(exc)
                    self._cv.notify_all()

    def _fail(self, exc: BaseException) -> None:
        self._error = exc
        self._paused = True
        self._cv.notify_all()

    def _raise(self) -> None:
        if self._error is not None:
            exc, self._error = self._error, None
            raise RuntimeError(f"partial rollout: {type(exc).__name__}: {exc}") from exc

    def _top_up(self) -> None:
        """Draw prompts until ``max_inflight_groups`` groups are held; submit their requests."""
        new = []
        while len(self.groups) < self.max_groups:
            g = self._draw()
            new += g.requests
        if new:
            self._submit(new)

    def _draw(self) -> GroupState:
        index = self.stream.next()
        prompt = list(self.task.train_prompts[index])
        row = self.task.record(index)  # (an episode engine opens each episode from its row)
        record = {"row": row} if row is not None and self.engine.takes_rows else {}
        g = GroupState(self.next_gid, index, [Request(prompt, self.params.max_new_tokens, key=(self.next_gid, k),
                                                      episode=dict(record))
                                              for k in range(self.n)], [None] * self.n)
        self.groups[g.gid] = g
        self.next_gid += 1
        return g

    def _submit(self, requests: List[Request]) -> None:
        if not requests:
            return
        self.engine.submit(requests, self.params)
        self._inflight += len(requests)
        if self._idle_since is not None:
            self._idle_s += time.monotonic() - self._idle_since
            self._idle_since = None

    def _finished(self, req: Request, seg: Sample) -> None:
        """A request came back (finished, or interrupted: ``FINISH_ABORT``)."""
        if seg.meta.get("error"):
            raise RuntimeError(f"the engine failed request {req.key}: {seg.meta['error']}")
        gid, k = req.key
        g = self.groups.get(gid)
        if g is None or g.requests[k] is not req:
            return  # a request of a group that left the buffer
        req.extend(seg, self.version)
        self._tokens += len(seg.token_ids)
        reason = seg.finish_reason
        if reason == FINISH_ABORT and req.token_ids and (req.loss_mask is None or req.loss_mask[-1]):
            # cut as it ended: its stop token or its last allowed token is in (an abort can answer
            # after the request's last decode step)
            if req.token_ids[-1] in self.params.stop_token_ids:
                reason = FINISH_STOP
            elif req.remaining <= 0:
                reason = FINISH_LENGTH
        if reason == FINISH_ABORT:
            if seg.token_ids or req.token_ids:
                req.interrupted += 1
            return
        g.finish[k] = reason
        if g.complete:
            self._score(g)

    def _score(self, g: GroupState) -> None:
        """A complete group, judged by the producer: its rewards; dropped when they are all equal
        (dynamic sampling) or when an episode of it ended on a sandbox failure (counted)."""
        g.rewards, counts, (keep,) = self.producer.judge([g.prompt_index], [[r.to_sample(FINISH_STOP)
                                                                              for r in g.requests]])
        failed = counts.pop("groups_sandbox_failed", 0)
        g.counts = counts
        if failed:
            self._stats["groups_sandbox_failed"] = self._stats.get("groups_sandbox_failed", 0) + failed
        self._stats["groups_generated"] += 1
        if not keep:
            self._stats["groups_dropped"] += 1
            self.dropped.append([g.gid, g.prompt_index])
            del self.groups[g.gid]

    def _head(self) -> List[GroupState]:
        """The complete groups among the ``want`` drawn first (those a step trains on: a group drawn
        later never overtakes an earlier one, so short responses are not favoured)."""
        first = sorted(self.groups.values(), key=lambda g: g.gid)[:self.want]
        return [g for g in first if g.complete and g.rewards is not None]

    @staticmethod
    def _fresh_stats() -> Dict[str, float]:
        return {"groups_generated": 0, "groups_dropped": 0}

    # ------------------------------------------------------------------ state
    def _state(self) -> Dict:
        return {"version": self.version, STREAM_KEY: self.stream.state(), "next_gid": self.next_gid,
                "dropped": [list(d) for d in self.dropped],
                "groups": [{"gid": g.gid, "prompt_index": g.prompt_index, "finish": list(g.finish),
                            "rewards": None if g.rewards is None else g.rewards.clone(), "counts": dict(g.counts),
                            "requests": [to_state(r) for r in g.requests]}
                           for g in sorted(self.groups.values(), key=lambda g: g.gid)]}

    def _load(self, snap: Dict) -> None:
        # the stream: the run state restored it; a snapshot held in memory carries it under STREAM_KEY,
        # and one written before the stream was the run's holds it at the top (rng, order, cursor)
        stream = snap.get(STREAM_KEY, snap if "rng" in snap else None)
        if stream is not None:
            self.stream.restore(stream)
        self.next_gid = int(snap["next_gid"])
        self.dropped = [list(d) for d in snap["dropped"]]
        self.groups = {}
        for d in snap["groups"]:
            reqs = [from_state(Request, r, "the rollout buffer's saved state") for r in d["requests"]]
            self.groups[d["gid"]] = GroupState(d["gid"], d["prompt_index"], reqs, list(d["finish"]), d["rewards"],
                                               dict(d["counts"]))
        self.resumed_from_checkpoint = sum(1 for g in self.groups.values() for k, r in enumerate(g.requests)
                                           if g.finish[k] is None and r.token_ids)


def default_inflight_groups(max_staleness: int, prompts_per_step: int) -> int:
    """``max(1, N) x prompts_per_step``: the most groups that can be in flight with none of them
    regenerated by the bound. A group drawn while step k trains (weights k) is trained at step
    k + G / prompts_per_step at the earliest (the steps take groups in the order they were drawn),
    when its first tokens are that many versions old; beyond N steps ahead it is regenerated."""
    return max(1, max_staleness) * prompts_per_step


def staleness_metrics(groups, step: int) -> Dict[str, float]:
    """The age, in weight versions, of the tokens a step trains on: token-weighted mean and max
    (``staleness_mean``, ``staleness_max``); samples without versions count as none."""
    ages = [step - v for g in groups for s in g for v in (s.versions or ())]
    if not ages:
        return {}
    return {"staleness_mean": sum(ages) / len(ages), "staleness_max": float(max(ages))}


def write_buffer(snapshot: Dict, path) -> None:
    torch.save(snapshot, path)


def read_buffer(path) -> Dict:
    try:
        return torch.load(path, weights_only=True)
    except Exception as exc:  # noqa: BLE001 -- any unreadable file: one line naming it
        raise ValueError(f"{path}: the rollout buffer saved with this checkpoint cannot be read "
                         f"({type(exc).__name__}: {exc}); resume from an earlier checkpoint") from None
