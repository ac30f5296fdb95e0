"""slurm/local_cpu_tepo.sh on a real one-node Slurm cluster (tools/slurm_cluster.sh): sbatch, poll
sacct, check the job ended COMPLETED with a real SGLang CPU server and a TP=2 trainer generating one
step off, metrics and a complete checkpoint written; a second submission resumes from that checkpoint. Plus lib.sh's
preemption path (USR1 to the batch shell -> steps stopped -> scontrol requeue -> second attempt)."""
import json
import math
import os
import re
import subprocess
import time
from pathlib import Path

import pytest
import yaml

from megatron_tepo.checkpoint.store import is_complete_checkpoint, list_complete_checkpoints
from tests.rollout.conftest import require_sglang
from tests.slurm.conftest import ROOT, job_state, sacct, sbatch, wait_job

pytestmark = [pytest.mark.slurm]
SCRIPT = ROOT / "slurm" / "local_cpu_tepo.sh"
# tiny sizes: 4 prompts x 4 samples per step, one policy update per step; one-step-off generation
# (the server generates the next step's groups while the TP=2 actor trains)
SMALL = ["rollout.prompts_per_step=4", "rollout.n_samples=4", "train.mini_batch_prompts=4",
         "rollout.max_staleness=1", "algorithm.rollout_correction.rollout_is=token"]


def _job_env(**extra):
    env = {k: v for k, v in os.environ.items()
           if not (k.startswith(("SLURM_", "TEPO_")) and k != "SLURM_CONF")
           and k not in ("MODEL_PATH", "TRAIN_FILES", "OUTPUT_DIR", "ACTOR_NODES", "ROLLOUT_NODES")}
    env.update(TEPO_ROOT=str(ROOT), OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", **extra)
    return env


def _run(out: Path, steps: int, sglang_python: str, args=SMALL):
    started = time.monotonic()
    job = sbatch(SCRIPT, f"train.steps={steps}", *args, output=out.parent / f"slurm-{steps}-%j.out",
                 env=_job_env(OUTPUT_DIR=str(out), MTEPO_SGLANG_PYTHON=sglang_python))
    state = wait_job(job, timeout=900)
    wall = time.monotonic() - started
    rows = sacct(job)
    print(f"job {job} (train.steps={steps}): {state} in {wall:.0f} s; sacct: {rows}")
    stdout = next(out.parent.glob(f"slurm-{steps}-{job}.out")).read_text()
    logs = out / "logs" / f"{job}.0"
    trainer = (logs / "trainer.log").read_text() if (logs / "trainer.log").exists() else "(no trainer.log)"
    servers = "".join(f"--- {p.name}:\n{p.read_text(errors='replace')[-3000:]}\n" for p in sorted(logs.glob("sglang.*")))
    assert state == "COMPLETED", f"job {job}: {state}\n{rows}\n--- job stdout:\n{stdout[-4000:]}\n" \
                                 f"--- trainer.log:\n{trainer[-4000:]}\n{servers}"
    return job, logs, stdout, trainer


def _node_cpus_allocated() -> int:
    """CPUs allocated on the one-node test cluster (``scontrol show node``'s CPUAlloc)."""
    out = subprocess.run(["scontrol", "show", "node"], capture_output=True, text=True, timeout=30).stdout
    return sum(int(tok.split("=", 1)[1]) for tok in out.split() if tok.startswith("CPUAlloc="))


def _metrics(out: Path):
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if line.strip()]


@pytest.mark.sglang
@pytest.mark.slow
@pytest.mark.timeout(1800)  # two submissions; each ~1-2 min on 2 idle cores
def test_local_cpu_job_completes_then_resumes(slurm_cluster, tmp_path):
    sglang_python = require_sglang()
    out = tmp_path / "run"
    host = subprocess.run(["hostname", "-s"], capture_output=True, text=True).stdout.strip()

    job, logs, stdout, trainer = _run(out, 2, sglang_python)
    assert "SGLang colocated on them" in stdout and "all 1 SGLang server(s) healthy" in stdout
    server_log = (logs / f"sglang.{host}.0.log").read_text()
    # SGLang's launch with the job's random API key from the environment: on no command line
    assert "rollout/sglang/launch.py" in server_log and "--device cpu" in server_log
    assert "--api-key" not in server_log and "API key: a new random one for this job" in stdout
    assert "starting at step 1" in trainer and "world 2, engine sglang" in trainer  # TP=2: two ranks
    metrics = _metrics(out)
    assert [m["step"] for m in metrics] == [1, 2]
    for m in metrics:
        for key in ("loss", "entropy", "grad_norm", "reward_mean"):
            assert math.isfinite(m[key]), (key, m)
        assert m["sync_s"] > 0 and 0 < m["rollout_is_weight"] <= 2.0, m
    # the server's log-probs of its own samples vs the actor's (bf16 server): step 1 on the same
    # weights; step 2 generated one step off, with the weights step 1 started from
    assert [m["rollout_staleness"] for m in metrics] == [0.0, 1.0]
    assert 0 < metrics[0]["drift_mean"] < 0.05 and metrics[0]["drift_max"] < 1.0, metrics[0]
    assert metrics[1]["drift_mean"] > 0
    ckpts = out / "checkpoints"
    assert is_complete_checkpoint(ckpts / "step_2"), sorted(p.name for p in ckpts.iterdir())
    run_yaml = (out / "launch" / f"{job}.0" / "run.yaml").read_text()
    assert "engine: sglang" in run_yaml and "tp: 2" in run_yaml

    job2, logs2, _, trainer2 = _run(out, 3, sglang_python)
    assert f"resumed from {ckpts / 'step_2'}" in trainer2, trainer2[-3000:]
    steps = [m["step"] for m in _metrics(out)]
    assert steps == [1, 2, 3], steps  # step 3 added, nothing duplicated
    assert _metrics(out)[:2] == metrics  # the first job's lines kept as they were
    # the first job ended at its last step, so it saved no next rollout: step 3 is on-policy
    assert _metrics(out)[2]["rollout_staleness"] == 0.0
    assert [p.name for p in list_complete_checkpoints(ckpts)][-1] == "step_3"


@pytest.mark.sglang
@pytest.mark.slow
@pytest.mark.timeout(900)  # one submission, ~1-2 min on 2 idle cores
def test_local_cpu_job_colocated(slurm_cluster, tmp_path):
    """The tiny CPU job colocated (issue #34 point 5; its launch file with
    launch.sglang.placement=colocated): the real SGLang CPU server and the TP=2 trainer take turns --
    the launch releases the server's memory after its health wait and before the trainer starts
    (SGLang accepts it and, on CPU, frees nothing), the trainer starts from that state
    (TEPO_SGLANG_RELEASED) and runs colocated: release, onload, offload, resume around every sync."""
    sglang_python = require_sglang()
    out = tmp_path / "run"
    host = subprocess.run(["hostname", "-s"], capture_output=True, text=True).stdout.strip()
    on_policy = [a for a in SMALL if a.split("=")[0] not in ("rollout.max_staleness",
                                                          "algorithm.rollout_correction.rollout_is")]
    job, logs, stdout, trainer = _run(out, 2, sglang_python, ["launch.sglang.placement=colocated", *on_policy])
    assert "SGLang colocated on their cpu devices (taking turns with the actor)" in stdout
    steps = re.findall(r"\] step \d+ of 6: (\w+)$", stdout, re.M)
    assert steps == ["split_nodes", "job_env", "servers", "health", "release", "trainer"], stdout[-3000:]
    release = (logs / "release.log").read_text()
    assert re.search(rf"released weights,kv_cache,cuda_graph on http://{host}:\d+ in ", release), release
    run = yaml.safe_load((out / "launch" / f"{job}.0" / "run.yaml").read_text())
    assert run["rollout"]["colocated"] is True
    metrics = _metrics(out)
    assert [m["step"] for m in metrics] == [1, 2]
    for m in metrics:
        assert math.isfinite(m["loss"]) and m["sync_s"] > 0, m
        # the colocated phases ran: the engine released and resumed, the actor went to host and back
        assert m["engine_release_s"] > 0 and m["engine_resume_s"] > 0 and m["actor_offload_gb"] > 0, m
    assert is_complete_checkpoint(out / "checkpoints" / "step_2")


def test_preemption_requeues_and_reruns(slurm_cluster, tmp_path):
    """USR1 to the batch shell (what `#SBATCH --signal=B:USR1@120` sends before the time limit):
    lib.sh's trap stops the job step and runs `scontrol requeue`; the job comes back as attempt 1."""
    ready = tmp_path / "ready"
    job = sbatch(ROOT / "tests" / "slurm" / "requeue_job.sh", output=tmp_path / "out-%j.txt",
                 env=_job_env(TEPO_READY_FILE=str(ready)))
    deadline = time.monotonic() + 120
    while not ready.exists():
        assert time.monotonic() < deadline, f"job {job} never started: {job_state(job)}"
        time.sleep(0.5)
    time.sleep(1.0)  # let the batch shell reach `wait`
    subprocess.run(["scancel", "--signal=USR1", "--batch", job], check=True, timeout=30)
    # Slurm delays a requeued job's start (BeginTime ~2 min later); release it once it is pending
    deadline = time.monotonic() + 60
    while job_state(job) not in ("PENDING", "RUNNING", "COMPLETED"):
        assert time.monotonic() < deadline, f"job {job} not requeued: {sacct(job)}"
        time.sleep(0.5)
    # ... but only once the first attempt's allocation is gone: released while slurmctld still
    # revokes its credential, the new attempt is killed ("Killing non-startable batch JobId=..:
    # Job credential revoked") and the job ends FAILED -- a race of this test, not of lib.sh
    while _node_cpus_allocated() and job_state(job) == "PENDING":
        assert time.monotonic() < deadline, f"job {job}: the first attempt's allocation stays"
        time.sleep(0.5)
    time.sleep(1.0)
    subprocess.run(["scontrol", "update", f"JobId={job}", "StartTime=now"], capture_output=True, timeout=30)
    assert wait_job(job, timeout=180) == "COMPLETED"
    states = [row[1] for row in sacct(job) if row[0] == job]
    assert states[:1] == ["REQUEUED"] and states[-1] == "COMPLETED", sacct(job)
    text = (tmp_path / f"out-{job}.txt").read_text()
    assert "signal received: stopping the job steps and requeueing job" in text
    assert "attempt 1 of job" in text and "requeued attempt: done" in text


def test_scancel_is_not_requeued(slurm_cluster, tmp_path):
    """TERM (scancel) stops the steps but does not requeue: a cancelled job stays cancelled."""
    ready = tmp_path / "ready"
    job = sbatch(ROOT / "tests" / "slurm" / "requeue_job.sh", output=tmp_path / "out-%j.txt",
                 env=_job_env(TEPO_READY_FILE=str(ready)))
    deadline = time.monotonic() + 120
    while not ready.exists():
        assert time.monotonic() < deadline, f"job {job} never started: {job_state(job)}"
        time.sleep(0.5)
    time.sleep(1.0)
    subprocess.run(["scancel", job], check=True, timeout=30)
    assert wait_job(job, timeout=60).startswith("CANCELLED")
    time.sleep(3.0)
    assert [row[1].split()[0] for row in sacct(job) if row[0] == job] == ["CANCELLED"], sacct(job)
    assert "TERM received: stopping the job steps (no requeue)" in (tmp_path / f"out-{job}.txt").read_text()
