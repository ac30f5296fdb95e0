#!/usr/bin/env bash
# The whole test suite, as CI runs it, on both ends of the supported stack range:
#   1. newest: the whole suite in .venv, made by tools/setup_env.sh with `python3.12` where one
#      runs (megatron-core 0.19.x), else `python3`, in two lanes at once (run_lanes below): the
#      server and Slurm tests beside the rest;
#   2. after the rest, in the same lane: the loop tests that compare floating point again under
#      ATEN_CPU_CAPABILITY=default (CAPABILITY_TESTS), then
#   3. oldest: the actor / conversion / distributed subset (OLDEST_TESTS below) in .venv-oldest,
#      Python 3.11 with megatron-core 0.16.1 (MTEPO_OLDEST_PYTHON, default python3.11), its venv
#      made in the background meanwhile.
# It installs what it needs (tools/setup_env.sh for both, the SGLang CPU venv, a one-node Slurm
# cluster), then runs pytest on each stack. It exits non-zero when either run fails; pytest's
# exit code 5 ("no tests collected") is a failure here, never a silent pass.
# Extra arguments make the newest stack one pytest run of what they select (e.g. `bash tools/test.sh tests/algorithms -x`).
# MTEPO_STACKS=newest (or oldest) runs only that one (default: newest,oldest).
set -euo pipefail
repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$repo"
stacks="${MTEPO_STACKS:-newest,oldest}"
# The oldest stack's share: the actor, the megatron glue (CPU patches at their versions), the
# checkpoint conversion, megatron's RoPE and the vocab op's kernels, and the TP/PP/DP trainer runs --
# everything that calls megatron-core (the vocab-parallel op itself is pure torch: newest only). The rest (algorithms, rewards, launchers, SGLang) does not depend on it.
OLDEST_TESTS=(tests/megatron tests/checkpoint tests/ops/test_rope.py tests/ops/test_vocab_triton.py
              tests/trainer/test_multiprocess.py tests/launch/test_fit_check_quiet.py)
OLDEST_MARKS="not sglang and not slurm"
# The loop tests that compare two runs made on this machine (about 1 min), run again under a second
# CPU capability (below).
CAPABILITY_TESTS=(tests/trainer/test_loop.py::test_main_job_short_run
                  tests/trainer/test_colocated.py::test_colocated_main_job_equals_the_separate_run_and_resumes)

export OMP_NUM_THREADS=1 MKL_NUM_THREADS=1 PYTHONUNBUFFERED=1 CUDA_VISIBLE_DEVICES=""

run_pytest() {  # run_pytest <label> <python> <pytest args...>: returns 0 / 1
  local label="$1" py="$2" rc start=$SECONDS
  shift 2
  echo "tools/test.sh: [$label] $("$py" -c 'import sys, importlib.metadata as m; print("Python %d.%d.%d" % sys.version_info[:3], "torch", m.version("torch"), "megatron-core", m.version("megatron-core"))')" >&2
  set +e
  "$py" -m pytest -ra --timeout=900 --durations=25 "$@"
  rc=$?
  set -e
  echo "tools/test.sh: [$label] pytest exit $rc after $((SECONDS - start)) s" >&2
  if [ "$rc" -eq 5 ]; then
    echo "tools/test.sh: [$label] pytest collected no tests (exit 5): failing" >&2
    return 1
  fi
  [ "$rc" -eq 0 ]
}

# The newest stack's suite as two pytest runs at the same time: the `slurm` and `sglang` tests (their
# time goes to Slurm jobs and SGLang servers, and much of it to waiting on them: a job's start, a
# server's start-up, a requeue, a probe's time-out), with the `journey` tests to even the two out,
# beside all the others, which keep the CPUs busy. On 2 cores one run after the other leaves a core
# idle about a third of the time. The second run's output goes to .test-logs/newest-servers.log and
# is printed after the first run's. Extra arguments (a selection of tests): one pytest run, as they
# say.
SECOND_LANE="slurm or sglang or journey"

# The oldest stack's venv (tools/setup_env.sh with MTEPO_PYTHON, default python3.11), made in the
# background from the start: its installs overlap the newest stack's (log: .test-logs/oldest-setup.log).
oldest_setup() {
  MTEPO_PYTHON="${MTEPO_OLDEST_PYTHON:-python3.11}" MTEPO_MCORE="megatron-core==0.16.1" \
    MTEPO_VENV="$repo/.venv-oldest" MTEPO_EXTRAS=dev bash tools/setup_env.sh
}
run_oldest() {  # run_oldest: waits for the oldest venv, then its pytest run; returns 0 / 1
  local old_py
  if [ -n "${oldest_setup_pid:-}" ]; then
    wait "$oldest_setup_pid" || { cat "$repo/.test-logs/oldest-setup.log" >&2; echo "tools/test.sh: [oldest] the venv was not made (above)" >&2; return 1; }
    old_py="$(tail -n 1 "$repo/.test-logs/oldest-setup.log")"
  else
    old_py="$(oldest_setup | tail -n 1)"
  fi
  run_pytest oldest "$old_py" -m "$OLDEST_MARKS" "${OLDEST_TESTS[@]}"
}

# The whole suite in two lanes at once: the second lane (SECOND_LANE, its output in
# .test-logs/newest-servers.log, printed after the first's) beside the first, which runs the rest of
# the newest stack, then the loop tests under a second CPU capability, then (when asked for) the
# oldest stack. Extra arguments (a selection of tests): one pytest run of the newest stack, as they say.
run_lanes() {  # run_lanes <python> [pytest args...]: appends to failed
  local py="$1" log="$repo/.test-logs/newest-servers.log" label="newest: $SECOND_LANE" pid start=$SECONDS
  shift
  if [ "$#" -gt 0 ]; then
    run_pytest newest "$py" "$@" || failed+=(newest)
    return
  fi
  run_pytest "$label" "$py" -m "$SECOND_LANE" >"$log" 2>&1 &
  pid=$!
  echo "tools/test.sh: [$label] running beside the rest (pid $pid): $log" >&2
  run_pytest "newest: the rest" "$py" -m "not ($SECOND_LANE)" || failed+=(newest)
  # The loop tests that compare two runs' floating point, once more under torch's portable CPU
  # kernels (ATEN_CPU_CAPABILITY=default: other rounding than this machine's vectorised ones), so a
  # test that holds only on one CPU's rounding fails here rather than on the next machine.
  ATEN_CPU_CAPABILITY=default run_pytest "newest, ATEN_CPU_CAPABILITY=default" "$py" "${CAPABILITY_TESTS[@]}" \
    || failed+=("newest (ATEN_CPU_CAPABILITY=default)")
  if [[ ",$stacks," == *",oldest,"* ]]; then
    run_oldest || failed+=(oldest)
  fi
  wait "$pid" || failed+=("newest: second lane")
  echo "tools/test.sh: ---- [$label], its output ($log) ----" >&2
  cat "$log" >&2
  echo "tools/test.sh: [lanes] done after $((SECONDS - start)) s" >&2
}

failed=()
mkdir -p "$repo/.test-logs"
if [[ ",$stacks," == *",newest,"* ]]; then
  py="$(bash tools/setup_env.sh | tail -n 1)"
  if [[ ",$stacks," == *",oldest,"* && "$#" -eq 0 ]]; then  # (after the newest's editable install of this checkout)
    oldest_setup >"$repo/.test-logs/oldest-setup.log" 2>&1 &
    oldest_setup_pid=$!
  fi
  # A real SGLang server on CPU for the rollout tests (marker `sglang`): its own venv, see the script.
  MTEPO_SGLANG_PYTHON="$(bash tools/install_sglang_cpu.sh | tail -n 1)"
  export MTEPO_SGLANG_PYTHON
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
  run_lanes "$py" "$@"
elif [[ ",$stacks," == *",oldest,"* ]]; then
  run_oldest || failed+=(oldest)
fi
if [ "${#failed[@]}" -gt 0 ]; then
  echo "tools/test.sh: FAILED on: ${failed[*]}" >&2
  exit 1
fi
echo "tools/test.sh: passed on: $stacks" >&2
