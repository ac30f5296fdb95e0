"""Who does what when the trainer runs on several processes (torchrun: a TP / PP / DP actor).

Global rank 0 is the *driver* (:class:`Driver`): it alone holds the rollout engine, generates,
scores, evaluates and logs, and what it computes reaches the other ranks as pickled objects over
a gloo group of its own (the actor's collectives keep theirs). Every other rank holds a
:class:`FollowerEngine` in place of the engine: it takes part in the weight sync, whose export is
collective, and refuses to generate. In a one-process run everything is local.

Left out: more than one driver (the engine's requests are not spread over ranks), and a driver
that fails over to another rank.
"""
from __future__ import annotations

import queue
import threading
from concurrent.futures import Future
from datetime import timedelta
from typing import Callable, Dict, Optional

import torch

from megatron_tepo.algorithms.drift import DriftCheck
from megatron_tepo.rollout.engine import RolloutEngine, gathered_tensors

try:
    import torch.distributed as dist
except ImportError:  # pragma: no cover
    dist = None

__all__ = ["Driver", "FollowerEngine"]


class Driver:
    """Global rank 0 drives the loop: it alone generates, scores, evaluates and logs; what it
    computes reaches the other ranks as pickled objects over a gloo group of its own (the actor's
    collectives keep theirs). In a one-process run everything is local."""

    def __init__(self, timeout_s: Optional[float] = None):
        on = dist is not None and dist.is_available() and dist.is_initialized()
        self.world = dist.get_world_size() if on else 1
        self.rank = dist.get_rank() if on else 0
        # timeout_s: the followers wait in its broadcast through a whole rollout (see FaultConfig.process_group_timeout_s)
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

    def barrier(self) -> None:
        """Every rank waits here for every other (over the driver's gloo group; nothing in one process)."""
        if self.world > 1:
            dist.barrier(group=self._group)

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


class FollowerEngine(RolloutEngine):
    """What a rank other than the driver holds in place of the rollout engine: it takes part in
    the weight sync (the export is collective; with a fleet, ``weight_sync`` is a
    :class:`~megatron_tepo.rollout.sglang.weight_sync.WeightSync` with ``is_sender=False``, so its export
    calls match the sender's) and refuses to generate. The rest of the engine contract keeps its
    defaults (no metrics, no sampling RNG, not interruptible)."""

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
