#!/bin/bash
# Qwen3-14B + TEPO with a Python tool (multi-turn episodes): 2 actor nodes (TP=4, DP=4) + 2 SGLang nodes (8 servers x TP=2).
#   sbatch slurm/qwen3_14b_tir_tepo.sh [train.steps=500 ...]   (submit from the repository root)
# Layout, node counts and the per-GPU memory arithmetic: examples/models/qwen3_14b_tir.yaml,
# docs/ROLLOUT.md ("Multi-turn episodes"). bubblewrap must be on the first actor node. torchrun starts
# launch.gpus_per_node processes on each actor node; the trainer makes DP = world / (TP x PP).
# Environment: MODEL_PATH, TRAIN_FILES, OUTPUT_DIR, ACTOR_NODES, ROLLOUT_NODES (see slurm/lib.sh).
#SBATCH --job-name=qwen3_14b_tir_tepo
#SBATCH --nodes=4
#SBATCH --ntasks-per-node=1
#SBATCH --gpus-per-node=8
#SBATCH --exclusive
#SBATCH --time=48:00:00
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

tepo_main "$TEPO_ROOT/examples/models/qwen3_14b_tir.yaml" "$@"
