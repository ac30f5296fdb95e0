"""Math rewards: the last ``\\boxed{...}`` of a response checked against the reference answer
with ``math-verify``, in a pool of worker processes with a per-answer time-out.

Why processes: math-verify bounds its own parsing/verification with ``signal.alarm``, which only
works in a process's main thread; a pool worker runs each task in its main thread. Why an outer
time-out too: a pathological expression can still hang sympy beyond the alarm; then the whole
pool is terminated and rebuilt, and the answer scores 0. A time-out, a parser error or a crash of
the checker is reward 0 and is counted -- never an exception out of :meth:`MathRewardPool.score`.

Left out: partial credit, format rewards, answers outside ``\\boxed`` (a response without one
scores 0 and is counted as ``no_answer``), and code execution.
"""
from __future__ import annotations

import multiprocessing as mp
from dataclasses import dataclass, field
from typing import Callable, List, Optional, Sequence, Tuple

__all__ = ["extract_boxed", "math_verify_reward", "MathRewardPool", "RewardBatchResult"]

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


@dataclass
class RewardBatchResult:
    rewards: List[float]
    num_timeouts: int = 0
    num_errors: int = 0
    num_no_answer: int = 0
    statuses: List[str] = field(default_factory=list)


class MathRewardPool:
    """Score (response, answer) pairs in ``num_workers`` processes, ``timeout_s`` per answer.

    Args:
        num_workers: processes (>= 1).
        timeout_s: wall-clock bound for one answer, counted from when the pool gets to it.
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
        self._pool = None

    def _ensure_pool(self):
        if self._pool is None:
            self._pool = self._ctx.Pool(self.num_workers)
        return self._pool

    def _restart(self) -> None:
        if self._pool is not None:
            self._pool.terminate()
            self._pool.join()
            self._pool = None

    def score(self, responses: Sequence[str], answers: Sequence[str]) -> RewardBatchResult:
        if len(responses) != len(answers):
            raise ValueError(f"responses ({len(responses)}) and answers ({len(answers)}) differ in length")
        result = RewardBatchResult(rewards=[0.0] * len(responses), statuses=["pending"] * len(responses))
        pending = list(range(len(responses)))
        while pending:
            pool = self._ensure_pool()
            handles = [(i, pool.apply_async(self.reward_fn, (responses[i], answers[i]))) for i in pending]
            pending = []
            for pos, (i, handle) in enumerate(handles):
                try:
                    reward, status = handle.get(timeout=self.timeout_s)
                except mp.TimeoutError:
                    # This answer is stuck in a worker: score it 0, rebuild the pool, and resubmit
                    # the answers not finished yet (they did not get their fair time).
                    result.statuses[i] = "timeout"
                    unfinished = [j for j, h in handles[pos + 1:] if not h.ready()]
                    for j, h in handles[pos + 1:]:
                        if h.ready():
                            self._record(result, j, h)
                    self._restart()
                    pending = unfinished
                    break
                except Exception:  # noqa: BLE001 - the checker raised inside the worker
                    reward, status = 0.0, "error"
                result.rewards[i], result.statuses[i] = float(reward), status
        result.num_timeouts = result.statuses.count("timeout")
        result.num_errors = result.statuses.count("error")
        result.num_no_answer = result.statuses.count("no_answer")
        return result

    @staticmethod
    def _record(result: RewardBatchResult, i: int, handle) -> None:
        try:
            reward, status = handle.get(timeout=0)
        except Exception:  # noqa: BLE001
            reward, status = 0.0, "error"
        result.rewards[i], result.statuses[i] = float(reward), status

    def close(self) -> None:
        if self._pool is not None:
            self._pool.close()
            self._pool.join()
            self._pool = None

    def __enter__(self) -> "MathRewardPool":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
