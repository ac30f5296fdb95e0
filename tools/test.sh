#!/usr/bin/env bash
# The whole test suite, as CI runs it: installs what it needs (tools/setup_env.sh, the SGLang CPU
# venv, a one-node Slurm cluster), then pytest.
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
# A real one-node Slurm cluster for the `slurm` tests (tools/slurm_cluster.sh: Debian's slurm +
# munge + slurmdbd/MariaDB, state in /tmp/mtepo-slurm). They are never skipped here: if the cluster
# cannot start they FAIL saying so. MTEPO_SKIP_SLURM=1 (a developer's explicit choice) skips them.
# A cluster this script starts is stopped at the end; one that was already running is reused and
# left running.
if [ "${MTEPO_SKIP_SLURM:-0}" != 1 ]; then
  unset SLURM_CONF
  if ! bash tools/slurm_cluster.sh status >/dev/null 2>&1; then
    trap 'bash tools/slurm_cluster.sh stop || true' EXIT
  fi
  if line="$(bash tools/slurm_cluster.sh start | tail -n 1)" && [[ "$line" == "export SLURM_CONF="* ]]; then
    SLURM_CONF="${line#export SLURM_CONF=}"
    export SLURM_CONF
  else
    echo "tools/test.sh: the local Slurm cluster did not start (see above): the slurm tests will fail" >&2
  fi
fi
set +e
"$py" -m pytest -ra --timeout=900 "$@"
rc=$?
set -e
if [ "$rc" -eq 5 ]; then
  echo "tools/test.sh: pytest collected no tests (exit 5): failing" >&2
  exit 1
fi
exit "$rc"
