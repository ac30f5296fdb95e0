"""Asynchronous checkpoint saves (issue #32 row 8): ``kill -9`` while one is in flight resumes from the
previous complete checkpoint, and leaves no process of the killed trainer running. (That the step goes on while the files are written, and that an
asynchronous save resumes bit for bit at TP=2 in bf16: ``test_actor_checkpoint.py``; that a run
with asynchronous saves gives the metrics of one with synchronous saves:
``tests/trainer/test_async_save_run.py``.)"""
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.megatron.helpers import ASYNC_WRITERS, async_writer_missing, writer_env

REPO = Path(__file__).resolve().parents[2]
WORKER = Path(__file__).parent / "workers" / "async_kill_worker.py"


def _session(sid):
    """The processes of session ``sid`` still running (zombies excepted)."""
    alive = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if fields[0] != "Z" and int(fields[3]) == sid:  # (state, ppid, pgrp, session)
            alive.append(int(stat.parent.name))
    return alive


def _run(mode, root, writer):
    """The worker in a session of its own, its output in a file. After a SIGKILL the processes it
    started must end by themselves (dist_checkpointing's forked writer once its files are written,
    the results queue's server with the worker, ``megatron_tepo/children.py``): what is still running
    a minute later is returned, then killed with the session, as a Slurm step's end would."""
    env = dict(os.environ, OMP_NUM_THREADS="1", **writer_env(writer))  # (CUDA as the machine has it: the GPU check runs this too)
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), env.get("PYTHONPATH", "")])
    log = root / f"{mode}.log"
    left = []
    with open(log, "w") as out:
        proc = subprocess.Popen([sys.executable, str(WORKER), mode, str(root)], env=env, cwd=REPO, stdout=out,
                                stderr=subprocess.STDOUT, start_new_session=True)
        try:
            rc = proc.wait(timeout=300)
            deadline = time.monotonic() + 60
            while _session(proc.pid) and time.monotonic() < deadline:
                time.sleep(0.2)
            left = [" ".join(Path(f"/proc/{p}/cmdline").read_text().split("\0"))[:200] for p in _session(proc.pid)]
        finally:
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
    return rc, log.read_text(), left


@pytest.mark.timeout(330)
@pytest.mark.parametrize("writer", ASYNC_WRITERS)
def test_kill_during_an_async_write_resumes_from_the_previous_complete_checkpoint(tmp_path, writer):
    """On both writers: megatron-core's (a forked writer per save) and NVRx's (one persistent writer
    process, where nvidia-resiliency-ext is installed)."""
    if async_writer_missing(writer):
        pytest.skip(async_writer_missing(writer))
    rc, log, left = _run("run", tmp_path, writer)
    assert rc == -signal.SIGKILL, log[-3000:]
    assert f"asynchronous checkpoint saves: {'NVRx' if writer == 'nvrx' else 'megatron-core'}" in log, log[-3000:]
    assert left == [], left  # nothing of the killed trainer runs on: no writer, no results-queue server
    rc, log, left = _run("resume", tmp_path, writer)
    assert rc == 0 and left == [], (left, log[-3000:])
    r = json.loads((tmp_path / "resumed.json").read_text())
    assert "step_2" not in r["listing"]  # never published
    assert any(name.startswith("step_2.tmp-") for name in r["listing"]), r["listing"]  # its write had begun
    assert r["path"] == "step_1" and r["extra"] == {"step": 1}
    assert r["params_equal"]
