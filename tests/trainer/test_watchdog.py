"""The hang watchdog (megatron_tepo/trainer/watchdog.py): its phase/deadline state with an injected
clock, then a real expiry in a subprocess (the one line, every thread's stack, the exit status,
the exit-reason file)."""
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from megatron_tepo.config import FaultConfig, from_dict
from megatron_tepo.trainer.watchdog import (WATCHDOG_EXIT, Watchdog, exit_reason_path, stacks_path,
                                            write_exit_reason)

REPO = Path(__file__).resolve().parents[2]


class Clock:
    def __init__(self):
        self.t = 1000.0

    def __call__(self):
        return self.t


def _dog(**timeouts):
    clock = Clock()
    return Watchdog({"generate": 100.0, "collective": 10.0, "sync": 0.0, **timeouts}, rank=2, clock=clock,
                    start=False), clock


def test_outside_every_phase_nothing_is_overdue():
    dog, clock = _dog()
    clock.t += 1e6
    assert dog.current is None and dog.overdue() is None


def test_a_phase_is_overdue_after_its_timeout_and_a_beat_restarts_it():
    dog, clock = _dog()
    with dog.phase("collective"):
        clock.t += 9.0
        assert dog.overdue() is None
        dog.beat()
        clock.t += 9.0
        assert dog.overdue() is None  # 18 s in the phase, but 9 s since the beat
        clock.t += 1.0
        assert dog.overdue() == ("collective", 10.0)
    assert dog.overdue() is None  # left the phase: nothing watched


def test_nested_phases_rearm_the_enclosing_one_and_zero_is_off():
    dog, clock = _dog()
    with dog.phase("generate"):
        clock.t += 50.0
        with dog.phase("collective"):
            assert dog.current == "collective"
            clock.t += 10.0
            assert dog.overdue() == ("collective", 10.0)
        assert dog.current == "generate"
        clock.t += 99.0
        assert dog.overdue() is None  # a fresh generate deadline since the inner phase ended
        with dog.phase("sync"):  # 0: not watched
            clock.t += 1e6
            assert dog.overdue() is None
        clock.t += 100.0
        assert dog.overdue() == ("generate", 100.0)


def test_the_message_names_phase_seconds_setting_and_rank():
    dog, _ = _dog()
    assert dog.message("collective", 1800.0) == (
        "watchdog: no progress in phase 'collective' for 1800 s (fault.watchdog_collective_s) on rank 2")


def test_bad_settings_are_one_line_naming_the_field():
    with pytest.raises(ValueError, match=r"fault\.watchdog_sync_s: expected seconds >= 0"):
        Watchdog({"sync": -1.0}, start=False)
    with pytest.raises(ValueError, match="unknown phase"):
        Watchdog({"train": 1.0}, start=False)
    dog, _ = _dog()
    with pytest.raises(ValueError, match="unknown phase 'update'"), dog.phase("update"):
        pass


def test_from_config_reads_the_fault_section():
    cfg = from_dict({"fault": {"watchdog_generate_s": 5, "watchdog_collective_s": 0, "watchdog_sync_s": 7}})
    dog = Watchdog.from_config(cfg.fault, start=False)
    assert dog.timeouts == {"generate": 5.0, "collective": 0.0, "sync": 7.0}
    defaults = FaultConfig()  # sized for a 14B step: hours of generation, half an hour per collective
    assert defaults.watchdog_generate_s >= 3600 and defaults.watchdog_collective_s >= 600


def test_exit_reason_file_is_rank_suffixed(tmp_path, monkeypatch):
    monkeypatch.delenv("TEPO_EXIT_REASON_FILE", raising=False)
    assert write_exit_reason("watchdog", True, "x") is None
    monkeypatch.setenv("TEPO_EXIT_REASON_FILE", str(tmp_path / "reason.json"))
    assert exit_reason_path(0) == str(tmp_path / "reason.json")
    assert write_exit_reason("no_update", False, "why", rank=3) == str(tmp_path / "reason.json.rank3")
    assert json.loads((tmp_path / "reason.json.rank3").read_text()) == {
        "reason": "no_update", "requeue": False, "message": "why", "rank": 3}


HUNG = textwrap.dedent("""
    import subprocess, sys, threading, time
    from megatron_tepo.trainer.watchdog import Watchdog

    # a child that would outlive an os._exit (as megatron's checkpoint manager does)
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(3600)"])
    print("child", child.pid, flush=True)

    def deep_inside_a_collective():
        time.sleep(3600)

    threading.Thread(target=time.sleep, args=(3600,), name="helper", daemon=True).start()
    dog = Watchdog({"collective": 0.5}, rank=1)
    with dog.phase("collective"):
        dog.beat()
        deep_inside_a_collective()
    print("NOT REACHED")
""")


@pytest.mark.timeout(300)
def test_a_real_expiry_dumps_every_stack_writes_the_reason_and_exits(tmp_path):
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1", "RANK": "1",
           "TEPO_EXIT_REASON_FILE": str(tmp_path / "reason.json")}
    proc = subprocess.run([sys.executable, "-c", HUNG], check=False, env=env, capture_output=True, text=True,
                          timeout=240)
    assert proc.returncode == WATCHDOG_EXIT, (proc.returncode, proc.stderr[-3000:])
    assert "NOT REACHED" not in proc.stdout
    lines = proc.stderr.splitlines()
    stacks = tmp_path / "stacks.rank1.txt"  # this rank's own copy (the shared log may interleave ranks)
    assert [line for line in lines if line.startswith("watchdog:")] == [
        ("watchdog: no progress in phase 'collective' for 0.5 s (fault.watchdog_collective_s) on rank 1; "
         f"the Python stacks of this process (pid {_pid(proc.stderr)}) follow (and are in {stacks})")]
    # faulthandler's dump: the hung main thread in its function, and the other threads too
    for text in (proc.stderr, stacks.read_text()):
        assert "in deep_inside_a_collective" in text
        assert sum(line.startswith(("Thread 0x", "Current thread 0x")) for line in text.splitlines()) >= 3, text
    assert stacks.read_text().startswith("watchdog: no progress in phase 'collective'")
    child = int(proc.stdout.split("child ", 1)[1].split()[0])
    assert not _alive(child), "the watchdog left its child process running"
    reason = json.loads((tmp_path / "reason.json.rank1").read_text())
    assert reason["reason"] == "watchdog" and reason["requeue"] is True and "'collective'" in reason["message"]


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().split(")")[-1].split()[0]
    except OSError:
        return False
    return state not in ("Z", "X")  # (a zombie waits for init to reap it: dead)


def _pid(stderr: str) -> str:
    return stderr.split("(pid ", 1)[1].split(")", 1)[0]


SIGTERMED = textwrap.dedent("""
    import os, signal, time
    from megatron_tepo.trainer.watchdog import Watchdog

    def blocked_behind_another_rank():
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(60)

    dog = Watchdog({"collective": 600}, rank=0)
    with dog.phase("collective"):
        blocked_behind_another_rank()
""")


@pytest.mark.timeout(300)
@pytest.mark.parametrize("reason_file", [False, True], ids=["stderr", "stacks_file"])
def test_sigterm_while_watched_dumps_the_stacks_then_terminates(tmp_path, reason_file):
    # what torchrun sends the other ranks once one failed: their stacks are kept too, in this rank's
    # stacks file when the job names an exit-reason file (slurm/lib.sh does), else on stderr
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1", "RANK": "0"}
    env.pop("TEPO_EXIT_REASON_FILE", None)
    if reason_file:
        env["TEPO_EXIT_REASON_FILE"] = str(tmp_path / "reason.json")
    proc = subprocess.run([sys.executable, "-c", SIGTERMED], check=False, env=env, capture_output=True, text=True,
                          timeout=240)
    assert proc.returncode == -15, (proc.returncode, proc.stderr[-3000:])
    stacks = tmp_path / "stacks.rank0.txt"
    dumped = stacks.read_text() if reason_file else proc.stderr
    assert "in blocked_behind_another_rank" in dumped, (proc.stderr[-3000:], dumped)
    assert stacks.exists() == reason_file


def test_a_watchdog_that_never_fired_leaves_no_stacks_file(tmp_path, monkeypatch):
    monkeypatch.setenv("TEPO_EXIT_REASON_FILE", str(tmp_path / "reason.json"))
    dog = Watchdog({"collective": 600.0}, rank=2)
    assert stacks_path(2) == str(tmp_path / "stacks.rank2.txt") and (tmp_path / "stacks.rank2.txt").exists()
    with dog.phase("collective"):
        dog.beat()
    dog.close()
    assert list(tmp_path.iterdir()) == []


IN_THE_LOOP = textwrap.dedent("""
    from megatron_tepo.config import from_dict
    from megatron_tepo.trainer.loop import train
    from tests.trainer.test_no_update_stop import EchoEngine, NanActor, _task

    cfg = from_dict({"rollout": {"prompts_per_step": 2, "n_samples": 2, "max_sampling_rounds": 1},
                     "algorithm": {"old_log_prob": "rollout"},
                     "train": {"steps": 5, "mini_batch_prompts": 2, "epochs_per_step": 1},
                     "fault": {"inject_hang_at_step": 2, "watchdog_collective_s": 1.0}})
    train(cfg, NanActor(finite=range(1, 100)), EchoEngine(), _task(lambda r: float(r[1] == 0)),
          on_step=lambda s, m: print("step", s, "updates", m["updates"], flush=True))
""")


@pytest.mark.timeout(300)
def test_the_injected_hang_in_the_loop_is_caught_in_the_collective_phase():
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, "-c", IN_THE_LOOP], check=False, env=env, capture_output=True, text=True,
                          timeout=240, cwd=REPO)
    assert proc.returncode == WATCHDOG_EXIT, (proc.returncode, proc.stdout[-2000:], proc.stderr[-3000:])
    assert proc.stdout.splitlines()[0] == "step 1 updates 1.0" and "step 2" not in proc.stdout
    assert "fault.inject_hang_at_step=2: global rank 0 hangs now (test only)" in proc.stdout
    assert "watchdog: no progress in phase 'collective' for 1 s (fault.watchdog_collective_s) on rank 0" in proc.stderr
    assert 'in _hang' in proc.stderr and 'in train' in proc.stderr  # the stack of the hung main thread


GIL_HELD = textwrap.dedent("""
    import re
    from megatron_tepo.trainer.watchdog import Watchdog

    def a_c_call_that_holds_the_gil():
        re.match(r"(a+)+$", "a" * 64 + "b")  # catastrophic backtracking inside C: no bytecode runs

    dog = Watchdog({"collective": 0.5}, rank=0, grace_s=1.0)
    with dog.phase("collective"):
        a_c_call_that_holds_the_gil()
    print("NOT REACHED")
""")


@pytest.mark.timeout(300)
def test_the_faulthandler_backstop_fires_when_the_gil_is_held(tmp_path):
    # the checking thread cannot run; faulthandler's C thread dumps the stacks and exits with 1
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1",
           "TEPO_EXIT_REASON_FILE": str(tmp_path / "reason.json")}
    proc = subprocess.run([sys.executable, "-c", GIL_HELD], check=False, env=env, capture_output=True, text=True,
                          timeout=240)
    assert proc.returncode == 1, (proc.returncode, proc.stderr[-3000:])
    dumped = (tmp_path / "stacks.rank0.txt").read_text()  # (the job's per-rank stacks file)
    assert "Timeout (0:00:01.500000)!" in dumped and "in a_c_call_that_holds_the_gil" in dumped
    assert "watchdog:" not in proc.stderr and not (tmp_path / "reason.json").exists()  # (a crash: requeued)
