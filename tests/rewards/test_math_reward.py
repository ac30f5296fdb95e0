"""Math rewards: boxed extraction, math-verify equivalence in processes, time-outs counted."""
import time

import pytest

from megatron_tepo.rewards import MathRewardPool, extract_boxed, math_verify_reward
from tests.rewards.slow_fns import raising, sleepy


@pytest.mark.parametrize("text, expected", [
    ("so the answer is \\boxed{42}.", "42"),
    ("\\boxed{1} then \\boxed{\\frac{1}{2}}", "\\frac{1}{2}"),  # the last one counts
    ("nested \\boxed{\\sqrt{x^{2}}}", "\\sqrt{x^{2}}"),
    ("\\fbox{7}", "7"),
    ("\\boxed 5 apples", "5"),
    ("no box here", None),
    ("broken \\boxed{1 + {2}", None),
])
def test_extract_boxed(text, expected):
    assert extract_boxed(text) == expected


@pytest.mark.parametrize("response, answer, reward", [
    ("\\boxed{0.5}", "\\frac{1}{2}", 1.0),
    ("\\boxed{\\frac{2}{4}}", "1/2", 1.0),
    ("\\boxed{3}", "4", 0.0),
    ("x = \\boxed{2\\sqrt{2}}", "\\sqrt{8}", 1.0),
])
def test_math_verify_equivalence(response, answer, reward):
    assert math_verify_reward(response, answer)[0] == reward


def test_pool_scores_and_counts():
    with MathRewardPool(num_workers=2, timeout_s=20) as pool:
        res = pool.score(["\\boxed{0.5}", "no answer", "\\boxed{5}", "\\boxed{10}"],
                         ["1/2", "3", "5", "11"])
    assert res.rewards == [1.0, 0.0, 1.0, 0.0]
    assert (res.num_no_answer, res.num_timeouts, res.num_errors) == (1, 0, 0)


def test_timeout_is_reward_zero_and_counted_and_others_still_scored():
    pool = MathRewardPool(num_workers=2, timeout_s=1.5, reward_fn=sleepy)
    t0 = time.time()
    res = pool.score(["a", "hang1", "b", "c", "hang2", "d"], ["a", "x", "b", "z", "x", "d"])
    elapsed = time.time() - t0
    pool.close()
    assert res.rewards == [1.0, 0.0, 1.0, 0.0, 0.0, 1.0]
    assert res.num_timeouts == 2 and res.statuses[1] == res.statuses[4] == "timeout"
    assert elapsed < 30  # bounded by the time-outs, not by the 60 s hang


def test_checker_crash_is_reward_zero_and_counted():
    with MathRewardPool(num_workers=1, timeout_s=20, reward_fn=raising) as pool:
        res = pool.score(["\\boxed{1}"], ["1"])
    assert res.rewards == [0.0] and res.num_errors == 1


def test_bad_arguments():
    with pytest.raises(ValueError, match="num_workers"):
        MathRewardPool(num_workers=0)
    with pytest.raises(ValueError, match="timeout_s"):
        MathRewardPool(timeout_s=0)
    with MathRewardPool(num_workers=1) as pool, pytest.raises(ValueError, match="differ in length"):
        pool.score(["a"], [])
