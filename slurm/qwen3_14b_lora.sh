#!/bin/bash
# Qwen3-14B + TEPO with LoRA (rank 32, the base frozen) on ONE 8-GPU node, colocated: the actor
# (TP=4, DP=2) and 4 SGLang servers (TP=2) on the same GPUs, taking turns with the memory; the
# actor's state beside its frozen weights is the adapters' alone (0.5 GiB per GPU).
#   sbatch slurm/qwen3_14b_lora.sh [train.steps=500 ...]   (submit from the repository root)
# Layout, offload level and the per-phase memory arithmetic: examples/models/qwen3_14b_lora.yaml,
# docs/LAUNCH.md ("LoRA"). Environment: MODEL_PATH, TRAIN_FILES, OUTPUT_DIR, ACTOR_NODES
# (see slurm/lib.sh).
#SBATCH --job-name=qwen3_14b_lora
#SBATCH --nodes=1
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

tepo_main "$TEPO_ROOT/examples/models/qwen3_14b_lora.yaml" "$@"
