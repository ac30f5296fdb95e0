"""Shared pytest set-up: one thread per process (the 2 CI cores are shared), markers, fixtures."""
import os

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("MKL_NUM_THREADS", "1")

import pytest
import torch

torch.set_num_threads(1)


def pytest_configure(config):
    for name, text in [
        ("distributed", "runs under torchrun with gloo (2-4 processes, one thread each)"),
        ("sglang", "talks to a real SGLang server on CPU"),
        ("slurm", "submits jobs to a real one-node Slurm cluster"),
        ("slow", "takes more than ~30 s"),
    ]:
        config.addinivalue_line("markers", f"{name}: {text}")


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(1234)
    yield
