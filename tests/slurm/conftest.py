"""The `slurm` tests need a reachable Slurm cluster: SLURM_CONF (tools/test.sh starts the one-node
cluster of tools/slurm_cluster.sh and exports it) with `sinfo` answering and a node up. Missing ->
the tests FAIL with how to start one; MTEPO_SKIP_SLURM=1 skips them instead (explicit opt-out)."""
import os
import shutil
import subprocess
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
TERMINAL = ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "OUT_OF_MEMORY", "NODE_FAIL", "PREEMPTED",
            "BOOT_FAIL", "DEADLINE")
HOW = ("start one with `bash tools/slurm_cluster.sh start` and `export SLURM_CONF=...` (the line it prints); "
       "set MTEPO_SKIP_SLURM=1 to skip the slurm tests instead")


def _cluster_problem() -> str:
    if not shutil.which("sbatch") or not shutil.which("sacct"):
        return "the Slurm client commands (sbatch, sacct) are not installed"
    conf = os.environ.get("SLURM_CONF")
    if not conf:
        return "SLURM_CONF is not set"
    if not Path(conf).is_file():
        return f"SLURM_CONF={conf} does not exist"
    res = subprocess.run(["sinfo", "-h", "-o", "%T"], capture_output=True, text=True, timeout=30)
    states = res.stdout.split()
    if res.returncode != 0 or not any(s.rstrip("*~#") in ("idle", "mixed", "allocated", "completing")
                                      for s in states):
        return f"no usable node (sinfo: rc {res.returncode}, {res.stdout.strip() or res.stderr.strip()})"
    res = subprocess.run(["sacct", "-n", "-X", "-S", "now-1minutes"], capture_output=True, text=True, timeout=30)
    if res.returncode != 0:
        return f"sacct fails (accounting via slurmdbd is needed): {res.stderr.strip()}"
    return ""


@pytest.fixture(scope="session")
def slurm_cluster():
    if os.environ.get("MTEPO_SKIP_SLURM") == "1":
        pytest.skip("MTEPO_SKIP_SLURM=1")
    problem = _cluster_problem()
    if problem:
        pytest.fail(f"no Slurm cluster reachable: {problem}; {HOW}", pytrace=False)
    return os.environ["SLURM_CONF"]


def sbatch(script, *args, env=None, output=None, cwd=ROOT, extra=()) -> str:
    """Submit ``script`` with ``args`` (the script's own); ``extra``: more sbatch options."""
    cmd = (["sbatch", "--parsable"] + ([f"--output={output}"] if output else []) + list(extra)
           + [str(script), *map(str, args)])
    res = subprocess.run(cmd, capture_output=True, text=True, cwd=cwd, env=env, timeout=60)
    assert res.returncode == 0, f"sbatch failed: {res.stderr}"
    return res.stdout.strip().split(";")[0]


def sacct(job_id: str):
    """[(JobID, State, Elapsed, ExitCode)] of the job and its steps (all restarts: -D)."""
    res = subprocess.run(["sacct", "-j", job_id, "-n", "-P", "-D", "-o", "JobID,State,Elapsed,ExitCode"],
                         capture_output=True, text=True, timeout=30)
    return [tuple(line.split("|")) for line in res.stdout.splitlines() if line.strip()]


def job_state(job_id: str) -> str:
    res = subprocess.run(["sacct", "-j", job_id, "-n", "-P", "-X", "-o", "State"], capture_output=True,
                         text=True, timeout=30)
    lines = [s.split()[0] for s in res.stdout.splitlines() if s.strip()]
    return lines[-1] if lines else "UNKNOWN"  # the newest restart is listed last


def wait_job(job_id: str, timeout: float, poll: float = 2.0) -> str:
    """Poll sacct (as nemo-run does) until the job reaches a terminal state; cancel it on time-out."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        state = job_state(job_id)
        if state.startswith(TERMINAL):
            return state
        time.sleep(poll)
    subprocess.run(["scancel", job_id], capture_output=True)
    pytest.fail(f"job {job_id} not finished after {timeout:.0f} s (state {job_state(job_id)})")
