#!/bin/bash
# A stand-in job for the preemption path of slurm/lib.sh (tests/slurm/test_local_cluster.py): the
# first attempt installs lib.sh's traps and waits on a job step, the test sends USR1 to the batch
# shell (as `#SBATCH --signal=B:USR1@...` would), lib.sh stops the step and runs `scontrol requeue`;
# the requeued attempt (SLURM_RESTART_COUNT 1) exits 0. scancel (TERM) must not requeue it.
#SBATCH --job-name=tepo_requeue_test
#SBATCH --nodes=1
#SBATCH --ntasks=1
#SBATCH --requeue
#SBATCH --open-mode=append
set -euo pipefail
# shellcheck source=slurm/lib.sh
source "$TEPO_ROOT/slurm/lib.sh"
attempt=${SLURM_RESTART_COUNT:-0}
tepo_log "attempt $attempt of job ${SLURM_JOB_ID:-?}"
if ((attempt > 0)); then
    tepo_log "requeued attempt: done"
    exit 0
fi
TEPO_STEP_PIDS=()
tepo_install_traps
# the step ignores TERM, so that scancel's TERM is seen by this shell's trap, not raced by the
# step ending first (srun's own termination on tepo_stop_steps still kills it)
srun --overlap --ntasks=1 bash -c 'trap "" TERM; exec sleep 600' &
TEPO_STEP_PIDS+=($!)
touch "$TEPO_READY_FILE"
wait
