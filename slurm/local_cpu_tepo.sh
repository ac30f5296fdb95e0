#!/bin/bash
# The tiny TEPO job on CPU, on one node: one SGLang CPU server and a TP=2 trainer (torchrun, 2
# processes) sharing the node, a few steps, a checkpoint every step, metrics in
# $OUTPUT_DIR/metrics.jsonl, on 2 CPUs (every job step gets both). The same slurm/lib.sh as the GPU
# scripts (fit check in CPU mode, job steps with --overlap, requeue + resume).
#   bash tools/slurm_cluster.sh start              # a one-node cluster on this machine; then the
#   export SLURM_CONF=/tmp/mtepo-slurm/etc/slurm.conf   # line it prints
#   sbatch slurm/local_cpu_tepo.sh [train.steps=5 ...]   (submit from the repository root)
# MODEL_PATH unset: tools/make_tiny_model.py writes the tiny model and prompt files into
# $OUTPUT_DIR/tiny (once; later runs reuse them). Layout: examples/models/tiny_cpu.yaml.
# Environment: MODEL_PATH, TRAIN_FILES, OUTPUT_DIR (default outputs/local_cpu_tepo),
# MTEPO_SGLANG_PYTHON (the SGLang venv, default .venv-sglang/bin/python); see slurm/lib.sh.
#SBATCH --job-name=local_cpu_tepo
#SBATCH --nodes=1
#SBATCH --ntasks=1
#SBATCH --cpus-per-task=2
#SBATCH --time=00:30:00
#SBATCH --requeue
#SBATCH --signal=B:USR1@120
#SBATCH --open-mode=append
#SBATCH --output=slurm-%x-%j.out
set -euo pipefail

# sbatch runs a copy of this file from its spool directory: find the checkout from the submit dir
TEPO_ROOT=${TEPO_ROOT:-${SLURM_SUBMIT_DIR:-$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)}}
export TEPO_ROOT
# shellcheck source=slurm/lib.sh
source "$TEPO_ROOT/slurm/lib.sh"

OUTPUT_DIR=${OUTPUT_DIR:-$TEPO_ROOT/outputs/local_cpu_tepo}
export OUTPUT_DIR
if [[ -z "${MODEL_PATH:-}" ]]; then
    tepo_log "MODEL_PATH unset: the tiny model and prompts in $OUTPUT_DIR/tiny (tools/make_tiny_model.py)"
    if [[ "${TEPO_DRY_RUN:-0}" != 1 ]]; then
        OMP_NUM_THREADS=1 "$(tepo_python)" "$TEPO_ROOT/tools/make_tiny_model.py" --out "$OUTPUT_DIR/tiny" >&2 \
            || tepo_die "tools/make_tiny_model.py failed"
    fi
    MODEL_PATH=$OUTPUT_DIR/tiny/model
    TRAIN_FILES=${TRAIN_FILES:-[$OUTPUT_DIR/tiny/train.jsonl]}
fi
export MODEL_PATH TRAIN_FILES

tepo_main "$TEPO_ROOT/examples/models/tiny_cpu.yaml" "$@"
