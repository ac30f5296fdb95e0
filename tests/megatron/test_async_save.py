"""Asynchronous checkpoint saves (issue #32 row 8): ``kill -9`` while one is in flight resumes from the
previous complete checkpoint. (That the step goes on while the files are written, and that an
asynchronous save resumes bit for bit at TP=2 in bf16: ``test_actor_checkpoint.py``; that a run
with asynchronous saves gives the metrics of one with synchronous saves:
``tests/trainer/test_async_save_run.py``.)"""
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
WORKER = Path(__file__).parent / "workers" / "async_kill_worker.py"


def _run(mode, root):
    """The worker in a session of its own, its output in a file: a process killed with SIGKILL leaves
    the helper processes it spawned (dist_checkpointing's) behind with its pipes open, so they are
    killed with its process group afterwards, as a Slurm step's end would."""
    env = dict(os.environ, OMP_NUM_THREADS="1",  # (CUDA as the machine has it: the GPU check runs this too)
               PYTHONPATH=os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]))
    log = root / f"{mode}.log"
    with open(log, "w") as out:
        proc = subprocess.Popen([sys.executable, str(WORKER), mode, str(root)], env=env, cwd=REPO, stdout=out,
                                stderr=subprocess.STDOUT, start_new_session=True)
        try:
            rc = proc.wait(timeout=300)
        finally:
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
    return rc, log.read_text()


@pytest.mark.timeout(330)
def test_kill_during_an_async_write_resumes_from_the_previous_complete_checkpoint(tmp_path):
    rc, log = _run("run", tmp_path)
    assert rc == -signal.SIGKILL, log[-3000:]
    rc, log = _run("resume", tmp_path)
    assert rc == 0, log[-3000:]
    r = json.loads((tmp_path / "resumed.json").read_text())
    assert "step_2" not in r["listing"]  # never published
    assert any(name.startswith("step_2.tmp-") for name in r["listing"]), r["listing"]  # its write had begun
    assert r["path"] == "step_1" and r["extra"] == {"step": 1}
    assert r["params_equal"]
