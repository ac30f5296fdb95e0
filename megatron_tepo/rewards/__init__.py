"""Verifiable rewards for math: boxed-answer extraction and math-verify equivalence."""
from .math import MathRewardPool, RewardBatchResult, extract_boxed, math_verify_reward

__all__ = ["MathRewardPool", "RewardBatchResult", "extract_boxed", "math_verify_reward"]
