"""Run a worker script under torchrun (gloo, one thread per process) and collect its results.

A worker writes its findings as JSON to the path in ``$MTEPO_RESULT_DIR/rank{R}.json`` (see
:func:`write_result`); the test then asserts on them. A non-zero exit of any rank fails the test
with the tail of every rank's output.
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from megatron_tepo.net import free_port

REPO = Path(__file__).resolve().parents[1]


def torchrun(script: str | os.PathLike, nproc: int, *args: str, timeout: float = 600,
             tmp_path: Path, env: dict | None = None) -> list[dict]:
    """Run ``script`` on ``nproc`` local ranks; return each rank's result dict (rank order)."""
    result_dir = Path(tmp_path) / "results"
    result_dir.mkdir(parents=True, exist_ok=True)
    full_env = dict(os.environ)
    full_env.update({
        "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1",
        "MTEPO_RESULT_DIR": str(result_dir),
        "PYTHONPATH": os.pathsep.join([str(REPO), full_env.get("PYTHONPATH", "")]),
        "CUDA_VISIBLE_DEVICES": "",
    })
    if env:
        full_env.update(env)
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={nproc}",
           "--master-addr=127.0.0.1", f"--master-port={free_port()}",
           "--log-dir", str(Path(tmp_path) / "logs"), "--tee", "3", str(script), *args]
    proc = subprocess.run(cmd, env=full_env, capture_output=True, text=True, timeout=timeout, cwd=REPO)
    if proc.returncode != 0:
        raise AssertionError(
            f"torchrun {Path(script).name} x{nproc} failed (rc={proc.returncode}):\n"
            f"--- stdout ---\n{proc.stdout[-6000:]}\n--- stderr ---\n{proc.stderr[-6000:]}")
    results = []
    for rank in range(nproc):
        path = result_dir / f"rank{rank}.json"
        results.append(json.loads(path.read_text()) if path.exists() else {})
    return results


def write_result(data: dict) -> None:
    """Called inside a worker: store this rank's findings for the test to read."""
    rank = int(os.environ.get("RANK", "0"))
    out = Path(os.environ["MTEPO_RESULT_DIR"]) / f"rank{rank}.json"
    tmp = out.with_suffix(".tmp")
    tmp.write_text(json.dumps(data))
    tmp.replace(out)


def kill_at_checkpoint(cmd: list, marker: Path, env: dict, wait_s: float) -> None:
    """Start ``cmd`` (a training run, in the repo's root) and SIGKILL it once ``marker`` (a
    checkpoint's completion marker) exists, or after ``wait_s``; fails if the run ended by itself
    first (it finished before it could be killed)."""
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, cwd=REPO)
    deadline = time.time() + wait_s
    while not marker.exists() and proc.poll() is None and time.time() < deadline:
        time.sleep(0.02)
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    assert proc.returncode == -signal.SIGKILL, "the run finished before it could be killed"
