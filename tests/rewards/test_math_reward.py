"""Math rewards: boxed extraction, math-verify equivalence in processes, time-outs counted."""
import time

import pytest

from megatron_tepo.rewards import MathRewardPool, extract_boxed, math_verify_reward
from tests.rewards.slow_fns import raising, sleepy, slow_start


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


def _burn(seconds: float):
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        pass


@pytest.mark.slow
def test_mixed_batch_on_a_loaded_machine_loses_no_good_answer():
    """27 answers, 6 of them hanging, a 3 s time-out, 2 workers that each pay a 3.5 s start
    (math-verify's import and set-up) -- also every replacement of a hung worker --, while two other processes keep both cores busy: the clock of an answer
    starts when a worker starts it and only the hung answer's worker is replaced, so every good
    answer is scored and exactly the 6 hung ones time out."""
    import multiprocessing as mp

    responses = [("hang" if i % 9 in (2, 5) else str(i)) for i in range(27)]
    answers = [str(i) for i in range(27)]
    burners = [mp.get_context("spawn").Process(target=_burn, args=(120,), daemon=True) for _ in range(2)]
    for b in burners:
        b.start()
    try:
        with MathRewardPool(num_workers=2, timeout_s=3.0, reward_fn=slow_start) as pool:
            res = pool.score(responses, answers)
    finally:
        for b in burners:
            b.kill()
    hung = [i for i, r in enumerate(responses) if r == "hang"]
    assert len(hung) == 6 and res.num_timeouts == 6
    assert [i for i, s in enumerate(res.statuses) if s == "timeout"] == hung
    assert all(res.rewards[i] == 1.0 and res.statuses[i] == "ok" for i in range(27) if i not in hung)


KILLED_OWNER = """
import sys, time
sys.path.insert(0, {repo!r})
from megatron_tepo.rewards import MathRewardPool
from tests.rewards.slow_fns import sleepy
pool = MathRewardPool(num_workers=2, timeout_s=30, reward_fn=sleepy)
pool.score(["1", "2"], ["1", "2"])
print(" ".join(map(str, pool.worker_pids())), flush=True)
pool.score(["hang", "hang"], ["1", "2"])  # busy when it is killed
"""


def _descendants(pid: int) -> set:
    import os

    children: dict = {}
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                ppid = int(open(f"/proc/{d}/stat").read().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(ppid, []).append(int(d))
    out, todo = set(), [pid]
    while todo:
        for c in children.get(todo.pop(), []):
            out.add(c)
            todo.append(c)
    return out


def _alive(pid: int) -> bool:
    try:
        state = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def test_workers_die_with_a_killed_owner(tmp_path):
    """``kill -9`` of the process that owns the pool (the trainer) leaves no worker and no
    multiprocessing resource tracker behind."""
    import signal
    import subprocess
    import sys
    from pathlib import Path

    repo = str(Path(__file__).resolve().parents[2])
    owner = subprocess.Popen([sys.executable, "-c", KILLED_OWNER.format(repo=repo)], stdout=subprocess.PIPE,
                             text=True, env={"OMP_NUM_THREADS": "1", "PATH": "/usr/bin:/bin"})
    workers = {int(p) for p in owner.stdout.readline().split()}
    time.sleep(0.5)
    family = _descendants(owner.pid)
    assert len(workers) == 2 and workers <= family and len(family) >= 3  # + the resource tracker
    owner.send_signal(signal.SIGKILL)
    owner.wait()
    deadline = time.monotonic() + 30
    while any(_alive(p) for p in family) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not [p for p in family if _alive(p)]
