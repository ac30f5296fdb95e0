"""A run whose tool sandbox cannot start (bwrap missing here) is a user error found before anything
expensive: ``tools/train.py`` exits 2 with one line naming the setting, the exit-reason file that
slurm/lib.sh reads says no requeue, and the model is never loaded (the model folder here holds only a
config.json: a run that got as far as the tokenizer or the actor would fail on that instead)."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.second_lane  # (the first lane has no time to spare)


def test_train_without_bwrap_exits_2_without_requeue_before_the_model_loads(tmp_path):
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text("{}")  # no weights, no tokenizer: loading either would fail
    reason = tmp_path / "exit_reason.json"
    cmd = [sys.executable, str(REPO / "tools/train.py"), "--config", str(REPO / "examples/tiny_tir/config.yaml"),
           f"model.path={model}", f"data.train_files=[{tmp_path / 'train.jsonl'}]", f"train.output_dir={tmp_path / 'run'}",
           f"environment.sandbox.bwrap={tmp_path / 'no' / 'bwrap'}"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=REPO,
                          env={**os.environ, "OMP_NUM_THREADS": "1", "TEPO_EXIT_REASON_FILE": str(reason)})
    err = proc.stderr.strip().splitlines()
    assert proc.returncode == 2 and len(err) == 1, proc.stdout[-2000:] + proc.stderr[-4000:]
    assert "error: environment.sandbox.bwrap:" in err[0] and "not found" in err[0], err
    assert "Traceback" not in proc.stderr and "[train] world" not in proc.stdout
    written = json.loads(reason.read_text())
    assert written["reason"] == "user_error" and written["requeue"] is False


def test_the_tool_example_stops_in_one_line_before_its_warm_up(tmp_path):
    """README's tool example (examples/tiny_tepo/run.py --task tir) on a machine without bwrap: one
    line and exit 2 before the warm-up (minutes), nothing written."""
    out = tmp_path / "run"
    cmd = [sys.executable, str(REPO / "examples/tiny_tepo/run.py"), "--task", "tir", "--config",
           str(REPO / "examples/tiny_tir/config.yaml"), f"train.output_dir={out}",
           f"environment.sandbox.bwrap={tmp_path / 'no' / 'bwrap'}"]
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120, cwd=tmp_path,
                              env={**os.environ, "OMP_NUM_THREADS": "1"})
    except subprocess.TimeoutExpired as exc:  # (the warm-up ran: what this test guards against)
        raise AssertionError(f"still running after 120 s: the warm-up started ({exc.stdout!r})") from None
    err = proc.stderr.strip().splitlines()
    assert proc.returncode == 2 and len(err) == 1 and "environment.sandbox.bwrap:" in err[0], proc.stderr[-3000:]
    assert proc.stdout == "" and not out.exists()
