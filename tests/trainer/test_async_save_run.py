"""A run with asynchronous checkpoint saves (``train.async_save``, the default) gives the metrics of the
same run with synchronous saves, step for step, and leaves the same complete checkpoints (issue #32
row 8): the saves capture the state at their step, whatever the steps after them change while the
files are written."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
VOLATILE = {"time", "step_s", "sync_s", "rollout_s", "train_s"}


def _run(out, async_save, port):
    cmd = [sys.executable, str(REPO / "examples/tiny_tepo/run.py"), "train.steps=6", "train.save_every=2",
           "train.keep_checkpoints=2", f"train.async_save={str(async_save).lower()}", f"train.output_dir={out}",
           "--eval-size", "10"]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": "", "MASTER_PORT": str(port)}
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600, cwd=REPO)
    assert done.returncode == 0, done.stderr[-3000:]
    metrics = [{k: v for k, v in json.loads(line).items() if k not in VOLATILE}
               for line in (out / "metrics.jsonl").read_text().splitlines()]
    ckpts = out / "checkpoints"
    listing = sorted(p.name for p in ckpts.iterdir())
    extra = {name: json.loads((ckpts / name / "extra_state.json").read_text()) for name in listing}
    return metrics, listing, extra


@pytest.mark.slow
def test_async_saves_give_the_metrics_of_synchronous_saves(tmp_path):
    port = 24000 + os.getpid() % 5000
    sync = _run(tmp_path / "sync", False, port)
    asyn = _run(tmp_path / "async", True, port + 1)
    assert [m["step"] for m in asyn[0]] == list(range(1, 7))
    assert asyn[0] == sync[0]  # every metric of every step, bit for bit
    assert asyn[1] == sync[1] == ["step_4", "step_6"]  # complete, no temporary directory left
    assert asyn[2] == sync[2]  # the loop's state saved with each
