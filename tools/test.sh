#!/usr/bin/env bash
# The whole test suite, as CI runs it: installs what it needs (tools/setup_env.sh), then pytest.
# Extra arguments go to pytest (e.g. `bash tools/test.sh tests/algorithms -x`).
# pytest's exit code 5 ("no tests collected") is a failure here, never a silent pass.
set -euo pipefail
repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$repo"
py="$(bash tools/setup_env.sh | tail -n 1)"
# A real SGLang server on CPU for the rollout tests (marker `sglang`): its own venv, see the script.
MTEPO_SGLANG_PYTHON="$(bash tools/install_sglang_cpu.sh | tail -n 1)"
export MTEPO_SGLANG_PYTHON
export OMP_NUM_THREADS=1 MKL_NUM_THREADS=1 PYTHONUNBUFFERED=1 CUDA_VISIBLE_DEVICES=""
set +e
"$py" -m pytest -ra --timeout=900 "$@"
rc=$?
set -e
if [ "$rc" -eq 5 ]; then
  echo "tools/test.sh: pytest collected no tests (exit 5): failing" >&2
  exit 1
fi
exit "$rc"
