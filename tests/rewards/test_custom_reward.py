"""A user's reward by import path (``reward.function``, #58 item 2): loaded from a file outside the
package, per sample or batched, run in the reward pool with its time-outs, errors and counts; it sees
the final turn's text and ids, the data row and the episode's record; a bad path or a missing function
is one line naming the field."""
import textwrap

import pytest

from megatron_tepo.config import ConfigError, from_dict
from megatron_tepo.environments.user_code import load_object
from megatron_tepo.rewards import MathRewardPool, call_reward
from megatron_tepo.rewards.custom import ImportedReward, function_reward
from tests.rewards.test_token_reward import DigitTokenizer

USER = textwrap.dedent('''
    import time

    def score(text, ids, row, episode):
        if text.startswith("9"):
            time.sleep(60)  # hangs: the pool's time-out
        if text.startswith("8"):
            raise RuntimeError("the user's bug")
        if text.startswith("7"):
            return 0.0, "no_answer"
        return float(text == str(row["secret"])) + 0.5 * episode.get("turns", 0)

    def batch(texts, ids, rows, episodes):
        return [float(len(i)) for i in ids]
    batch.batched = True

    def short(texts, ids, rows, episodes):
        return [1.0]
    short.batched = True

    NOT_CALLABLE = 3
''')


@pytest.fixture
def user_file(tmp_path, monkeypatch):
    path = tmp_path / "my_task" / "rewards.py"
    path.parent.mkdir()
    path.write_text(USER)
    monkeypatch.chdir(tmp_path)
    return "my_task/rewards.py"


def test_a_function_by_file_path_scores_in_the_pool_with_rows_episodes_time_outs_and_errors(user_file):
    with MathRewardPool(num_workers=1, timeout_s=3, reward_fn=ImportedReward(f"{user_file}:score")) as pool:
        fn = function_reward(f"{user_file}:score", DigitTokenizer(), pool)
        rows = [{"secret": 42}, {"secret": 5}, {"secret": 1}, {"secret": 1}, {"secret": 1}]
        res = call_reward(fn, [[4, 2, 10], [4], [9], [8], [7]], ["", "", "", "", ""], rows,
                          [{"turns": 2}, {}, {}, {}, {}])
    assert res.rewards == [2.0, 0.0, 0.0, 0.0, 0.0]
    assert (res.num_timeouts, res.num_errors, res.num_no_answer) == (1, 1, 1)


def test_a_batched_function_is_called_once_with_the_lists(user_file):
    with MathRewardPool(num_workers=1, timeout_s=20, reward_fn=ImportedReward(f"{user_file}:batch")) as pool:
        res = call_reward(function_reward(f"{user_file}:batch", DigitTokenizer(), pool), [[1, 2], [3]], ["", ""])
    assert res.rewards == [2.0, 1.0] and res.num_errors == 0
    with MathRewardPool(num_workers=1, timeout_s=20, reward_fn=ImportedReward(f"{user_file}:short")) as pool:
        res = call_reward(function_reward(f"{user_file}:short", DigitTokenizer(), pool), [[1, 2], [3]], ["", ""])
    assert res.rewards == [0.0, 0.0] and res.num_errors == 2  # a list of the wrong length: the function's error


@pytest.mark.parametrize("spec, message", [
    ("my_task/rewards.py:nope", "reward.function: 'my_task/rewards.py' has no 'nope'"),
    ("my_task/missing.py:score", "reward.function: my_task/missing.py: no such file"),
    ("no_such_pkg.mod:score", "reward.function: cannot import 'no_such_pkg.mod' (ModuleNotFoundError"),
    ("score", "reward.function: expected 'package.module:name' or 'path/to/file.py:name', got 'score'"),
    ("my_task/rewards.py:NOT_CALLABLE", "reward.function: 'my_task/rewards.py:NOT_CALLABLE' is not callable"),
])
def test_a_bad_path_or_a_missing_function_is_one_line_naming_the_field(user_file, spec, message):
    with pytest.raises(ConfigError) as err:
        from_dict({"reward": {"function": spec}})
    assert str(err.value).startswith(message) and "\n" not in str(err.value), str(err.value)


def test_a_module_beside_the_working_directory_is_found_and_the_shipped_kinds_keep_working(user_file, tmp_path):
    (tmp_path / "my_task" / "__init__.py").write_text("")
    assert callable(load_object("my_task.rewards:score", "reward.function"))
    assert from_dict({"reward": {"function": "my_task.rewards:score"}}).reward.function == "my_task.rewards:score"
    assert from_dict({"reward": {"kind": "exact_match"}}).reward.function == ""
