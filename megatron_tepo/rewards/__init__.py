"""Verifiable rewards: boxed-answer extraction and math-verify equivalence (``reward.kind:
math_verify``), exact match of the whole response (``reward.kind: exact_match``), and a user's
function by import path (``reward.function``: :mod:`.custom`, which sees the data row and the
episode's record too).

:func:`token_reward` is the one reward on token ids, used by the trainer and by ``evaluate``: each
response decoded with the tokenizer, then scored by kind."""
from typing import Callable, Dict, List, Optional, Sequence, Tuple, Union

from .math import COUNT_NAMES, MathRewardPool, RewardBatchResult, extract_boxed, math_verify_reward

__all__ = ["MathRewardPool", "RewardBatchResult", "extract_boxed", "math_verify_reward", "exact_match_rewards",
           "token_reward", "REWARD_KINDS", "COUNT_NAMES", "RewardFn", "scores_and_counts", "call_reward"]

#: A reward on token ids: ``fn(response token ids per sample, answer per sample)`` -> one reward
#: per sample, as a list, or as a :class:`RewardBatchResult` whose counts then join the metrics.
RewardFn = Callable[[List[List[int]], List[str]], Union[Sequence[float], RewardBatchResult]]

REWARD_KINDS = ("math_verify", "exact_match")


def exact_match_rewards(texts: Sequence[str], answers: Sequence[str]) -> List[float]:
    """1 where the response text, stripped, equals the answer (``reward.kind: exact_match``)."""
    return [1.0 if t.strip() == str(a).strip() else 0.0 for t, a in zip(texts, answers)]


def token_reward(kind: str, tokenizer, pool: Optional[MathRewardPool] = None
                 ) -> Callable[[Sequence[Sequence[int]], Sequence[str]], RewardBatchResult]:
    """``fn(response token ids per sample, answer per sample) -> RewardBatchResult``: each response
    decoded with ``tokenizer`` (special tokens dropped), then ``exact_match`` (:func:`exact_match_rewards`)
    or ``math_verify`` in ``pool`` (:meth:`MathRewardPool.score`: time-outs, errors and responses
    without an answer are counted in the result). ``math_verify`` without a pool is an error when
    called (a trainer rank other than the driver holds none: it never scores)."""
    if kind not in REWARD_KINDS:
        raise ValueError(f"reward kind {kind!r}: expected one of {', '.join(REWARD_KINDS)}")

    def score(responses: Sequence[Sequence[int]], answers: Sequence[str]) -> RewardBatchResult:
        texts = [tokenizer.decode(r, skip_special_tokens=True) for r in responses]
        if kind == "exact_match":
            return RewardBatchResult(exact_match_rewards(texts, answers))
        if pool is None:
            raise RuntimeError("reward: math-verify scoring runs on the driver (global rank 0) only")
        return pool.score(texts, answers)

    return score


def scores_and_counts(result: Union[Sequence[float], RewardBatchResult]) -> Tuple[List[float], Dict[str, int]]:
    """A :data:`RewardFn`'s result as (rewards, counts): a :class:`RewardBatchResult`'s counts
    (:data:`COUNT_NAMES`), none for a plain list."""
    if isinstance(result, RewardBatchResult):
        return list(result.rewards), result.counts()
    return [float(r) for r in result], {}


def call_reward(fn: RewardFn, responses, answers, rows=None, episodes=None):
    """``fn(responses, answers)``, with the data rows and the episodes' records too where ``fn``
    takes them (``fn.takes_rows``: a ``reward.function``'s, :func:`.custom.function_reward`)."""
    if getattr(fn, "takes_rows", False):
        return fn(responses, answers, rows=rows, episodes=episodes)
    return fn(responses, answers)
