"""Verifiable rewards: boxed-answer extraction and math-verify equivalence (``reward.kind:
math_verify``), and exact match of the whole response (``reward.kind: exact_match``)."""
from typing import List, Sequence

from .math import MathRewardPool, RewardBatchResult, extract_boxed, math_verify_reward

__all__ = ["MathRewardPool", "RewardBatchResult", "extract_boxed", "math_verify_reward", "exact_match_rewards"]


def exact_match_rewards(texts: Sequence[str], answers: Sequence[str]) -> List[float]:
    """1 where the response text, stripped, equals the answer (``reward.kind: exact_match``)."""
    return [1.0 if t.strip() == str(a).strip() else 0.0 for t, a in zip(texts, answers)]
