#!/usr/bin/env bash
# Install SGLang 0.5.23 for CPU (tests, CPU demos) into a virtual environment, idempotently.
#
# `pip install sglang` is not usable on a CPU-only machine: it pins torch==2.14.1 (a multi-GB
# CUDA build) and pulls CUDA-only packages (flashinfer, flash-attn, cuda-python, nvidia-*,
# sglang-kernel, sgl-deep-*, tilelang, torch_memory_saver, torchaudio, quack-kernels ...).
# The recipe (../shared/notes/platform.md, "SGLang on CPU"):
#   1. torch==$TORCH_VERSION (the CPU build the project uses) first;
#   2. sglang==$SGLANG_VERSION --no-deps;
#   3. its requirements, read from the wheel's METADATA, minus the CUDA-only ones (DENY below),
#      with torch held by a constraint; torchvision --no-deps (the PyPI build is a CUDA build, so
#      its compiled ops do not load: see megatron_tepo/rollout/sglang_cpu/mtepo_sglang_cpu.py);
#   4. sglang-router==$ROUTER_VERSION (the fleet's dispatcher for two or more servers);
#   5. a .pth file in the venv that puts megatron_tepo/rollout/sglang_cpu on sys.path and loads
#      the patches: the torchvision fake-op guard, the kept receive buffer of weight updates and
#      the receive straight into the parameters (a bucket layout whose loaders only copy), and
#      a stand-in `sgl_kernel` module.
#
# The venv is marked as SGLang's CPU build ($venv/.mtepo-sglang-cpu, written before anything is
# installed): a launch.device: cuda job refuses it as its SGLang python (the fit check, and
# megatron_tepo/rollout/sglang/server.py's server_command for a cuda server), naming
# MTEPO_SGLANG_PYTHON, instead of starting CPU servers with --device cuda.
#
# Default target: a SEPARATE venv <repo>/.venv-sglang, because sglang pins transformers==5.19.0
# and the project's venv uses another version. The server runs there; the project's code and tests
# run in the main venv and start servers with the sglang venv's python (MTEPO_SGLANG_PYTHON).
#
# Usage: bash tools/install_sglang_cpu.sh [VENV_DIR]    (prints the venv's python on its last line)
#   MTEPO_SGLANG_VENV=DIR   same as the argument
set -euo pipefail
repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
venv="${1:-${MTEPO_SGLANG_VENV:-$repo/.venv-sglang}}"
SGLANG_VERSION="${MTEPO_SGLANG_VERSION:-0.5.23}"
TORCH_VERSION="${MTEPO_TORCH_VERSION:-2.13.0}"
TORCHVISION_VERSION="${MTEPO_TORCHVISION_VERSION:-0.28.0}"   # the release paired with torch 2.13
ROUTER_VERSION="${MTEPO_SGLANG_ROUTER_VERSION:-0.3.2}"       # sglang-router (a Rust binary + launcher)
PYTHON="${MTEPO_SGLANG_BASE_PYTHON:-python3}"
shim_dir="$repo/megatron_tepo/rollout/sglang_cpu"

# Requirements of sglang that need CUDA (or are its CUDA kernels) and are not installed.
DENY="torch torchaudio torchcodec torchvision cuda-python flash-attn-4 flashinfer-python \
humming-kernels nvidia-cutlass-dsl nvidia-mathdx nvidia-ml-py nvshmem4py-cu13 quack-kernels \
sgl-deep-ep sgl-deep-gemm sgl-flash-mla sglang-kernel tilelang torch-memory-saver"

if [ ! -x "$venv/bin/python" ]; then
  "$PYTHON" -m venv "$venv" >&2
fi
py="$venv/bin/python"
printf 'SGLang CPU build of tools/install_sglang_cpu.sh: not for launch.device cuda\n' > "$venv/.mtepo-sglang-cpu"
stamp="$venv/.mtepo-sglang-installed"
want="sglang=$SGLANG_VERSION torch=$TORCH_VERSION tv=$TORCHVISION_VERSION router=$ROUTER_VERSION script=$(sha1sum < "${BASH_SOURCE[0]}" | cut -c1-12)"
if [ -f "$stamp" ] && [ "$(cat "$stamp")" == "$want" ]; then
  echo "$py"; exit 0
fi
t0=$(date +%s)
work="$(mktemp -d)"; trap 'rm -rf "$work"' EXIT
echo "torch==$TORCH_VERSION" > "$work/constraints.txt"
pip=("$py" -m pip install -q -c "$work/constraints.txt")
"$py" -m pip install -q --upgrade pip packaging >&2
"${pip[@]}" "torch==$TORCH_VERSION" >&2
"${pip[@]}" --no-deps "sglang==$SGLANG_VERSION" "torchvision==$TORCHVISION_VERSION" >&2
# Requirements from the installed METADATA (unconditional ones, no extras), minus DENY.
"$py" - "$DENY" > "$work/reqs.txt" <<'PY'
import sys
from importlib.metadata import requires
from packaging.requirements import Requirement
deny = set(sys.argv[1].split())
norm = lambda s: s.lower().replace("_", "-")
for line in requires("sglang") or []:
    r = Requirement(line)
    if r.marker is not None and not r.marker.evaluate({"extra": ""}):
        continue
    if norm(r.name) in deny:
        continue
    print(str(r).split(";")[0].strip())
PY
"${pip[@]}" -r "$work/reqs.txt" >&2
# sglang-router: the fleet puts it in front of two or more servers when it is importable
"${pip[@]}" "sglang-router==$ROUTER_VERSION" >&2
# The work-arounds, loaded at start-up of every python of this venv (they act only when needed).
site="$("$py" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
printf '%s\nimport mtepo_sglang_cpu\n' "$shim_dir" > "$site/mtepo_sglang_cpu.pth"
# Smoke test: the server's modules import.
SGLANG_USE_CPU_ENGINE=1 "$py" -c "import sglang.launch_server, sglang.srt.utils, torchvision, sgl_kernel, sglang_router.launch_router" >&2
t1=$(date +%s)
echo "install_sglang_cpu.sh: sglang $SGLANG_VERSION in $venv in $((t1 - t0)) s, $(du -sh "$venv" | cut -f1)" >&2
echo "$want" > "$stamp"
echo "$py"
