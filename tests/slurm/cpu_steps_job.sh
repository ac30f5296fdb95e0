#!/bin/bash
# A stand-in job for the CPU count of slurm/lib.sh's job steps (tests/slurm/test_step_cpus.py): it
# runs lib.sh's own tepo_start_sglang and tepo_start_trainer, with TEPO_PYTHON a stand-in python
# ($TEPO_FAKE_PYTHON) that records how many CPUs each step's process may run on
# (os.sched_getaffinity) instead of starting SGLang or torchrun. A bare `srun --overlap` step
# without a CPU count records the same as a control: under CPU binding (TaskPlugin=task/affinity)
# it sees one CPU. Reports: $TEPO_REPORT_DIR/{sglang,trainer,bare}.cpus, and each step's
# environment in $TEPO_REPORT_DIR/{sglang,trainer,bare}.env (lib.sh's job-wide tepo_nccl_env is
# applied first, as tepo_main does: the trainer's own settings must reach its step only).
#SBATCH --job-name=tepo_cpu_steps_test
#SBATCH --nodes=1
#SBATCH --ntasks=1
#SBATCH --open-mode=append
set -euo pipefail
# shellcheck source=slurm/lib.sh
source "$TEPO_ROOT/slurm/lib.sh"
export TEPO_PYTHON=$TEPO_FAKE_PYTHON
FIT_DEVICE=${FIT_DEVICE:-cpu}
FIT_GPUS_PER_NODE=2 FIT_SERVERS_PER_NODE=1 FIT_SGLANG_TP=1 FIT_SGLANG_PORT=30000
FIT_SERVE_ARGS="-m megatron_tepo.rollout.sglang.server --model-path /nonexistent --tp 1 --device $FIT_DEVICE"
RUN_DIR=$TEPO_REPORT_DIR/run LOG_DIR=$TEPO_REPORT_DIR/logs
mkdir -p "$RUN_DIR" "$LOG_DIR"
TEPO_STEP_PIDS=()
tepo_split_nodes 1 0
tepo_nccl_env
tepo_start_sglang
wait "${TEPO_STEP_PIDS[@]}"
tepo_start_trainer
wait "$TEPO_TRAINER_PID"
srun --overlap --ntasks=1 "$TEPO_FAKE_PYTHON" bare
tepo_log "cpu steps: done"
