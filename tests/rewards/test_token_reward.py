"""The one reward on token ids (``token_reward``): what the trainer and ``evaluate`` both score with."""
import ast
from pathlib import Path

import pytest

from megatron_tepo.rewards import MathRewardPool, token_reward

PACKAGE = Path(__file__).resolve().parents[2] / "megatron_tepo"


class DigitTokenizer:
    """Token i is the digit i; 10 is a special token (end of sequence)."""

    def decode(self, ids, skip_special_tokens=False):
        return "".join("<eos>" if i == 10 else str(i) for i in ids if not (i == 10 and skip_special_tokens))


def test_exact_match_decodes_without_special_tokens():
    res = token_reward("exact_match", DigitTokenizer())([[4, 2, 10], [4, 3], [4, 2]], ["42", "42", " 42 "])
    assert res.rewards == [1.0, 0.0, 1.0] and (res.num_timeouts, res.num_errors, res.num_no_answer) == (0, 0, 0)


def test_math_verify_scores_in_the_pool_and_counts():
    with MathRewardPool(num_workers=1, timeout_s=20) as pool:
        res = token_reward("math_verify", DigitTokenizer(), pool)([[7, 10], [5]], ["7", "5"])
    assert res.rewards == [0.0, 0.0] and res.num_no_answer == 2  # digits alone have no \boxed{}


def test_math_verify_without_a_pool_and_unknown_kinds_are_errors():
    fn = token_reward("math_verify", DigitTokenizer(), None)  # a trainer rank that never scores
    with pytest.raises(RuntimeError, match="runs on the driver"):
        fn([[1]], ["1"])
    with pytest.raises(ValueError, match="reward kind 'exact'"):
        token_reward("exact", DigitTokenizer())


def test_responses_are_decoded_and_scored_in_one_place():
    """Neither the trainer nor ``evaluate`` decodes responses or scores texts itself."""
    for path in (PACKAGE / "trainer" / "main.py", PACKAGE / "commands" / "evaluate.py"):
        calls = [n.func for n in ast.walk(ast.parse(path.read_text())) if isinstance(n, ast.Call)]
        methods = {f.attr for f in calls if isinstance(f, ast.Attribute)}
        functions = {f.id for f in calls if isinstance(f, ast.Name)}
        assert not methods & {"decode", "score"} and "exact_match_rewards" not in functions, path
