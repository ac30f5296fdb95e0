"""A hung trainer in the real local Slurm cluster (issue #25, points 3 and 4): the job of
slurm/local_cpu_tepo.sh (TP=2 trainer under torchrun, the embedded engine: no SGLang server, so the
run is deterministic on CPU) hangs at step K on global rank 0 (``fault.inject_hang_at_step``, test
only); the watchdog stops it with every thread's stack in the trainer log; lib.sh requeues the job
(the exit-reason file allows it); the second attempt resumes from step K-1's checkpoint and the job
ends COMPLETED with the same metrics, step for step, as an uninterrupted job of the same run."""
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.slurm.conftest import ROOT, job_state, sacct, sbatch, wait_job
from tests.slurm.test_local_cluster import _job_env, _node_cpus_allocated

pytestmark = [pytest.mark.slurm]
SCRIPT = ROOT / "slurm" / "local_cpu_tepo.sh"
STEPS, HANG_AT = 4, 3
# the tiny job on the embedded engine (seeded; its RNG is saved with each checkpoint), one policy
# update per step, a checkpoint every step
RUN = [f"train.steps={STEPS}", "rollout.engine=embedded", "rollout.prompts_per_step=4", "rollout.n_samples=4",
       "train.mini_batch_prompts=4", "train.epochs_per_step=1", "train.save_every=1", "train.export_hf=false"]
# a short collective time-out for the hung run only (a tiny step's collectives take seconds)
HANG = [f"fault.inject_hang_at_step={HANG_AT}", "fault.watchdog_collective_s=60"]
VOLATILE = {"time", "step_s", "sync_s", "rollout_s", "train_s", "tokens_per_s"}


def _metrics(out: Path):
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if line.strip()]


def _submit(tmp_path: Path, name: str, tiny: Path, *args) -> tuple:
    out = tmp_path / name
    job = sbatch(SCRIPT, *RUN, *args, output=tmp_path / f"slurm-{name}-%j.out",
                 env=_job_env(OUTPUT_DIR=str(out), MODEL_PATH=str(tiny / "model"),
                              TRAIN_FILES=f"[{tiny / 'train.jsonl'}]"))
    return job, out


def _release_when_requeued(job: str, timeout: float = 600) -> None:
    """Slurm holds a requeued job back (BeginTime about 2 min later); once it is pending and the
    first attempt's allocation is gone, start it now (released earlier, slurmctld may still revoke
    the first attempt's credential and kill the new one: a race of the test, see
    test_local_cluster.py). Asked again every few seconds while it stays pending: an update that
    comes while slurmctld still settles the requeue may not take, and the job would then wait out
    its BeginTime."""
    deadline, released = time.monotonic() + timeout, False
    while True:
        state = job_state(job)
        if state in ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT") or (released and state == "RUNNING"):
            return  # (the assertions below say what happened)
        assert time.monotonic() < deadline, f"job {job} not requeued: {sacct(job)}"
        if state == "PENDING" and not _node_cpus_allocated():
            time.sleep(1.0)
            subprocess.run(["scontrol", "update", f"JobId={job}", "StartTime=now"], capture_output=True, timeout=30)
            released = True
            time.sleep(4.0)
        else:
            time.sleep(1.0)


def _show(out: Path, job: str, tmp_path: Path, name: str) -> str:
    """The job's stdout and trainer logs, for an assertion message."""
    text = "".join(p.read_text(errors="replace")[-4000:] for p in tmp_path.glob(f"slurm-{name}-{job}.out"))
    for log in sorted((out / "logs").glob(f"{job}.*/trainer.log")):
        text += f"\n--- {log}:\n{log.read_text(errors='replace')[-6000:]}"
    return text


@pytest.mark.timeout(3000)  # two jobs, one of them run twice; ~5-8 min on 2 idle cores
def test_a_hung_trainer_is_stopped_requeued_and_finishes_like_an_uninterrupted_run(slurm_cluster, tmp_path):
    tiny = tmp_path / "tiny"  # one model and prompt file for both jobs
    subprocess.run([sys.executable, str(ROOT / "tools" / "make_tiny_model.py"), "--out", str(tiny)], check=True,
                   capture_output=True, env={**os.environ, "OMP_NUM_THREADS": "1"}, timeout=600)

    # the uninterrupted run (the default time-outs)
    started = time.monotonic()
    ref_job, ref = _submit(tmp_path, "ref", tiny)
    state = wait_job(ref_job, timeout=1200)
    assert state == "COMPLETED", _show(ref, ref_job, tmp_path, "ref")
    print(f"uninterrupted job {ref_job}: {state} in {time.monotonic() - started:.0f} s")
    stdout = next(tmp_path.glob(f"slurm-ref-{ref_job}.out")).read_text()
    assert "no SGLang server started" in stdout and "requeue" not in stdout.replace("#SBATCH --requeue", "")

    # the same run, hung at step HANG_AT on rank 0
    started = time.monotonic()
    job, out = _submit(tmp_path, "hang", tiny, *HANG)
    _release_when_requeued(job)
    state = wait_job(job, timeout=1200)
    print(f"hung job {job}: {state} in {time.monotonic() - started:.0f} s; sacct: {sacct(job)}")
    shown = _show(out, job, tmp_path, "hang")
    assert state == "COMPLETED", shown
    assert [row[1] for row in sacct(job) if row[0] == job] == ["REQUEUED", "COMPLETED"], sacct(job)

    # attempt 0: the hang, the watchdog's line and the Python stacks, the exit reason, the requeue
    first = (out / "logs" / f"{job}.0" / "trainer.log").read_text(errors="replace")
    assert f"fault.inject_hang_at_step={HANG_AT}: global rank 0 hangs now (test only)" in first, shown
    fired = re.findall(r"watchdog: no progress in phase 'collective' for 60 s \(fault\.watchdog_collective_s\) "
                       r"on rank (\d)", first)
    assert fired, shown
    assert re.search(r"(Current thread|Thread) 0x[0-9a-f]+", first) and 'File "' in first, shown
    # each rank's own copy of its stacks (in trainer.log the two ranks' dumps, written at the same
    # moment, can interleave character by character)
    stacks = {p.name: p.read_text(errors="replace") for p in (out / "logs" / f"{job}.0").glob("stacks.rank*.txt")}
    # rank 1 either dumped its stacks (its watchdog fired, or torchrun's SIGTERM came first) or its
    # blocked collective failed once rank 0 was gone, and it exited with its traceback in the log
    assert "stacks.rank0.txt" in stacks, (sorted(stacks), shown)
    assert "stacks.rank1.txt" in stacks or "[rank1]: Traceback" in first, (sorted(stacks), shown)
    # rank 0's stack: where it hung (its watchdog's dump or the SIGTERM one)
    assert "in _hang" in stacks["stacks.rank0.txt"], stacks["stacks.rank0.txt"][-3000:]
    # (one writer per file: faulthandler's thread headers start their lines there)
    assert all(re.search(r"^(Current thread|Thread) 0x[0-9a-f]+", text, re.M) for text in stacks.values()), stacks
    reasons = [json.loads(p.read_text()) for p in sorted((out / "logs" / f"{job}.0").glob("exit_reason.json*"))]
    assert reasons and all(r["reason"] == "watchdog" and r["requeue"] is True for r in reasons), reasons
    stdout = next(tmp_path.glob(f"slurm-hang-{job}.out")).read_text()
    assert f"requeueing job {job} (requeue 1 of at most 3; it resumes from the newest complete checkpoint)" in stdout
    assert '"reason": "watchdog"' in stdout
    assert "the trainer's Python stacks, one file per rank: " in stdout and "stacks.rank0.txt" in stdout

    # attempt 1: resumed from step HANG_AT - 1, no hang (a resumed run never injects one)
    second = (out / "logs" / f"{job}.1" / "trainer.log").read_text(errors="replace")
    step_dir = out / "checkpoints" / f"step_{HANG_AT - 1}"
    assert f"resumed from {step_dir}: continuing at step {HANG_AT}" in second, shown
    assert "hangs now" not in second and "watchdog:" not in second

    # every step exactly once, equal to the uninterrupted run's but for the timings
    got, want = _metrics(out), _metrics(ref)
    assert [m["step"] for m in got] == list(range(1, STEPS + 1))
    assert [{k: v for k, v in m.items() if k not in VOLATILE} for m in got] == \
        [{k: v for k, v in m.items() if k not in VOLATILE} for m in want]
    assert all(m["updates"] == 1.0 for m in got)  # (every step trained: the comparison means something)
