"""tools/launch_nemo_run.py for real: the tiny CPU job (examples/models/tiny_cpu.yaml: one SGLang CPU
server + a TP=2 trainer under torchrun, colocated on one node) submitted through nemo-run's
SlurmExecutor (LocalTunnel) to the one-node Slurm cluster of tools/slurm_cluster.sh. Checks that
nemo-run reports SUCCEEDED, sacct says COMPLETED, and the run wrote metrics.jsonl and a complete
checkpoint, and that both task steps were given all of the node's CPUs. The offline rendering tests
are tests/launch/test_nemo_run.py."""
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytestmark = [pytest.mark.slurm, pytest.mark.sglang, pytest.mark.slow, pytest.mark.timeout(1500)]

ROOT = Path(__file__).resolve().parents[2]
TOOL = ROOT / "tools" / "launch_nemo_run.py"
STEPS = 3  # train.steps of examples/models/tiny_cpu.yaml (given again below: the test relies on it)


def _tail(path: Path, n: int = 4000) -> str:
    return f"--- {path}\n" + (path.read_text(errors="replace")[-n:] if path.is_file() else "(missing)")


def test_tiny_cpu_job_runs_through_nemo_run_slurm_executor(slurm_cluster, tmp_path):
    conf = slurm_cluster  # SLURM_CONF of the running cluster (tests/slurm/conftest.py)
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("SLURM_", "TEPO_", "NEMORUN_")) and k not in
           ("MODEL_PATH", "TRAIN_FILES", "OUTPUT_DIR", "ACTOR_NODES", "ROLLOUT_NODES")}
    env.update(SLURM_CONF=conf, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", PYTHONUNBUFFERED="1",
               CUDA_VISIBLE_DEVICES="", COLUMNS="200")

    tiny = tmp_path / "tiny"  # the tiny model + prompts (slurm/local_cpu_tepo.sh makes them the same way)
    res = subprocess.run([sys.executable, str(ROOT / "tools" / "make_tiny_model.py"), "--out", str(tiny)],
                         capture_output=True, text=True, env=env, timeout=900)
    assert res.returncode == 0, res.stderr[-3000:]

    out = tmp_path / "out"
    name = f"tepo_nr_{os.getpid()}"  # not "nemo_run...": nemo-run rewrites "/nemo_run" in paths
    t0 = time.monotonic()
    cmd = [sys.executable, str(TOOL), "--launch", str(ROOT / "examples" / "models" / "tiny_cpu.yaml"),
           "--executor", "slurm", "--account", "local", "--partition", "local", "--time", "00:20:00",
           "--job-name", name, "--monitor-interval", "3", "--health-timeout", "600",
           "--nemorun-home", str(tmp_path / "home"),
           "--python", sys.executable,  # the nodes' python: this one (the project venv)
           f"model.path={tiny / 'model'}", f"data.train_files=[{tiny / 'train.jsonl'}]",
           f"train.output_dir={out}", f"train.steps={STEPS}"]
    try:
        res = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=ROOT, timeout=1200)
    except subprocess.TimeoutExpired:
        subprocess.run(["scancel", f"--name={name}.{name}-0"], env=env, capture_output=True)
        raise
    wall = time.monotonic() - t0
    logs = sorted((tmp_path / "home").rglob("*.out")) + sorted(out.rglob("sglang.*.log"))
    detail = res.stdout[-3000:] + res.stderr[-3000:] + "\n".join(_tail(p) for p in logs)
    assert res.returncode == 0, detail
    m = re.search(r"^slurm job: (\d+)$", res.stdout, re.M)
    assert m, detail
    job = m.group(1)
    assert re.search(r"^experiment \S+: .*SUCCEEDED", res.stdout, re.M), detail

    # sacct's view of the batch job (what nemo-run polled)
    acct = subprocess.run(["sacct", "-j", job, "-X", "-n", "-P", "-o", "State,ExitCode,Elapsed"],
                          capture_output=True, text=True, env=env, timeout=60)
    state, exit_code, elapsed = acct.stdout.strip().splitlines()[0].split("|")
    assert (state, exit_code) == ("COMPLETED", "0:0"), acct.stdout + detail
    # both task steps had all of the node's CPUs (--cpus-per-task from lib.sh's tepo_cpus_per_node;
    # without it a step gets one CPU, and CPU binding holds it to that core)
    node_cpus = 2  # the job's: tiny_cpu.yaml's 2 trainer processes (--cpus-per-task on a CPU layout)
    steps_acct = subprocess.run(["sacct", "-j", job, "-n", "-P", "-o", "JobID,JobName,AllocCPUS"],
                                capture_output=True, text=True, env=env, timeout=60).stdout
    task_steps = {jid: int(n) for jid, step, n in (line.split("|") for line in steps_acct.split())
                  if re.fullmatch(rf"{job}\.\d+", jid) and step != "hostname"}  # (nemo-run's head_node_ip step)
    assert len(task_steps) >= 2 and set(task_steps.values()) == {node_cpus}, (steps_acct, node_cpus)
    print(f"slurm job {job}: {state} in {elapsed} (launcher wall {wall:.0f} s)")

    # the run's outputs: metrics for every step, a complete checkpoint, the server's log
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if line.strip()]
    steps = sorted({r["step"] for r in rows if "step" in r})
    assert steps and steps[-1] == STEPS, rows[-3:]
    markers = [p for p in out.rglob("complete") if p.parent.name.startswith("step_")]
    assert markers, sorted(str(p) for p in out.rglob("*"))[:50]
    assert any(p.parent.name == f"step_{STEPS}" for p in markers)
    server_logs = list((out / "logs" / f"nemo-run.{job}.0").glob("sglang.*.0.log"))
    assert server_logs, detail
    trainer_log = [p for p in logs if p.name.startswith("log-") and "-1_" in p.name]
    assert trainer_log and "all SGLang servers healthy" in trainer_log[0].read_text(errors="replace"), detail
