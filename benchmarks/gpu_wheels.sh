#!/usr/bin/env bash
# Prepares what the GPU check (benchmarks/gpu_check.sh) carries to the lent GPU machine, which has
# no registry access: run it HERE, on a machine that reaches PyPI, from anywhere in the checkout.
#
#     bash benchmarks/gpu_wheels.sh
#
# Writes (into the ignored folder .gpu/ of the checkout, ~3 MB):
# * .gpu/wheels/: wheels for CPython 3.12 on manylinux x86-64, without their needs (--no-deps), of
#   what that machine lacks: megatron-core 0.19.2 (the newest end of pyproject.toml's range, the
#   one tools/test.sh runs on Python 3.12; its wheel is cp312-only, ~3 MB). Its needs (its METADATA's
#   Requires-Dist without extras: torch>=2.6.0, numpy, packaging>=24.2) and everything else the
#   check imports (transformers, safetensors,
#   triton, pytest, pytest-timeout, psutil, pyyaml, pyarrow, matplotlib) are in that machine's image
#   (../.library/device/KINDS.md lists it); math-verify is not, and the check never imports it.
#   Also flash-linear-attention's kernels for the qwen3_5 step: fla-core 0.6.0 (pure Python and
#   Triton, ~1.1 MB: the `fla` package megatron-core's Gated DeltaNet and transformers' Qwen3.5 import)
#   and einops (its one need; ~64 KB).
#   EXTRA_WHEELS="name==version ..." adds more; MCORE_VERSION=0.16.1 carries the oldest end instead.
# * .gpu/nvrx/: nvidia-resiliency-ext 0.7.0's wheel unpacked (its checkpoint writer; ~2 MB).
# * .gpu/shared/: a copy of ../shared/gpu/ (the earlier GPU measurement scripts, e.g. the HF bf16
#   baseline of actor_gpu.py), which does not travel by itself; if it exists.
# Leaves out: Transformer Engine, apex, SGLang (too large to carry, or CUDA builds pip cannot
# fetch for that machine here).
#
# Then, with the device tool: run(command="GPU_CHECK_PACK=1 bash benchmarks/gpu_check.sh", carry=[".gpu"]).
set -euo pipefail
repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
PY="${PYTHON:-python3}"
if [[ -x "$repo/.venv/bin/python" && -z "${PYTHON:-}" ]]; then
  PY="$repo/.venv/bin/python"
fi
wheels="$repo/.gpu/wheels"
rm -rf "$wheels"
mkdir -p "$wheels"
platforms=()
for p in manylinux_2_28_x86_64 manylinux_2_27_x86_64 manylinux_2_17_x86_64 manylinux2014_x86_64 manylinux1_x86_64; do
  platforms+=(--platform "$p")
done
# shellcheck disable=SC2086  # EXTRA_WHEELS is a list of requirement strings
"$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  "${platforms[@]}" -d "$wheels" "megatron-core==${MCORE_VERSION:-0.19.2}" "fla-core==${FLA_VERSION:-0.6.0}" einops \
  ${EXTRA_WHEELS:-}
# NVRx's checkpoint writer (#50 row 2's GPU check): nvidia-resiliency-ext's wheel is tagged for glibc
# >= 2.39; the code megatron-core calls is pure Python, so it is unpacked (as tools/test.sh does) into
# .gpu/nvrx, which gpu_check.sh puts on PYTHONPATH
rm -rf "$repo/.gpu/nvrx" "$repo/.gpu/nvrx.wheel"
if "$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
     --platform manylinux_2_39_x86_64 -d "$repo/.gpu/nvrx.wheel" "nvidia-resiliency-ext==${NVRX_VERSION:-0.7.0}"; then
  "$PY" -c 'import sys, zipfile, glob; zipfile.ZipFile(glob.glob(sys.argv[1] + "/*.whl")[0]).extractall(sys.argv[2])' \
    "$repo/.gpu/nvrx.wheel" "$repo/.gpu/nvrx"
else
  echo "gpu_wheels.sh: nvidia-resiliency-ext could not be fetched: the async_save step checks megatron-core's writer only" >&2
fi
rm -rf "$repo/.gpu/nvrx.wheel"
if [[ -d "$repo/../shared/gpu" ]]; then
  rm -rf "$repo/.gpu/shared"
  cp -r "$repo/../shared/gpu" "$repo/.gpu/shared"
  chmod -R u+w "$repo/.gpu/shared"
fi
ls -l "$wheels"
du -sh "$repo/.gpu"
