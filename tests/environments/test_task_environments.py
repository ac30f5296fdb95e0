"""The shipped task environments (#58 item 6), each a user's template: a Python session whose
variables live across one episode's calls (and not across episodes, and exactly after a checkpoint:
the state is the calls' code), code with the row's tests (the reward is the share that pass, run in
the bubblewrap sandbox), and a number-guessing game whose secret is the row's."""
import json

import pytest

from megatron_tepo.environments.choice import make_environment, make_sandbox
from megatron_tepo.environments.code_tests import CodeTests
from megatron_tepo.environments.guess_number import GuessNumber
from megatron_tepo.environments.python_session import PythonSession
from megatron_tepo.environments.settings import SandboxConfig

BASE = {"wall_seconds": 20.0, "cpu_seconds": 10}


def fenced(code):
    return f"```python\n{code}\n```"


@pytest.fixture
def sandbox(bwrap):
    sb = make_sandbox(SandboxConfig(**BASE))
    yield sb
    sb.close()


def test_a_python_sessions_variables_live_across_one_episodes_calls_only(sandbox):
    env = PythonSession(sandbox, max_cells=3)
    a, b = env.start({}, []), env.start({}, [])
    assert env.step(a, fenced("x = 6\nprint('set')"), 0).message.strip().startswith("set")
    reply = env.step(a, fenced("print(x * 7)"), 1)
    assert "42" in reply.message and "set" not in reply.message and reply.tool_errors == 0
    other = env.step(b, fenced("print(x)"), 0)  # another episode: no x
    assert "NameError" in other.message and other.tool_errors == 1
    # the state is plain values: a resumed episode (its state read back) has its variables
    resumed = json.loads(json.dumps(a))
    assert "42" in env.step(resumed, fenced("print(x * 7)"), 2).message
    assert "limit is reached (3 calls" in env.step(resumed, fenced("print(1)"), 3).message


def test_code_with_tests_rewards_the_share_that_pass_in_the_sandbox(sandbox):
    env = CodeTests(sandbox, attempts=2)
    row = {"tests": ["assert f(1) == 2", "assert f(-1) == 0", "assert f(0) == 5"]}
    state = env.start(row, [])
    first = env.step(state, "Here:\n" + fenced("def f(x):\n    return x + 1"), 0)
    assert not first.done and first.reward == pytest.approx(2 / 3) and "assert f(0) == 5" in first.message
    last = env.step(state, fenced("import os\ndef f(x):\n    return 5 if x == 0 else x + 1"), 1)
    assert last.done and last.episode_reward == 1.0
    with pytest.raises(ValueError, match="code_tests: the row's 'tests' must be a non-empty list"):
        env.start({"tests": "assert True"}, [])


def test_the_guessing_game_answers_higher_or_lower_and_gives_the_reward():
    env = make_environment("guess_number", SandboxConfig(kind="none"))
    assert isinstance(env, GuessNumber)
    state = env.start({"secret": "37"}, [])
    assert env.step(state, "50", 0).message == "lower" and env.step(state, "I say 20", 1).message == "higher"
    hit = env.step(state, "37", 2)
    assert hit.done and hit.episode_reward == 1.0 and env.finish(state) == 1.0
    miss = env.start({"answer": "3"}, [])
    assert env.step(miss, "no number", 0).episode_reward == 0.0 and env.finish(miss) == 0.0


def test_the_guessing_game_without_feedback_answers_every_wrong_guess_the_same():
    # environment.args.feedback=false: the benchmark's control (docs/BENCHMARKS.md, #58)
    env = make_environment("guess_number", SandboxConfig(kind="none"), args={"feedback": False, "neutral": "=="})
    state = env.start({"secret": 5}, [])
    assert [env.step(state, g, i).message for i, g in enumerate(["2", "7"])] == ["==", "=="]
    hit = env.step(state, "5", 2)
    assert hit.done and hit.episode_reward == 1.0 and state["guesses"] == [2, 7, 5]
    with pytest.raises(ValueError, match="environment.args.feedback must be true or false"):
        make_environment("guess_number", SandboxConfig(kind="none"), args={"feedback": "no"})
