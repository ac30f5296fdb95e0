"""The tiny task as files (tools/make_tiny_model.py): a warmed-up tiny Qwen3 with a tokenizer,
400 training and 40 held-out addition prompts; built once per session for the trainer tests."""
import os
import subprocess
import sys

import pytest

from tests.dist_utils import REPO


@pytest.fixture(scope="session")
def tiny(tmp_path_factory):
    out = tmp_path_factory.mktemp("tiny")
    subprocess.run([sys.executable, str(REPO / "tools/make_tiny_model.py"), "--out", str(out), "--train-size", "400",
                    "--eval-size", "40"], check=True, capture_output=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
    return out
