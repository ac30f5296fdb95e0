#!/usr/bin/env bash
# The whole test suite, as CI runs it, on both ends of the supported stack range, in three lanes at
# once (run_lanes below):
#   1. newest: the whole suite in .venv, made by tools/setup_env.sh with `python3.12` where one
#      runs (megatron-core 0.19.x), else `python3`: the rest, then the loop tests that compare
#      floating point again under ATEN_CPU_CAPABILITY=default (CAPABILITY_TESTS); beside them the
#      SGLang tests, and
#   2. oldest: the actor / conversion / distributed subset (OLDEST_TESTS below) in .venv-oldest,
#      Python 3.11 with megatron-core 0.16.1 (MTEPO_OLDEST_PYTHON, default python3.11), then the
#      newest stack's journeys and Slurm tests.
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
# Left out there: the layouts whose megatron-core calls another oldest-stack test already makes (the
# newest stack runs them all). TP2 and PP2 alone: TP2xPP2 makes both calls; the trainer's TP2 and DP2
# two-process runs: its PP2 run (megatron's pipeline schedule) and the actor's TP2xPP2/DP2 tests,
# and its CP2 run: the actor's CP2 and TP2xCP2 tests; the actor's TP2xCP2 and CP2 checkpoint
# tests: its CP2 test (the same megatron-core calls for CP; TP, SP and checkpoints tested alone);
# conversion's TP2 reshard and bf16 round trip: its TP2xPP2 round trip with logits and the bf16
# actor; SmolLM2 (a Llama: the same GPTModel and mapping calls); the streaming import's EP2 case and
# the TP2 and PP2 export buckets: their TP2xPP2 and EP2 cases; one of each pair of the fast-path
# step and compile-count cases; the Qwen3-MoE EP2 conversion (its calls: the sharded load's and the
# export buckets' EP2 cases), the actor's DP2 run (the DP2 distributed-optimizer resume), CP over 3
# ranks (over 2: the same calls) and the loader's bad-HF-checkpoint messages (this package's reads,
# no megatron-core call: they run on the newest stack); the streaming import at TP2xPP2 (the TP2xPP2
# round trip's save and load), the fusions-on and fused-LM-head runs (the fast-path step's calls), r2
# (r3's router patch), the build without init (the TP2 sharded read's); LoRA at PP2 / CP2, on the experts
# at EP2 and on Qwen3.5, and the PEFT export at TP2 (LoRA at TP1 / TP2 / SP and its checkpoint's
# resharding make the adapters' megatron-core calls there); the TP1 round trip of every family (the
# TP2xPP2 round trip's GPTModel and checkpoint calls) and the converter's clean-up after an error (no
# megatron-core call).
OLDEST_DESELECT=(
  tests/checkpoint/test_convert_roundtrip.py::test_roundtrip_tp1_all_variants
  tests/checkpoint/test_convert_errors.py::test_error_after_start_removes_tmp_dir
  "tests/checkpoint/test_convert_streaming.py::test_streaming_import_equals_megatron_save[tp2pp2]"
  tests/megatron/test_actor_distributed.py::test_fusions_on_match_hf
  tests/megatron/test_actor_distributed.py::test_fused_lm_head_equals_the_materialized_one
  tests/megatron/test_routing_replay.py::test_r2_training_pass_replays_the_routing_recorded_in_the_log_prob_pass
  tests/megatron/test_sharded_load.py::test_build_without_init_keeps_megatron_tp_attributes
  tests/megatron/test_lora.py::test_lora_equals_merged_weights_at_pp2_and_cp2
  tests/megatron/test_lora.py::test_lora_equals_merged_weights_on_moe_experts_at_ep2_and_on_qwen3_5
  tests/megatron/test_lora_peft.py::test_exported_peft_adapter_loads_in_peft_as_the_merged_model_and_imports_back_equal_at_tp2
  tests/checkpoint/test_convert_roundtrip.py::test_qwen3_moe_ep2_and_ep1
  tests/megatron/test_actor_distributed.py::test_dp2_matches_hf_and_micro_batch_invariance
  "tests/megatron/test_context_parallel.py::test_context_parallel_attention_equals_one_rank[3]"
  tests/megatron/test_sharded_load.py::test_bad_checkpoint_fails_with_one_line_naming_tensor_and_file
  tests/megatron/test_actor_distributed.py::test_tp2_matches_hf
  tests/megatron/test_actor_distributed.py::test_pp2_matches_hf
  "tests/trainer/test_multiprocess.py::test_two_processes_match_one[tp2]"
  "tests/trainer/test_multiprocess.py::test_two_processes_match_one[dp2]"
  "tests/trainer/test_multiprocess.py::test_two_processes_match_one[cp2]"
  tests/megatron/test_actor_distributed.py::test_tp2_cp2_matches_hf_and_cp1
  tests/megatron/test_actor_checkpoint.py::test_resume_cp2_and_its_weights_at_cp1
  tests/checkpoint/test_convert_roundtrip.py::test_tp2_logits_and_reshard_to_tp1_and_pp2
  tests/checkpoint/test_convert_roundtrip.py::test_bf16_checkpoint_roundtrip_tp2
  tests/checkpoint/test_convert_smollm2.py::test_smollm2_pp2_logits_and_tp3_reshard
  "tests/checkpoint/test_convert_streaming.py::test_streaming_import_equals_megatron_save[ep2]"
  tests/megatron/test_export_buckets.py::test_export_buckets_tp2_bit_exact
  tests/megatron/test_export_buckets.py::test_export_buckets_pp2_reach_rank0_bit_exact
  "tests/megatron/test_launch_costs.py::test_the_fast_paths_step_equals_megatrons_own_within_rounding[bf16]"
  "tests/megatron/test_launch_costs.py::test_fusions_compile_once_for_every_packed_length[none]"
)
# The loop tests that compare two runs made on this machine (about 1 min), run again under a second
# CPU capability (below).
CAPABILITY_TESTS=(tests/trainer/test_loop.py::test_main_job_short_run
                  tests/trainer/test_colocated.py::test_colocated_main_job_equals_the_separate_run_and_resumes)

export OMP_NUM_THREADS=1 MKL_NUM_THREADS=1 PYTHONUNBUFFERED=1 CUDA_VISIBLE_DEVICES=""
# No copy of the downloaded wheels (the CUDA torch for Python 3.12 alone is about 3.5 GB) beside the
# venvs that install them: CI's disk is the venvs' (about 12 GB) and the tests' files.
export PIP_NO_CACHE_DIR="${PIP_NO_CACHE_DIR:-1}"
# What the run needs on disk, measured (docs/DEVELOPMENT.md, "Disk"): the three venvs and the tests' files at
# their peak. Less free space fails tests at random with "No space left on device" (CI once did, in
# pytest's own set-up), so it is said first, and again when a lane fails.
NEED_GB=20
free_gb() { df -Pk "$1" | awk 'NR == 2 { printf "%d", $4 / 1048576 }'; }
disk_report() {  # disk_report <when>: one line: free space where the venvs and the tests write
  local tmp="${TMPDIR:-/tmp}"
  echo "tools/test.sh: [disk, $1] $(free_gb "$repo") GB free under $repo, $(free_gb "$tmp") GB under $tmp" >&2
}

run_pytest() {  # run_pytest <label> <python> <pytest args...>: returns 0 / 1
  local label="$1" py="$2" rc start=$SECONDS
  shift 2
  echo "tools/test.sh: [$label] $("$py" -c 'import sys, importlib.metadata as m; print("Python %d.%d.%d" % sys.version_info[:3], "torch", m.version("torch"), "megatron-core", m.version("megatron-core"))')" >&2
  set +e
  # every test's duration, for finding what to cut: .test-logs/<label>.xml (JUnit XML)
  "$py" -m pytest -ra --timeout=900 --durations=25 --junitxml="$repo/.test-logs/$(tr -c 'a-zA-Z0-9=\n' _ <<<"$label").xml" "$@"
  rc=$?
  set -e
  echo "tools/test.sh: [$label] pytest exit $rc after $((SECONDS - start)) s" >&2
  if [ "$rc" -eq 5 ]; then
    echo "tools/test.sh: [$label] pytest collected no tests (exit 5): failing" >&2
    return 1
  fi
  [ "$rc" -eq 0 ]
}

# The whole suite as three pytest lanes at once. On 2 cores one lane alone leaves a core idle much
# of the time: the `slurm` and `sglang` tests spend theirs waiting on Slurm jobs and SGLang
# servers (a job's start, a server's start-up, a requeue, a probe's time-out), and most tests run
# one process. What the server tests need is made from the start, beside .venv (servers_setup).
#   first:  the rest of the newest stack, as soon as .venv is made; then the loop tests under a
#           second CPU capability;
#   second: the `sglang` tests and the `second_lane` ones (SECOND_LANE: tests moved out of the
#           first lane, which has no time to spare), once the SGLang venv is made;
#   third:  the oldest stack's venv, then its tests (when asked for), then the `journey` tests
#           (whole runs of a user's command) and the `slurm` tests (THIRD_LANE).
# The second and third lanes' output goes to .test-logs/sglang.log and .test-logs/oldest-journeys-slurm.log,
# printed after the first lane's with the installs' (.test-logs/servers-setup.log); a lane that
# fails names itself in .test-logs/failed-lanes. Extra arguments (a selection of tests): one pytest
# run of the newest stack, as they say, once the installs are done.
SECOND_LANE="(sglang or second_lane) and not slurm"
THIRD_LANE="journey and not (slurm or sglang or second_lane)"

# The oldest stack's venv (tools/setup_env.sh with MTEPO_PYTHON, default python3.11): its last line
# is the venv's python.
oldest_setup() {
  MTEPO_PYTHON="${MTEPO_OLDEST_PYTHON:-python3.11}" MTEPO_MCORE="megatron-core==0.16.1" \
    MTEPO_VENV="$repo/.venv-oldest" MTEPO_EXTRAS=dev bash tools/setup_env.sh
}
run_oldest() {  # run_oldest: makes the oldest venv, then its pytest run; returns 0 / 1
  local old_py
  old_py="$(oldest_setup | tail -n 1)" || { echo "tools/test.sh: [oldest] the venv was not made (above)" >&2; return 1; }
  run_pytest oldest "$old_py" -m "$OLDEST_MARKS" "${OLDEST_DESELECT[@]/#/--deselect=}" "${OLDEST_TESTS[@]}"
}

# What the `sglang` and `slurm` tests need besides .venv: a real SGLang server on CPU (its own venv,
# see tools/install_sglang_cpu.sh) and a real one-node Slurm cluster (tools/slurm_cluster.sh:
# Debian's slurm + munge + slurmdbd/MariaDB, state in /tmp/mtepo-slurm). They are never skipped
# here: if the cluster cannot start they FAIL saying so. MTEPO_SKIP_SLURM=1 (a developer's explicit
# choice) skips them. A cluster this script starts is stopped at the end (the trap, set by the main
# shell); one that was already running is reused and left running. It runs in the background from
# the start and writes what the tests need to know, as shell exports, to .test-logs/servers.env last.
# NVRx's asynchronous checkpoint writer, for the tests of that writer only (tests/megatron/helpers.py:
# writer_env): nvidia-resiliency-ext's wheels >= 0.5 are tagged for glibc >= 2.39 and pip will not
# install them on an older one, but the checkpoint code megatron-core calls is pure Python, so the
# PyPI wheel is unpacked into .nvrx/ and only those tests put it on their subprocesses' path.
NVRX_VERSION=0.7.0
nvrx_unpack() {  # nvrx_unpack <python>: exports MTEPO_NVRX_PATH, or says why not (the tests then skip, saying so)
  local py="$1" dir="$repo/.nvrx" tag
  tag="$("$py" -c 'import sys; print("%d.%d" % sys.version_info[:2])')"
  if [ ! -d "$dir/nvidia_resiliency_ext-$NVRX_VERSION.dist-info" ]; then
    rm -rf "$dir" "$dir.wheel"
    if ! "$py" -m pip download -q --no-deps --only-binary :all: --platform manylinux_2_39_x86_64 \
         --python-version "$tag" -d "$dir.wheel" "nvidia-resiliency-ext==$NVRX_VERSION" >&2 \
       || ! "$py" -c 'import sys, zipfile, glob; zipfile.ZipFile(glob.glob(sys.argv[1] + "/*.whl")[0]).extractall(sys.argv[2])' \
         "$dir.wheel" "$dir"; then
      echo "tools/test.sh: nvidia-resiliency-ext $NVRX_VERSION could not be fetched: NVRx's writer is not tested" >&2
      rm -rf "$dir" "$dir.wheel"
      return 0
    fi
    rm -rf "$dir.wheel"
  fi
  export MTEPO_NVRX_PATH="$dir"
}

servers_setup() {
  local sglang_py conf=""
  sglang_py="$(bash tools/install_sglang_cpu.sh | tail -n 1)"
  if [ "${MTEPO_SKIP_SLURM:-0}" != 1 ]; then
    if line="$(env -u SLURM_CONF bash tools/slurm_cluster.sh start | tail -n 1)" && [[ "$line" == "export SLURM_CONF="* ]]; then
      conf="${line#export SLURM_CONF=}"
    else
      echo "tools/test.sh: the local Slurm cluster did not start (see above): the slurm tests will fail" >&2
    fi
  fi
  { printf 'export MTEPO_SGLANG_PYTHON=%q\n' "$sglang_py"
    if [ -n "$conf" ]; then printf 'export SLURM_CONF=%q\n' "$conf"; fi
  } >"$repo/.test-logs/servers.env.tmp"
  mv "$repo/.test-logs/servers.env.tmp" "$repo/.test-logs/servers.env"
}
servers_ready() {  # in any lane: waits for servers_setup (pid $servers_pid), then takes its exports; returns 0 / 1
  while [ ! -f "$repo/.test-logs/servers.env" ] && kill -0 "$servers_pid" 2>/dev/null; do sleep 2; done
  if [ ! -f "$repo/.test-logs/servers.env" ]; then
    echo "tools/test.sh: the SGLang venv or the Slurm cluster was not made: $repo/.test-logs/servers-setup.log" >&2
    return 1
  fi
  # shellcheck disable=SC1091
  source "$repo/.test-logs/servers.env"
}

run_lanes() {  # run_lanes <python> [pytest args...]: appends to failed
  local py="$1" logs="$repo/.test-logs" second third start=$SECONDS lane
  shift
  if [ "$#" -gt 0 ]; then
    servers_ready && run_pytest newest "$py" "$@" || failed+=(newest)
    return
  fi
  : >"$logs/failed-lanes"
  { servers_ready && run_pytest "newest: $SECOND_LANE" "$py" -m "$SECOND_LANE" \
      || echo "newest: $SECOND_LANE" >>"$logs/failed-lanes"; } >"$logs/sglang.log" 2>&1 &
  second=$!
  {
    if [[ ",$stacks," == *",oldest,"* ]]; then
      run_oldest || echo oldest >>"$logs/failed-lanes"
    fi
    run_pytest "newest: journey" "$py" -m "$THIRD_LANE" || echo "newest: journey" >>"$logs/failed-lanes"
    servers_ready && run_pytest "newest: slurm" "$py" -m slurm || echo "newest: slurm" >>"$logs/failed-lanes"
  } >"$logs/oldest-journeys-slurm.log" 2>&1 &
  third=$!
  echo "tools/test.sh: beside the rest: [$SECOND_LANE] (pid $second) in $logs/sglang.log;" \
       "[the oldest stack, the journeys, slurm] (pid $third) in $logs/oldest-journeys-slurm.log" >&2
  run_pytest "newest: the rest" "$py" -m "not (slurm or sglang or journey or second_lane)" || failed+=(newest)
  # The loop tests that compare two runs' floating point, once more under torch's portable CPU
  # kernels (ATEN_CPU_CAPABILITY=default: other rounding than this machine's vectorised ones), so a
  # test that holds only on one CPU's rounding fails here rather than on the next machine.
  ATEN_CPU_CAPABILITY=default run_pytest "newest, ATEN_CPU_CAPABILITY=default" "$py" "${CAPABILITY_TESTS[@]}" \
    || failed+=("newest (ATEN_CPU_CAPABILITY=default)")
  wait "$second" || true
  wait "$third" || true
  for lane in servers-setup sglang oldest-journeys-slurm; do
    echo "tools/test.sh: ---- $logs/$lane.log ----" >&2
    cat "$logs/$lane.log" >&2
  done
  while IFS= read -r lane; do failed+=("$lane"); done <"$logs/failed-lanes"
  echo "tools/test.sh: [lanes] done after $((SECONDS - start)) s" >&2
}

# Debian's bubblewrap, which the Python tool's sandbox runs tool code in (tests/environments: they FAIL
# without it, saying so; MTEPO_ALLOW_NO_BWRAP=1 skips them instead). Installed here as root with
# apt-get (tools/install_bubblewrap.sh, which the tool example's run.sh calls too); elsewhere one line
# says what to run.
bubblewrap_install() {
  bash "$repo/tools/install_bubblewrap.sh" tools/test.sh "the sandbox tests will fail" || true
}

failed=()
mkdir -p "$repo/.test-logs"
disk_report start
bubblewrap_install
if [ "$(free_gb "$repo")" -lt "$NEED_GB" ] || [ "$(free_gb "${TMPDIR:-/tmp}")" -lt "$NEED_GB" ]; then
  echo "tools/test.sh: warning: less than the $NEED_GB GB free that the venvs and the tests need: expect 'No space left on device'" >&2
fi
if [[ ",$stacks," == *",newest,"* ]]; then
  if [ "${MTEPO_SKIP_SLURM:-0}" != 1 ] && ! bash tools/slurm_cluster.sh status >/dev/null 2>&1; then
    trap 'bash tools/slurm_cluster.sh stop || true' EXIT
  fi
  rm -f "$repo/.test-logs/servers.env"
  servers_setup >"$repo/.test-logs/servers-setup.log" 2>&1 &
  servers_pid=$!
  py="$(bash tools/setup_env.sh | tail -n 1)"
  nvrx_unpack "$py"
  run_lanes "$py" "$@"
  wait "$servers_pid" || true
elif [[ ",$stacks," == *",oldest,"* ]]; then
  run_oldest || failed+=(oldest)
fi
if [ "${#failed[@]}" -gt 0 ]; then
  disk_report end
  echo "tools/test.sh: FAILED on: ${failed[*]}" >&2
  exit 1
fi
echo "tools/test.sh: passed on: $stacks" >&2
