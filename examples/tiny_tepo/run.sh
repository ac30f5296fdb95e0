#!/usr/bin/env bash
# The main job: installs what it needs (tools/setup_env.sh), then runs a tiny TEPO on CPU with the
# embedded engine (examples/tiny_tepo/run.py; arguments are passed on, e.g. train.steps=50).
# `--task tir` (the Python tool, run in Debian's bubblewrap) first installs bubblewrap where it can
# (as root: tools/install_bubblewrap.sh), else stops in one line before anything runs (status 2).
set -euo pipefail
repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
if [[ " $* " == *" --task tir "* || " $* " == *" --task=tir "* ]]; then
  bash "$repo/tools/install_bubblewrap.sh" run.sh \
    "the tool task runs its code in bubblewrap (or set environment.sandbox.kind=remote with a SandboxFusion service)" \
    || exit 2
fi
py="$(bash "$repo/tools/setup_env.sh" | tail -n 1)"
export OMP_NUM_THREADS=1 MKL_NUM_THREADS=1 PYTHONUNBUFFERED=1 CUDA_VISIBLE_DEVICES=""
exec "$py" "$repo/examples/tiny_tepo/run.py" "$@"
