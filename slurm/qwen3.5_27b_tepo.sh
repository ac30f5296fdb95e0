#!/bin/bash
# Qwen3.5-27B (hybrid: Gated DeltaNet + gated attention) + TEPO: 2 actor nodes (TP=4, DP=4) + 2 SGLang nodes (4 servers x TP=4).
#   sbatch slurm/qwen3.5_27b_tepo.sh [train.steps=500 ...]   (submit from the repository root)
# Layout, node counts and the per-GPU memory arithmetic: examples/models/qwen3.5_27b.yaml, docs/LAUNCH.md.
# Environment: MODEL_PATH, TRAIN_FILES, OUTPUT_DIR, ACTOR_NODES, ROLLOUT_NODES (see slurm/lib.sh).
#SBATCH --job-name=qwen3.5_27b_tepo
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

tepo_main "$TEPO_ROOT/examples/models/qwen3.5_27b.yaml" "$@"
