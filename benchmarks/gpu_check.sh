#!/usr/bin/env bash
# The GPU check in one command, for a machine with one CUDA GPU (issue #22, item 3). Run it from the
# repository root there:
#
#     bash benchmarks/gpu_check.sh
#
# 1. Installs the wheels that benchmarks/gpu_wheels.sh put in .gpu/wheels (megatron-core, and any
#    other that machine lacks) with `pip install --no-index --no-deps --target /tmp/site`, skipping
#    those whose distribution is already installed, and puts /tmp/site and the checkout on
#    PYTHONPATH. Without .gpu/wheels it goes on if megatron.core imports.
# 2. Runs the steps of benchmarks/gpu_check.py in order, each in its own process with its own time
#    limit (and the whole check under GPU_CHECK_BUDGET_S, default 540 s): tests, actor_step,
#    vocab_op, lm_head, disk_sync, ipc_handles (the export buffer opened by CUDA IPC from a second process,
#    with the trainer's expandable segments on), hf_load, main_job, async_save (a save through each writer with
#    expandable segments on: the staging it took), routing_replay (r3 and r2 on a tiny Qwen3-MoE), qwen3_5
#    (flash-linear-attention's Gated DeltaNet kernels and the actor's stand-in against transformers, forward
#    and backward; a small Qwen3.5 on HybridModel against transformers, log-probs and every weight's gradient;
#    its bf16 train step beside the same-size dense Qwen3's, time and peak memory). NVRx's
#    checkpoint code, unpacked by gpu_wheels.sh in .gpu/nvrx, goes on PYTHONPATH. Each step's output goes to OUT/<step>.log and one JSON
#    line to OUT/summary.jsonl; a failing step does not stop the next.
# 3. Prints the figures and the targets (PASS / MISS) and writes them to OUT/report.md.
# Exits 0 when every step ran and passed its own checks, 1 otherwise (a target's MISS alone does not
# fail the check: it is a measurement).
#
# Environment: OUT (default outputs/gpu_check; at most 13 files land there: the eleven step logs,
# summary.jsonl, report.md), PYTHON (default python3), GPU_CHECK_STEPS (comma list, default all, run
# in that order), GPU_CHECK_PACK=1 (the step logs end packed in OUT/logs.tgz: the device tool brings
# back at most 8 files),
# GPU_CHECK_SMOKE=1 (the CPU smoke version: tiny shapes, CUDA hidden, targets not judged; what the
# test suite runs), GPU_CHECK_WHEELS (default .gpu/wheels), GPU_CHECK_SITE (default /tmp/site),
# GPU_CHECK_BUDGET_S.
# Leaves out: multi-GPU layouts, SGLang and Transformer Engine (none is on the lent GPU machine).
set -uo pipefail

repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$repo" || exit 1
PY="${PYTHON:-python3}"
OUT="${OUT:-outputs/gpu_check}"
mkdir -p "$OUT"
OUT="$(cd "$OUT" && pwd)"
smoke_flag=()
if [[ "${GPU_CHECK_SMOKE:-0}" == "1" ]]; then
  smoke_flag=(--smoke)
  export CUDA_VISIBLE_DEVICES=""
fi
steps="${GPU_CHECK_STEPS:-tests,actor_step,vocab_op,lm_head,disk_sync,ipc_handles,hf_load,main_job,async_save,routing_replay,qwen3_5}"
budget="${GPU_CHECK_BUDGET_S:-540}"
start=$SECONDS
export PYTHONUNBUFFERED=1
for f in summary.jsonl report.md tests.log actor_step.log vocab_op.log lm_head.log disk_sync.log ipc_handles.log hf_load.log main_job.log async_save.log routing_replay.log qwen3_5.log; do
  rm -f "${OUT:?}/$f"
done

# each step's own limit, seconds (the budget may cut it shorter)
declare -A limit=([tests]=150 [actor_step]=240 [vocab_op]=90 [lm_head]=90 [disk_sync]=60 [ipc_handles]=60 [hf_load]=90 [main_job]=150 [async_save]=90 [routing_replay]=240 [qwen3_5]=240)
if [[ ${#smoke_flag[@]} -gt 0 ]]; then
  for k in "${!limit[@]}"; do limit[$k]=600; done
  budget="${GPU_CHECK_BUDGET_S:-3000}"
fi

# --- 1. wheels
note=""
site="${GPU_CHECK_SITE:-/tmp/site}"
wheels="${GPU_CHECK_WHEELS:-.gpu/wheels}"
if compgen -G "$wheels/*.whl" >/dev/null; then
  todo=()
  while IFS= read -r whl; do
    # (smoke: CUDA is hidden, so flash-linear-attention's Triton kernels cannot run; transformers and
    # megatron-core would take them if fla imported)
    [[ ${#smoke_flag[@]} -gt 0 && "${whl##*/}" == fla_core-* ]] && continue
    [[ -n "$whl" ]] && todo+=("$whl")
  done < <("$PY" benchmarks/gpu_check.py missing-wheels "$wheels")
  if [[ ${#todo[@]} -gt 0 ]]; then
    if "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$site" "${todo[@]}"; then
      note="installed into $site: ${todo[*]##*/}"
    else
      note="pip install of ${todo[*]##*/} failed"
    fi
  else
    note="every wheel in $wheels is installed already"
  fi
  export PYTHONPATH="$site:$repo${PYTHONPATH:+:$PYTHONPATH}"
else
  note="no $wheels/*.whl (run benchmarks/gpu_wheels.sh on the CPU machine, carry .gpu): using what is installed"
  export PYTHONPATH="$repo${PYTHONPATH:+:$PYTHONPATH}"
fi
if [[ -d .gpu/nvrx/nvidia_resiliency_ext ]]; then  # NVRx's checkpoint code (pure Python), unpacked by gpu_wheels.sh
  export PYTHONPATH="$repo/.gpu/nvrx:$PYTHONPATH"
  note="$note; NVRx from .gpu/nvrx"
fi
echo "[gpu_check] $note"
"$PY" benchmarks/gpu_check.py setup --out "$OUT" "${smoke_flag[@]}" --note "$note" >/dev/null 2>&1
echo "[gpu_check] setup: $(tail -n 1 "$OUT/summary.jsonl")"

# --- 2. the steps
IFS=',' read -r -a step_list <<< "$steps"
for step in "${step_list[@]}"; do
  left=$(( budget - (SECONDS - start) ))
  t=${limit[$step]:-120}
  (( t > left )) && t=$left
  log="$OUT/$step.log"
  if (( t < 10 )); then
    "$PY" benchmarks/gpu_check.py record "$step" --out "$OUT" "${smoke_flag[@]}" \
      --error "not run: the check's time budget (${budget}s) is spent" >/dev/null
    echo "[gpu_check] $step: SKIPPED (no time left)"
    continue
  fi
  echo "[gpu_check] $step (limit ${t}s) -> $log"
  before=$(wc -l < "$OUT/summary.jsonl")
  t0=$SECONDS
  timeout --kill-after=15 "$t" "$PY" benchmarks/gpu_check.py step "$step" --out "$OUT" "${smoke_flag[@]}" >"$log" 2>&1
  rc=$?
  if (( $(wc -l < "$OUT/summary.jsonl") == before )); then
    why="exit status $rc"
    (( rc == 124 || rc == 137 )) && why="killed at its ${t}s limit"
    "$PY" benchmarks/gpu_check.py record "$step" --out "$OUT" "${smoke_flag[@]}" --seconds $(( SECONDS - t0 )) \
      --error "$why (see $step.log): $(tail -n 3 "$log" | tr '\n' ' ' | cut -c1-300)" >/dev/null
  fi
  echo "[gpu_check] $step: $(tail -n 1 "$OUT/summary.jsonl" | cut -c1-400)"
done

# --- 3. the report
echo
"$PY" benchmarks/gpu_check.py report "$OUT" --steps "$steps"
rc=$?
echo "[gpu_check] $(( SECONDS - start ))s in all; results in $OUT"
if [[ "${GPU_CHECK_PACK:-0}" == "1" ]]; then  # the device tool brings back at most 8 files
  (cd "$OUT" && tar czf logs.tgz ./*.log && rm -f ./*.log) && echo "[gpu_check] step logs packed into $OUT/logs.tgz"
fi
exit $rc
