"""Resume: a run killed with SIGKILL after a checkpoint and started again produces the same
metrics as an uninterrupted run; partial checkpoint directories are ignored."""
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
VOLATILE = {"time", "step_s", "sync_s"}


def _cmd(out):
    return [sys.executable, str(REPO / "examples/tiny_tepo/run.py"), "train.steps=24", "train.save_every=4",
            "train.eval_every=6", f"train.output_dir={out}", "--eval-size", "20"]


def _env(port):
    return {**os.environ, "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": "", "MASTER_PORT": str(port)}


def _metrics(out):
    return [{k: v for k, v in json.loads(line).items() if k not in VOLATILE}
            for line in (out / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.slow
def test_sigkill_then_resume_matches_uninterrupted(tmp_path):
    ref, run = tmp_path / "ref", tmp_path / "run"
    port = 23000 + os.getpid() % 5000
    done = subprocess.run(_cmd(ref), env=_env(port), capture_output=True, text=True, timeout=600, cwd=REPO)
    assert done.returncode == 0, done.stderr[-3000:]

    proc = subprocess.Popen(_cmd(run), env=_env(port + 1), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                            text=True, cwd=REPO)
    marker = run / "checkpoints" / "step_8" / "complete"
    deadline = time.time() + 300
    while not marker.exists() and proc.poll() is None and time.time() < deadline:
        time.sleep(0.02)
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    assert proc.returncode == -signal.SIGKILL, "the run finished before it could be killed"
    # A crash during a later write: a checkpoint directory without its marker, and a tmp dir.
    (run / "checkpoints" / "step_99").mkdir(parents=True)
    (run / "checkpoints" / "step_98.tmp-1234").mkdir()
    resumed = subprocess.run(_cmd(run), env=_env(port + 2), capture_output=True, text=True, timeout=600, cwd=REPO)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "resuming from" in resumed.stdout and "step_99" not in resumed.stdout

    got, want = _metrics(run), _metrics(ref)
    assert [m["step"] for m in got] == list(range(1, 25))
    assert got == want  # every metric of every step, bit for bit
    assert json.loads((run / "summary.json").read_text())["accuracy_after"] == \
        json.loads((ref / "summary.json").read_text())["accuracy_after"]
