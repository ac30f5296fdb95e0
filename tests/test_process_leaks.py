"""The suite's guard against state left in pytest's own process (tests/process_leaks.py, used by
tests/conftest.py): a test that leaves a gloo group, megatron's parallel state or rendezvous
variables behind fails, naming itself, and the tests after it see none of it."""
import os
import subprocess
import sys
from pathlib import Path

import torch.distributed as dist

from megatron_tepo.net import single_process_env
from tests import process_leaks

REPO = Path(__file__).resolve().parents[1]


def test_a_group_and_rendezvous_variables_left_behind_are_found_and_undone():
    before = process_leaks.snapshot()
    single_process_env()
    dist.init_process_group("gloo")
    try:
        left = process_leaks.leaks(before)
        assert left[0] == "a torch.distributed process group", left
        assert "rendezvous variables" in left[-1] and "MASTER_PORT=" in left[-1], left
    finally:
        process_leaks.undo(before)
    assert process_leaks.leaks(before) == [] and not dist.is_initialized()
    assert process_leaks.snapshot() == before


LEAKING = '''
import os
import torch.distributed as dist
from megatron_tepo.net import single_process_env

def test_leaks_a_gloo_group():
    single_process_env()
    dist.init_process_group("gloo")

def test_after_it_sees_nothing():
    assert not dist.is_initialized() and "MASTER_PORT" not in os.environ
'''


def test_the_test_that_leaks_fails_naming_itself_and_the_next_one_passes(tmp_path):
    (tmp_path / "test_leaky.py").write_text(LEAKING)
    env = {k: v for k, v in os.environ.items() if k not in process_leaks.RENDEZVOUS}
    done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "tests.conftest", "-p", "no:cacheprovider",
                           "--rootdir", str(tmp_path), str(tmp_path / "test_leaky.py")],
                          cwd=REPO, env={**env, "OMP_NUM_THREADS": "1"}, capture_output=True, text=True, timeout=300)
    out = done.stdout + done.stderr
    assert done.returncode == 1, out
    assert "2 passed, 1 error" in out, out  # (the leaking test itself passes, then errors at teardown)
    assert "test_leaky.py::test_leaks_a_gloo_group left behind in pytest's own process: " \
           "a torch.distributed process group; rendezvous variables" in out, out
