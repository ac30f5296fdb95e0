"""Every job step of slurm/lib.sh gets the node's CPUs, on a real Slurm cluster with CPU binding.

Since Slurm 22.05 srun does not inherit the job's ``--cpus-per-task``: a step asks for one CPU per
task unless it says otherwise. Where steps get exactly what they ask for (``--exact``, which sites
default with ``SLURM_EXACT=1`` and which other options imply) and CPU binding is on
(TaskPlugin=task/affinity, which tools/slurm_cluster.sh switches on; or cgroups), such a step is
bound to one CPU, so torchrun's ranks, or a node's SGLang servers, share one core. Seen on the
local cluster (Slurm 22.05.8): without ``--exact`` a one-task step is bound to all of the job's
CPUs on the node, with it (and no count) to one. The job
(tests/slurm/cpu_steps_job.sh) runs lib.sh's own step functions with a stand-in python that records
``len(os.sched_getaffinity(0))`` in each step; a bare step without a count is the control.
The same job shows, through real srun steps, that the trainer's own settings (lib.sh's
``tepo_trainer_env``: OMP threads, ``CUDA_DEVICE_MAX_CONNECTIONS``, ``PYTORCH_CUDA_ALLOC_CONF``, ...)
reach the trainer step and not the SGLang step (issue #32 rows 7 and 9)."""
import os
import subprocess

import pytest

from tests.slurm.conftest import ROOT, sacct, sbatch, wait_job

pytestmark = [pytest.mark.slurm]
FAKE_PYTHON = """#!/bin/bash
# stand-in for TEPO_PYTHON: the step's CPU count, by the kind of command (serve / torchrun / bare)
case "$*" in
    *megatron_tepo.rollout.sglang.server*) kind=sglang ;;
    *torch.distributed.run*) kind=trainer ;;
    *) kind=$1 ;;
esac
env > "$TEPO_REPORT_DIR/$kind.env"
exec python3 -c 'import os, sys; open(sys.argv[1], "w").write(str(len(os.sched_getaffinity(0))))' \\
    "$TEPO_REPORT_DIR/$kind.cpus"
"""
TRAINER_VARS = ("CUDA_DEVICE_MAX_CONNECTIONS", "OMP_NUM_THREADS", "MKL_NUM_THREADS", "PYTORCH_CUDA_ALLOC_CONF",
                "NCCL_ASYNC_ERROR_HANDLING", "TORCH_NCCL_ASYNC_ERROR_HANDLING")


def _node_cpus() -> int:
    out = subprocess.run(["sinfo", "-h", "-N", "-o", "%c"], capture_output=True, text=True, timeout=30).stdout
    return int(out.split()[0])


def _job_env(**extra):
    env = {k: v for k, v in os.environ.items()
           if not (k.startswith(("SLURM_", "TEPO_")) and k != "SLURM_CONF")}
    env.update(TEPO_ROOT=str(ROOT), **extra)
    return env


def _submit(tmp_path, device, drop=()):
    """Run tests/slurm/cpu_steps_job.sh (lib.sh's steps, stand-in python) for ``device``, without
    the variables ``drop`` in the job's environment; returns the reports folder."""
    cpus = _node_cpus()
    fake = tmp_path / "python"
    fake.write_text(FAKE_PYTHON)
    fake.chmod(0o755)
    reports = tmp_path / "reports"
    reports.mkdir()
    # SLURM_EXACT: every step gets exactly what it asks for (srun --exact). TEPO_SERVER_RESTARTS=0: the
    # stand-in server exits at once, which lib.sh would otherwise answer with 3 restarts (60 s of back-off)
    env = _job_env(TEPO_FAKE_PYTHON=str(fake), TEPO_REPORT_DIR=str(reports), FIT_DEVICE=device,
                   SLURM_EXACT="1", TEPO_SERVER_RESTARTS="0")
    env = {k: v for k, v in env.items() if k not in drop}
    if device == "cuda":
        env["TEPO_SRUN_ARGS"] = ""
    # the job is given the whole node, as the GPU scripts' `#SBATCH --exclusive` does
    job = sbatch(ROOT / "tests" / "slurm" / "cpu_steps_job.sh", output=tmp_path / "out-%j.txt",
                 env=env, extra=[f"--cpus-per-task={cpus}"])
    state = wait_job(job, timeout=300)
    text = (tmp_path / f"out-{job}.txt").read_text()
    logs = "".join(f"--- {p.name}:\n{p.read_text()}\n" for p in sorted((reports / "logs").glob("*")))
    assert state == "COMPLETED", f"job {job}: {state} {sacct(job)}\n{text}\n{logs}"
    return reports


# cpu: the --overlap steps of launch.device cpu; cuda: the GPU path's steps, with TEPO_SRUN_ARGS="" standing
# in for --gpus-per-node (no GPUs here), so the CPU count must come from lib.sh itself
@pytest.mark.parametrize("device", ["cpu", "cuda"])
def test_every_step_gets_the_nodes_cpus(slurm_cluster, tmp_path, device):
    cpus = _node_cpus()
    assert cpus >= 2, f"the test cluster's node has {cpus} CPU(s): a count cannot be told from binding"
    reports = _submit(tmp_path, device)
    seen = {kind: int((reports / f"{kind}.cpus").read_text()) for kind in ("bare", "sglang", "trainer")}
    assert seen["bare"] == 1, (f"a step without a CPU count sees {seen['bare']} CPUs: CPU binding is off in "
                               f"the test cluster (TaskPlugin=task/affinity in tools/slurm_cluster.sh)")
    assert seen["sglang"] == cpus and seen["trainer"] == cpus, (seen, cpus)


def _env_of(path):
    return dict(line.split("=", 1) for line in path.read_text().splitlines() if "=" in line)


@pytest.mark.parametrize("device,want", [
    ("cuda", {"CUDA_DEVICE_MAX_CONNECTIONS": "1", "OMP_NUM_THREADS": "8", "PYTORCH_CUDA_ALLOC_CONF":
              "expandable_segments:True", "NCCL_ASYNC_ERROR_HANDLING": "1", "TORCH_NCCL_ASYNC_ERROR_HANDLING": "1"}),
    ("cpu", {"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}),
])
def test_the_trainers_settings_stay_in_its_step(slurm_cluster, tmp_path, device, want):
    """Through real srun steps (lib.sh's tepo_nccl_env, then its SGLang and trainer steps, as
    tepo_main runs them): the trainer's settings are in the trainer step's environment only."""
    reports = _submit(tmp_path, device, drop=TRAINER_VARS)  # (this test's own OMP_NUM_THREADS=1 too)
    trainer, server = _env_of(reports / "trainer.env"), _env_of(reports / "sglang.env")
    assert {k: server[k] for k in TRAINER_VARS if k in server} == {}
    assert {k: trainer[k] for k in TRAINER_VARS if k in trainer} == want
