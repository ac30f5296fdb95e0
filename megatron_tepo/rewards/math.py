"""Math rewards: the last ``\\boxed{...}`` of a response checked against the reference answer
with ``math-verify``, in a pool of worker processes with a per-answer time-out.

Why processes: math-verify bounds its own parsing/verification with ``signal.alarm``, which only
works in a process's main thread; a pool worker runs each task in its main thread. Why an outer
time-out too: a pathological expression can still hang sympy beyond the alarm; then that worker
alone is killed and replaced, and the answer scores 0 (see :class:`MathRewardPool`). A time-out,
a parser error or a crash of the checker is reward 0 and is counted -- never an exception out of
:meth:`MathRewardPool.score`.

Left out: partial credit, format rewards, answers outside ``\\boxed`` (a response without one
scores 0 and is counted as ``no_answer``), and code execution.
"""
from __future__ import annotations

import multiprocessing as mp
import os
import time
from dataclasses import dataclass, field
from typing import Callable, Dict, List, Optional, Sequence, Tuple

from megatron_tepo.children import die_with_parent

__all__ = ["extract_boxed", "math_verify_reward", "MathRewardPool", "RewardBatchResult", "COUNT_NAMES"]

_BOXED = ("\\boxed", "\\fbox")


def extract_boxed(text: str) -> Optional[str]:
    """Content of the LAST ``\\boxed{...}`` (or ``\\fbox{...}``) with balanced braces, else None.

    ``\\boxed 5`` (no braces, as some models write) gives ``"5"``.
    """
    start = max(text.rfind(tag) for tag in _BOXED)
    if start < 0:
        return None
    i = start + (len("\\boxed") if text.startswith("\\boxed", start) else len("\\fbox"))
    while i < len(text) and text[i] == " ":
        i += 1
    if i >= len(text):
        return None
    if text[i] != "{":
        j = i
        while j < len(text) and not text[j].isspace() and text[j] not in "$,":
            j += 1
        return text[i:j] or None
    depth = 0
    for j in range(i, len(text)):
        if text[j] == "{":
            depth += 1
        elif text[j] == "}":
            depth -= 1
            if depth == 0:
                return text[i + 1:j]
    return None  # unbalanced: no answer


def math_verify_reward(response: str, answer: str) -> Tuple[float, str]:
    """``(reward, status)`` with status ``ok`` / ``no_answer`` / ``error``; runs in a worker."""
    boxed = extract_boxed(response)
    if boxed is None:
        return 0.0, "no_answer"
    try:
        from math_verify import parse, verify

        gold = parse(f"\\boxed{{{answer}}}" if "\\boxed" not in answer else answer)
        pred = parse(f"\\boxed{{{boxed}}}")
        if not gold:
            return 0.0, "error"
        return (1.0 if verify(gold, pred) else 0.0), "ok"
    except Exception:  # noqa: BLE001 - a checker failure is reward 0, counted by the caller
        return 0.0, "error"


#: What a :class:`RewardBatchResult` counts, by the names of the trainer's metrics.
COUNT_NAMES = ("reward_timeouts", "reward_errors", "reward_no_answer")


@dataclass
class RewardBatchResult:
    rewards: List[float]
    num_timeouts: int = 0
    num_errors: int = 0
    num_no_answer: int = 0
    statuses: List[str] = field(default_factory=list)

    def counts(self) -> Dict[str, int]:
        """Time-outs, checker errors and responses without an answer, named as in :data:`COUNT_NAMES`."""
        return dict(zip(COUNT_NAMES, (self.num_timeouts, self.num_errors, self.num_no_answer)))


def _warm_up_math_verify() -> None:
    from math_verify import parse

    parse("\\boxed{1}")  # the parser builds its grammar on first use


math_verify_reward.warm_up = _warm_up_math_verify


def _worker(conn, reward_fn, parent_pid: int) -> None:
    """One scoring process: it warms up first (``reward_fn.warm_up``: imports, parser set-up),
    then for each ``(i, response, answer)`` says when it starts (its own clock: the time-out
    counts from here) and sends the result."""
    die_with_parent(parent_pid)
    warm_up = getattr(reward_fn, "warm_up", None)
    if warm_up is not None:
        try:
            warm_up()
        except Exception:  # noqa: BLE001 -- a broken checker shows as errors on the answers
            pass
    while True:
        try:
            task = conn.recv()
        except EOFError:
            return
        if task is None:
            return
        i, response, answer = task
        conn.send(("start", i, time.monotonic()))
        try:
            reward, status = reward_fn(response, answer)
            # (a batched user function gives a list: rewards/custom.py)
            out = ("done", i, [float(r) for r in reward] if isinstance(reward, list) else float(reward), str(status))
        except Exception:  # noqa: BLE001 -- a checker failure is reward 0, counted
            out = ("done", i, 0.0, "error")
        conn.send(out)


class _Worker:
    def __init__(self, ctx, reward_fn):
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=_worker, args=(child, reward_fn, os.getpid()), daemon=True)
        self.proc.start()
        child.close()
        self.task: Optional[int] = None  # index being scored
        self.started: Optional[float] = None  # when the worker started it (its monotonic clock)

    def kill(self) -> None:
        if self.proc.is_alive():
            self.proc.kill()
        self.proc.join(timeout=5)
        self.conn.close()


class MathRewardPool:
    """Score (response, answer) pairs in ``num_workers`` processes, ``timeout_s`` per answer.

    Each worker warms up (``reward_fn.warm_up``, e.g. math-verify's import and parser set-up),
    then scores one answer at a time and reports when it starts it; an answer that runs past
    ``timeout_s`` from that moment is reward 0 (``timeout``), and only its worker is killed and
    replaced -- no other answer is cut short, and neither a worker's start nor the time an answer
    waits for a free worker counts against it. Workers die with
    the process that owns the pool, ``kill -9`` included (Linux).

    Args:
        num_workers: processes (>= 1).
        timeout_s: wall-clock bound for one answer, counted from when a worker starts it.
        reward_fn: a picklable top-level ``fn(response, answer) -> (reward, status)``; the default
            is :func:`math_verify_reward` (tests pass a slow one to exercise the time-out).
    """

    def __init__(self, num_workers: int = 2, timeout_s: float = 5.0,
                 reward_fn: Callable[[str, str], Tuple[float, str]] = math_verify_reward):
        if num_workers < 1:
            raise ValueError(f"num_workers must be >= 1, got {num_workers}")
        if not timeout_s > 0:
            raise ValueError(f"timeout_s must be > 0, got {timeout_s}")
        self.num_workers, self.timeout_s, self.reward_fn = num_workers, float(timeout_s), reward_fn
        self._ctx = mp.get_context("spawn")  # no fork of a process holding torch threads / sockets
        self._workers: List[_Worker] = []

    def _ensure_workers(self) -> List[_Worker]:
        self._workers = [w for w in self._workers if w.proc.is_alive()]
        while len(self._workers) < self.num_workers:
            self._workers.append(_Worker(self._ctx, self.reward_fn))
        return self._workers

    def worker_pids(self) -> List[int]:
        return [w.proc.pid for w in self._workers if w.proc.is_alive()]

    def score(self, responses: Sequence[str], answers: Sequence[str]) -> RewardBatchResult:
        from multiprocessing.connection import wait

        if len(responses) != len(answers):
            raise ValueError(f"responses ({len(responses)}) and answers ({len(answers)}) differ in length")
        result = RewardBatchResult(rewards=[0.0] * len(responses), statuses=["pending"] * len(responses))
        todo = list(range(len(responses)))
        todo.reverse()
        busy = 0
        while todo or busy:
            for w in self._ensure_workers():
                if w.task is None and todo:
                    w.task, w.started = todo.pop(), None
                    w.conn.send((w.task, responses[w.task], answers[w.task]))
                    busy += 1
            running = [w for w in self._workers if w.task is not None]
            now = time.monotonic()
            waits = [w.started + self.timeout_s - now for w in running if w.started is not None]
            ready = wait([w.conn for w in running], timeout=max(0.0, min(waits)) if waits else 1.0)
            for w in running:
                if w.conn in ready:
                    try:
                        msg = w.conn.recv()
                    except (EOFError, OSError):  # the worker died (not by us): its answer is an error
                        result.statuses[w.task] = "error"
                        w.task = None
                        busy -= 1
                        w.kill()
                        continue
                    if msg[0] == "start":
                        w.started = msg[2]
                    else:
                        _, i, reward, status = msg
                        result.rewards[i], result.statuses[i] = reward, status
                        w.task = None
                        busy -= 1
                elif w.started is not None and time.monotonic() - w.started > self.timeout_s:
                    result.statuses[w.task] = "timeout"  # reward stays 0; only this worker goes
                    w.task = None
                    busy -= 1
                    w.kill()
        result.num_timeouts = result.statuses.count("timeout")
        result.num_errors = result.statuses.count("error")
        result.num_no_answer = result.statuses.count("no_answer")
        return result

    def close(self) -> None:
        for w in self._workers:
            try:
                w.conn.send(None)
            except (OSError, BrokenPipeError):
                pass
        for w in self._workers:
            w.proc.join(timeout=5)
            w.kill()
        self._workers = []

    def __enter__(self) -> "MathRewardPool":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
