"""A user's reward, given by import path (``reward.function``), run in the reward pool.

``reward.function: my_pkg.my_module:score`` (a module importable from the working directory or
``PYTHONPATH``) or ``path/to/file.py:score`` (a file, relative to the working directory). The
function, per sample::

    def score(text: str, ids: list[int], row: dict, episode: dict) -> float | tuple[float, str]

``text``: the final turn's text (special tokens dropped), ``ids`` its token ids; ``row``: the data
row the prompt came from, every field (``answer`` the reference answer as a string:
:attr:`megatron_tepo.data.prompts.PromptRecord.row`); ``episode``: the episode's record (turns,
tool calls, the environment's state ...: ``Sample.meta["episode"]``, ``{}`` for one turn). It
returns the reward, or ``(reward, status)`` with status ``ok`` / ``no_answer`` / ``error`` (counted
as the math reward counts them: :data:`~megatron_tepo.rewards.math.COUNT_NAMES`).

A function marked ``score.batched = True`` is called once per batch with lists
(``score(texts, ids, rows, episodes) -> list of rewards``); its time-out then bounds the whole call.

It runs in :class:`~megatron_tepo.rewards.math.MathRewardPool`'s processes (``reward.workers``,
``reward.timeout_s``): a time-out or an exception is reward 0 and counted, never the run's failure.
A bad path or a missing function is one line naming ``reward.function``
(:func:`megatron_tepo.environments.user_code.load_object`, the one loader of user code).

Left out: reward models served over HTTP (a user's function may call one), async functions.
"""
from __future__ import annotations

import os
import sys
from typing import Callable, List, Optional, Sequence

from megatron_tepo.environments.user_code import load_object
from .math import MathRewardPool, RewardBatchResult

__all__ = ["load_object", "ImportedReward", "function_reward"]

STATUSES = ("ok", "no_answer", "error")


class ImportedReward:
    """The pool's reward function for ``spec`` (picklable: the spawned worker imports it itself,
    at its warm-up). Called with ``((text, ids, row, episode), _)`` per sample, or, batched, with
    the lists; returns ``(reward, status)`` (batched: ``(rewards, status)``)."""

    def __init__(self, spec: str):
        self.spec, self._fn = spec, None
        self.path = os.getcwd()

    def __getstate__(self):
        return {"spec": self.spec, "path": self.path, "_fn": None}

    def fn(self) -> Callable:
        if self._fn is None:
            if self.path not in sys.path:
                sys.path.append(self.path)
            fn = load_object(self.spec, "reward.function")
            if not callable(fn):
                raise ValueError(f"reward.function: {self.spec!r} is not callable")
            self._fn = fn
        return self._fn

    @property
    def batched(self) -> bool:
        return bool(getattr(self.fn(), "batched", False))

    def warm_up(self) -> None:
        self.fn()

    def __call__(self, payload, _answer=None):
        out = self.fn()(*payload)
        if self.batched:
            return [float(r) for r in out], "ok"
        if isinstance(out, tuple):
            reward, status = out
            return float(reward), (status if status in STATUSES else "ok")
        return float(out), "ok"


def function_reward(spec: str, tokenizer, pool: Optional[MathRewardPool]):
    """``fn(response ids per sample, answers, rows=None, episodes=None) -> RewardBatchResult``: the
    user's function ``spec`` in ``pool`` (whose ``reward_fn`` is an :class:`ImportedReward` of it)."""
    imported = ImportedReward(spec)
    batched = imported.batched  # (imports it here too: a broken function fails at the start, named)

    def score(responses: Sequence[Sequence[int]], answers: Sequence[str], rows: Optional[List[dict]] = None,
              episodes: Optional[List[dict]] = None) -> RewardBatchResult:
        n = len(responses)
        rows = list(rows) if rows is not None else [{"answer": a} for a in answers]
        episodes = list(episodes) if episodes is not None else [{} for _ in range(n)]
        texts = [tokenizer.decode(list(r), skip_special_tokens=True) for r in responses]
        ids = [list(r) for r in responses]
        if pool is None:
            raise RuntimeError("reward: reward.function scores on the driver (global rank 0) only")
        if not batched:
            return pool.score(list(zip(texts, ids, rows, episodes)), list(answers))
        got = pool.score([(texts, ids, rows, episodes)], [""])
        status = got.statuses[0]
        rewards = got.rewards[0] if status == "ok" and isinstance(got.rewards[0], list) else None
        if rewards is None or len(rewards) != n:
            status = status if status != "ok" else "error"  # (a list of the wrong length: the function's error)
            rewards = [0.0] * n
        return RewardBatchResult(rewards, num_timeouts=n * (status == "timeout"), num_errors=n * (status == "error"),
                                 statuses=[status] * n)

    score.takes_rows = True
    return score
