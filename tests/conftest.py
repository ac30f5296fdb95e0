"""Shared pytest set-up: one thread per process (the 2 CI cores are shared), markers, fixtures."""
import os
import subprocess
import sys
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("MKL_NUM_THREADS", "1")

import pytest
import torch

from tests import process_leaks

torch.set_num_threads(1)


def pytest_configure(config):
    for name, text in [
        ("distributed", "runs under torchrun with gloo (2-4 processes, one thread each)"),
        ("sglang", "talks to a real SGLang server on CPU"),
        ("slurm", "submits jobs to a real one-node Slurm cluster"),
        ("slow", "takes more than ~30 s"),
        ("journey", "a user's whole command line (tools/train.py and the CLI, in subprocesses); tools/test.sh runs "
                    "these beside the rest, with the sglang and slurm tests"),
        ("second_lane", "runs in tools/test.sh's second lane, beside the sglang tests (that lane has time "
                        "to spare; the first has none): where it runs, never whether"),
    ]:
        config.addinivalue_line("markers", f"{name}: {text}")


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(1234)
    yield


@pytest.fixture(autouse=True)
def _leaves_no_process_group(request):
    """A test that leaves a process group, megatron's parallel state or rendezvous variables behind
    in pytest's own process fails here, naming itself and what it left; they are undone, so the
    tests after it run as if it had cleaned up (tests/process_leaks.py)."""
    before = process_leaks.snapshot()
    yield
    left = process_leaks.leaks(before)
    if left:
        process_leaks.undo(before)
        pytest.fail(f"{request.node.nodeid} left behind in pytest's own process: {'; '.join(left)} -- undo them "
                    f"in the test (a later test would see them)", pytrace=False)


@pytest.fixture(scope="session")
def tiny(tmp_path_factory):
    """The tiny task as files (tools/make_tiny_model.py): a warmed-up tiny Qwen3 with a tokenizer,
    400 training and 40 held-out addition prompts; built once per session (trainer and fleet tests)."""
    out = tmp_path_factory.mktemp("tiny")
    repo = Path(__file__).resolve().parents[1]
    subprocess.run([sys.executable, str(repo / "tools/make_tiny_model.py"), "--out", str(out), "--train-size", "400",
                    "--eval-size", "40"], check=True, capture_output=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
    return out
