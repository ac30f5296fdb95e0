# shellcheck shell=bash
# Shared shell functions of the Slurm launchers (slurm/<model>_tepo.sh source this file).
#
# One job = the Megatron actor on the first ACTOR nodes of the allocation + an SGLang fleet on the
# next ROLLOUT nodes, or on the actor nodes themselves: with launch.rollout.placement: colocated on
# their GPUs, taking turns with the actor for the memory (slurm/qwen3_14b_tepo_colocated.sh), or on
# CPU with launch.rollout_nodes: 0 beside the trainer (the tiny CPU job of slurm/local_cpu_tepo.sh).
# tepo_main runs the fit check, then the steps it names in FIT_STEPS, in their order: the launch sequence of
# megatron_tepo/launch/sequence.py, which the nemo-run launcher follows too. Each step NAME is the
# function tepo_step_NAME here:
#   fit check (tools/fit_check.py): per-GPU memory of the actor and the servers (CPU: the layout
#      rules only); a misfit stops the job before any srun, with the setting to change. It also
#      writes the RunConfig the trainer reads ($RUN_DIR/run.yaml) and the FIT_* variables (node
#      counts, the steps, the servers' options, ...). On cuda it also checks the two pythons
#      (megatron_tepo/launch/pythons.py): a trainer python (TEPO_PYTHON) with a CPU build of torch,
#      or without Transformer Engine where the layout needs it, and an SGLang python
#      (MTEPO_SGLANG_PYTHON) that is SGLang's CPU build stop the job there, in one line naming the
#      variable to set.
#   split_nodes: the node split (tepo_split_nodes);
#   job_env: the job's NCCL network settings (tepo_nccl_env), the servers' API key (tepo_api_key),
#      the signal traps (tepo_install_traps);
#   servers: the rollout servers with srun on the rollout nodes (GPUS_PER_NODE / TP servers per
#      node, one port each; tepo_start_sglang). A server that exits is started again on its port
#      (tepo_keep_serving: TEPO_SERVER_RESTARTS times, with a back-off; colocated, only while the
#      trainer's weight sync opens TEPO_SGLANG_RESTART_GATE); the trainer's fleet waits for it
#      (fault.server_return_timeout_s) and re-syncs its weights. Each server is the serve
#      command of the launch file's servers (`python -m megatron_tepo.rollout.sglang.server` and
#      FIT_SERVE_ARGS, one server's options written by their own type,
#      megatron_tepo/rollout/sglang/options.py's ServerConfig, which the serve command reads back
#      and turns into SGLang's command line with server_command, shared with the SGLang fleet);
#   health: a wait for every server's /health (tepo_wait_health). Neither this nor servers when the
#      run's rollout.engine (FIT_ENGINE) is not the engine the launch serves: the embedded engine
#      generates inside the trainer;
#   release: colocated launches only: every server releases its memory (FIT_RELEASE_TAGS: weights,
#      KV cache, CUDA graphs; `python -m megatron_tepo.launch.release`, the API key from the
#      environment) before the trainer starts, so that the actor is built on free GPUs; the trainer
#      gets TEPO_SGLANG_RELEASED (the fleet's initial state);
#   trainer: srun (one task per actor node) + torchrun, c10d rendezvous on the first actor node
#      (torchrun --standalone when there is one actor node); the servers' URLs are passed in
#      TEPO_SGLANG_URLS. The trainer's own settings (tepo_trainer_env: OMP threads,
#      CUDA_DEVICE_MAX_CONNECTIONS, NCCL error handling, PYTORCH_CUDA_ALLOC_CONF) are set in this
#      step only, never in the servers'. Its status is the job's (a failure may requeue it).
# Devices (launch.device, FIT_DEVICE): cuda -> srun steps get --gpus-per-node, each server its
# CUDA_VISIBLE_DEVICES (colocated: --overlap too, so that the servers' step and the trainer's share
# the node's GPUs); cpu -> no GPU arguments, every srun step gets --overlap so that the SGLang
# step and the trainer step share the job's CPUs side by side, one OMP thread per trainer process.
# Every step gets --cpus-per-task=<the node's CPUs> (tepo_srun_args).
# API key: every server requires TEPO_SGLANG_API_KEY (the user's, else a random one per job), which
# the steps get in their environment (tepo_api_key); /health answers without it.
# Preemption: the scripts carry `#SBATCH --requeue` and `#SBATCH --signal=B:USR1@120`; USR1
# (the time limit is near, or a site's preemption notice) reaches this batch shell, which stops the
# job steps and runs `scontrol requeue`. TERM (scancel, or Slurm's own preemption, which requeues a
# --requeue job by itself) only stops the steps: a cancelled job is not resubmitted.
# Failures (tepo_requeue_after_failure): when the trainer step exits non-zero, the job requeues
# itself (`scontrol requeue`) unless the trainer's exit-reason file forbids it or the job was
# requeued after a failure TEPO_MAX_REQUEUES times already (a marker in each such attempt's log
# folder; time-limit requeues do not count). Every rank of the trainer may write one JSON line to
# $LOG_DIR/exit_reason.json[.rank<r>] (TEPO_EXIT_REASON_FILE; its stack dumps go to
# $LOG_DIR/stacks.rank<r>.txt): "requeue": true from the hang watchdog (fault.watchdog_*_s, exit 75),
# "requeue": false from a run that stopped updating (fault.max_steps_without_update, exit 3) or a
# bad setting or input (exit 2), which would only fail again. No file (a crash, a lost node, an
# srun failure): requeued. torchrun reports any rank's failure as status 1, hence the file.
# A node failure (NODE_FAIL) that kills this shell too is requeued by Slurm itself (--requeue).
# Every requeued attempt starts again from step 1 of this script and the trainer resumes from the
# newest complete checkpoint in train.output_dir (train.resume: true), which must be on a shared
# file system; docs/FAULT_TOLERANCE.md.
# Logs: $OUTPUT_DIR/logs/<job id>.<restart count>/{fit.log, sglang.<node>.<i>.log, trainer.log}.
#
# Settings (environment; unset ones come from the launch file through the fit check):
#   ACTOR_NODES, ROLLOUT_NODES  node counts (launch.actor_nodes / launch.rollout_nodes)
#   MODEL_PATH                  HF checkpoint directory (model.path)
#   TRAIN_FILES                 YAML list for data.train_files, e.g. "[/data/dapo.parquet]"
#   OUTPUT_DIR                  train.output_dir (checkpoints, metrics, logs)
#   TEPO_NODELIST               space-separated host names instead of SLURM_JOB_NODELIST
#   TEPO_PYTHON                 python with megatron_tepo (default: .venv/bin/python, else python3:
#                               tepo_python, which the nemo-run launcher runs too); on cuda it needs a
#                               CUDA build of torch (and TE for sequence parallelism)
#   TEPO_SRUN_ARGS              srun arguments per step (default: --gpus-per-node=<gpus> on cuda,
#                               --overlap on cpu); --cpus-per-task is added unless it has one
#   TEPO_CPUS_PER_NODE          CPUs of every step on each node (default: the job's, from
#                               SLURM_JOB_CPUS_PER_NODE / SLURM_CPUS_ON_NODE; steps do not inherit them)
#   MTEPO_SGLANG_PYTHON         the python with sglang (default .venv-sglang/bin/python, else TEPO_PYTHON
#                               if it imports sglang); read by the serve command; on
#                               cuda not SGLang's CPU build (tools/install_sglang_cpu.sh marks its venv)
#   PYTORCH_CUDA_ALLOC_CONF     the trainer's allocator (cuda; default expandable_segments:True)
#   TEPO_SGLANG_API_KEY         the API key every server requires (the trainer reads the same
#                               variable); unset: a random one per job. Passed to the steps in the
#                               environment only (no command line shows it, nor a dry run)
#   TEPO_HEALTH_TIMEOUT         seconds to wait for the SGLang servers (default 1800)
#   TEPO_SERVER_RESTARTS        restarts of each SGLang server that exits (default 3; 0: none)
#   TEPO_SERVER_RESTART_DELAY   seconds before the k-th restart of a server: k x this (default 10)
#   TEPO_MAX_REQUEUES           requeues of the job after a failed trainer (default 3; 0: none);
#                               time-limit / preemption requeues do not count
#   TEPO_RDZV_PORT              torchrun rendezvous port (default 29500; one actor node and unset:
#                               torchrun --standalone picks a free one)
#   TEPO_DRY_RUN=1              print the srun commands instead of running them
# Extra arguments of the script are dotted RunConfig overrides (train.steps=10 ...).

TEPO_ROOT=${TEPO_ROOT:-$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)}

tepo_log() {
    printf '[tepo %s] %s\n' "$(date +%H:%M:%S)" "$*" >&2
}

tepo_die() {
    tepo_log "ERROR: $*"
    exit 1
}

tepo_python() {
    if [[ -n "${TEPO_PYTHON:-}" ]]; then
        printf '%s\n' "$TEPO_PYTHON"
    elif [[ -x "$TEPO_ROOT/.venv/bin/python" ]]; then
        printf '%s\n' "$TEPO_ROOT/.venv/bin/python"
    else
        printf '%s\n' python3
    fi
}

# The allocation's host names, one per line: TEPO_NODELIST (space-separated) if set, else
# `scontrol show hostnames $SLURM_JOB_NODELIST`.
tepo_hostnames() {
    if [[ -n "${TEPO_NODELIST:-}" ]]; then
        local host
        for host in $TEPO_NODELIST; do printf '%s\n' "$host"; done
    elif [[ -n "${SLURM_JOB_NODELIST:-}" ]] && command -v scontrol >/dev/null 2>&1; then
        scontrol show hostnames "$SLURM_JOB_NODELIST"
    else
        tepo_log "no node list: set TEPO_NODELIST or run inside a Slurm job (SLURM_JOB_NODELIST + scontrol)"
        return 1
    fi
}

# tepo_split_nodes ACTOR_COUNT ROLLOUT_COUNT: set the arrays TEPO_ACTOR_HOSTS (the first
# ACTOR_COUNT hosts) and TEPO_ROLLOUT_HOSTS (the next ROLLOUT_COUNT; ROLLOUT_COUNT 0: the actor
# hosts themselves, colocated); fails when the allocation has fewer hosts or a count is not an
# integer (>= 1 actor, >= 0 rollout). Extra hosts stay unused (logged).
tepo_split_nodes() {
    local actor=$1 rollout=$2
    local -a hosts
    [[ "$actor" =~ ^[1-9][0-9]*$ ]] || { tepo_log "actor node count must be a positive integer, got '$actor'"; return 1; }
    [[ "$rollout" =~ ^(0|[1-9][0-9]*)$ ]] || { tepo_log "rollout node count must be a non-negative integer (0: colocated), got '$rollout'"; return 1; }
    mapfile -t hosts < <(tepo_hostnames) || return 1
    if (( ${#hosts[@]} == 0 )); then
        tepo_log "the node list is empty"
        return 1
    fi
    if (( ${#hosts[@]} < actor + rollout )); then
        tepo_log "the allocation has ${#hosts[@]} node(s) but ACTOR_NODES=$actor + ROLLOUT_NODES=$rollout are needed"
        return 1
    fi
    if (( ${#hosts[@]} > actor + rollout )); then
        tepo_log "${#hosts[@]} nodes allocated, $((actor + rollout)) used: ${hosts[*]:actor+rollout}"
    fi
    TEPO_ACTOR_HOSTS=("${hosts[@]:0:actor}")
    if ((rollout == 0)); then
        TEPO_ROLLOUT_HOSTS=("${TEPO_ACTOR_HOSTS[@]}")
    else
        TEPO_ROLLOUT_HOSTS=("${hosts[@]:actor:rollout}")
    fi
}

# The job's own settings, exported to every step (the SGLang servers' too): NCCL's network
# settings, which both ends of the weight sync's NCCL group share; on CPU, no visible GPU. Values
# already in the environment win. The trainer's settings are tepo_trainer_env's, not these.
tepo_nccl_env() {
    if [[ "${FIT_DEVICE:-cuda}" == cpu ]]; then
        export CUDA_VISIBLE_DEVICES=""
        return 0
    fi
    export NCCL_DEBUG=${NCCL_DEBUG:-WARN}
    export NCCL_IB_TIMEOUT=${NCCL_IB_TIMEOUT:-22}
    # NCCL_SOCKET_IFNAME / NCCL_IB_HCA are site-specific: set them in the environment if needed.
}

# The trainer step's settings, one NAME=VALUE a line, which tepo_start_trainer puts in front of
# torchrun (`env NAME=VALUE ...`) and the nemo-run launcher's step-trainer sets: the trainer's
# only, so that no SGLang server inherits them (its scheduler would run 8 OMP threads and one CUDA
# connection, and SGLang refuses expandable segments where it shares memory by CUDA IPC). Values
# already in the environment win; PYTORCH_CUDA_ALLOC_CONF only when it is unset (empty counts as
# set: torch's defaults). CPU: one OMP / MKL thread per process.
tepo_trainer_env() {
    if [[ "${FIT_DEVICE:-cuda}" == cpu ]]; then
        printf '%s\n' "OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}" "MKL_NUM_THREADS=${MKL_NUM_THREADS:-1}"
        return 0
    fi
    printf '%s\n' \
        "NCCL_ASYNC_ERROR_HANDLING=${NCCL_ASYNC_ERROR_HANDLING:-1}" \
        "TORCH_NCCL_ASYNC_ERROR_HANDLING=${TORCH_NCCL_ASYNC_ERROR_HANDLING:-1}" \
        "CUDA_DEVICE_MAX_CONNECTIONS=${CUDA_DEVICE_MAX_CONNECTIONS:-1}" \
        "OMP_NUM_THREADS=${OMP_NUM_THREADS:-8}" \
        "PYTORCH_CUDA_ALLOC_CONF=${PYTORCH_CUDA_ALLOC_CONF-expandable_segments:True}"
    # CUDA_DEVICE_MAX_CONNECTIONS=1: megatron's TP/SP communication order; expandable segments:
    # packed micro-batches change size every step, which fragments the caching allocator
}

# tepo_fit_check LAUNCH_FILE [OVERRIDE...]: run the fit check (stops the job on a misfit), write
# $RUN_DIR/run.yaml and load the FIT_* variables.
tepo_fit_check() {
    local launch_file=$1
    shift
    local -a ov=("$@")
    [[ -n "${ACTOR_NODES:-}" ]] && ov+=("launch.actor_nodes=$ACTOR_NODES")
    [[ -n "${ROLLOUT_NODES:-}" ]] && ov+=("launch.rollout_nodes=$ROLLOUT_NODES")
    [[ -n "${MODEL_PATH:-}" ]] && ov+=("model.path=$MODEL_PATH")
    [[ -n "${TRAIN_FILES:-}" ]] && ov+=("data.train_files=$TRAIN_FILES")
    [[ -n "${OUTPUT_DIR:-}" ]] && ov+=("train.output_dir=$OUTPUT_DIR")
    mkdir -p "$RUN_DIR"
    local env_file="$RUN_DIR/fit.env"
    local -a dry=()
    # a dry run previews: what a real run would refuse of the pythons is one line, and it goes on
    [[ "${TEPO_DRY_RUN:-0}" == 1 ]] && dry=(--dry-run)
    if ! "$(tepo_python)" "$TEPO_ROOT/tools/fit_check.py" --config "$launch_file" \
            --write-run-config "$RUN_DIR/run.yaml" --print-shell --trainer-python "$(tepo_python)" "${dry[@]}" "${ov[@]}" \
            >"$env_file" 2>"$RUN_DIR/fit.log"; then
        cat "$RUN_DIR/fit.log" >&2
        tepo_die "fit check failed (see above); nothing was started"
    fi
    cat "$RUN_DIR/fit.log" >&2
    # shellcheck source=/dev/null
    source "$env_file"
}

# The CPUs a job step gets on each node: TEPO_CPUS_PER_NODE if set, else the fewest the job has
# on any of its nodes (SLURM_JOB_CPUS_PER_NODE, e.g. "64(x2),32"), else SLURM_CPUS_ON_NODE, else
# this host's (a dry run outside Slurm). Fails with a line naming the variable on a bad value.
tepo_cpus_per_node() {
    local n="" part src
    if [[ -n "${TEPO_CPUS_PER_NODE:-}" ]]; then
        n=$TEPO_CPUS_PER_NODE src=TEPO_CPUS_PER_NODE
    elif [[ -n "${SLURM_JOB_CPUS_PER_NODE:-}" ]]; then
        src=SLURM_JOB_CPUS_PER_NODE
        for part in ${SLURM_JOB_CPUS_PER_NODE//,/ }; do
            part=${part%%(*}
            [[ "$part" =~ ^[1-9][0-9]*$ ]] || { n=$SLURM_JOB_CPUS_PER_NODE; break; }
            if [[ -z "$n" ]] || ((part < n)); then n=$part; fi
        done
    elif [[ -n "${SLURM_CPUS_ON_NODE:-}" ]]; then
        n=$SLURM_CPUS_ON_NODE src=SLURM_CPUS_ON_NODE
    else
        n=$(env -u OMP_NUM_THREADS -u OMP_THREAD_LIMIT nproc) src=nproc  # (nproc obeys OMP_*)
    fi
    if ! [[ "$n" =~ ^[1-9][0-9]*$ ]]; then
        tepo_log "$src: expected a positive CPU count per node, got '$n'"
        return 1
    fi
    printf '%s\n' "$n"
}

# The srun arguments of every job step (see "Devices" at the top), always with a CPU count: since
# Slurm 22.05 a step does not inherit the job's --cpus-per-task, and a step that asks for one CPU
# is bound to one CPU under CPU binding (task/affinity, cgroups) wherever steps are exact
# (--exact, SLURM_EXACT=1): torchrun's ranks or a node's servers would then share one core. Every
# step gets all of the node's CPUs (tepo_cpus_per_node); a count in TEPO_SRUN_ARGS wins.
tepo_srun_args() {
    local args cpus
    cpus=$(tepo_cpus_per_node) || return 1
    if [[ -n "${TEPO_SRUN_ARGS+set}" ]]; then
        args=$TEPO_SRUN_ARGS
    elif [[ "${FIT_DEVICE:-cuda}" == cpu ]]; then
        args="--overlap"
    elif [[ "${FIT_PLACEMENT:-separate}" == colocated ]]; then
        args="--gpus-per-node=$FIT_GPUS_PER_NODE --overlap"  # the servers and the trainer on the same GPUs
    else
        args="--gpus-per-node=$FIT_GPUS_PER_NODE"
    fi
    if [[ " $args " != *" --cpus-per-task"* && " $args " != *" -c"* ]]; then
        args="${args:+$args }--cpus-per-task=$cpus"
    fi
    printf '%s\n' "$args"
}

# TEPO_SGLANG_API_KEY: the user's, else a new random one (32 hex digits) for this job; exported,
# so that it reaches the servers and the trainer through srun's environment, never a command line
# (the serve command hands it to SGLang inside the server process).
tepo_api_key() {
    if [[ -z "${TEPO_SGLANG_API_KEY:-}" ]]; then
        TEPO_SGLANG_API_KEY=$(od -An -tx1 -N16 /dev/urandom | tr -d ' \n')
        [[ "$TEPO_SGLANG_API_KEY" =~ ^[0-9a-f]{32}$ ]] || tepo_die "could not make an API key from /dev/urandom"
        tepo_log "API key: a new random one for this job (TEPO_SGLANG_API_KEY, passed in the environment)"
    else
        tepo_log "API key: TEPO_SGLANG_API_KEY from the environment"
    fi
    export TEPO_SGLANG_API_KEY
}

# A free TCP port on this host (launch.sglang.port: 0, one-node jobs).
tepo_free_port() {
    # outside the kernel's ephemeral range, which outgoing connections draw from (a server that
    # binds late under load could find an OS-picked port taken): megatron_tepo/net.py
    PYTHONPATH="$TEPO_ROOT${PYTHONPATH:+:$PYTHONPATH}" "$(tepo_python)" -c \
        'from megatron_tepo.net import free_port; print(free_port(""))'
}

# tepo_run CMD...: run a command, or print it with TEPO_DRY_RUN=1.
tepo_run() {
    if [[ "${TEPO_DRY_RUN:-0}" == 1 ]]; then
        printf 'DRY-RUN:'
        printf ' %q' "$@"
        printf '\n'
    else
        "$@"
    fi
}

# The serve command of one server: FIT_SERVE_ENV, the python, then FIT_SERVE_ARGS as the fit check wrote it
# (already shell-quoted: `-m` the engine's serve module and one server's options, made in one
# place, megatron_tepo/launch/spec.py's serve_args, which the nemo-run launcher calls too; the serve
# command reads them back into the same type and turns them into SGLang's flags), then the port.
# tepo_serve_cmd PORT: one shell-quoted command line.
tepo_serve_cmd() {
    # FIT_SERVE_ENV: the variables the server runs with beyond the job's (colocated: health checks that
    # do not generate, CUDA graphs under the memory saver), in front so that a dry run shows them
    printf 'env %s %q %s --port %q ' "${FIT_SERVE_ENV:-}" "$(tepo_python)" "$FIT_SERVE_ARGS" "$1"
}

# tepo_keep_serving LOG CMD...: run one server (CMD, its output appended to LOG) and start it again
# when it exits, at most TEPO_SERVER_RESTARTS times, the k-th time after k x
# TEPO_SERVER_RESTART_DELAY seconds; each exit and restart is a line in LOG and on stderr. Returns
# the server's last status once no restart is left. TERM or INT (the step is stopped) stops the
# server and the loop: no restart. With TEPO_SGLANG_RESTART_GATE (colocated launches) a restart
# also waits until that file exists: the trainer's fleet creates it while a weight sync waits for
# dead servers, the one phase with room for a starting server beside the actor. Runs inside the
# SGLang srun step (which sources this file).
tepo_keep_serving() {
    local log=$1 n=0 rc pid=""
    shift
    local max=${TEPO_SERVER_RESTARTS:-3} delay=${TEPO_SERVER_RESTART_DELAY:-10}
    [[ "$max" =~ ^[0-9]+$ ]] || { tepo_log "TEPO_SERVER_RESTARTS: expected a count >= 0, got '$max'"; return 2; }
    [[ "$delay" =~ ^[0-9]+$ ]] || { tepo_log "TEPO_SERVER_RESTART_DELAY: expected seconds >= 0, got '$delay'"; return 2; }
    trap '[[ -n "$pid" ]] && kill -TERM "$pid" 2>/dev/null; wait; exit 143' TERM INT
    while :; do
        "$@" >>"$log" 2>&1 &
        pid=$!
        rc=0
        wait "$pid" || rc=$?
        if ((n >= max)); then
            tepo_log "server ($log) exited with status $rc; no restart left (TEPO_SERVER_RESTARTS=$max)" 2>&1 \
                | tee -a "$log" >&2
            return "$rc"
        fi
        n=$((n + 1))
        tepo_log "server ($log) exited with status $rc: restart $n of $max in $((n * delay)) s" 2>&1 \
            | tee -a "$log" >&2
        sleep "$((n * delay))"
        if [[ -n "${TEPO_SGLANG_RESTART_GATE:-}" && ! -e "$TEPO_SGLANG_RESTART_GATE" ]]; then
            tepo_log "server ($log): restart $n waits for the trainer's next weight sync ($TEPO_SGLANG_RESTART_GATE;" \
                "colocated: the GPUs are the actor's until then)" 2>&1 | tee -a "$log" >&2
            while [[ ! -e "$TEPO_SGLANG_RESTART_GATE" ]]; do sleep 1; done
        fi
    done
}

# Start FIT_SERVERS_PER_NODE servers on every rollout node (one srun step per node, in the
# background); fill TEPO_SGLANG_URLS (comma-separated) and TEPO_STEP_PIDS. On cuda server i of a
# node gets GPUs i*TP .. i*TP+TP-1; ports FIT_SGLANG_PORT + i (0: free ports of this host).
# Colocated: TEPO_SGLANG_RESTART_GATE (exported: the servers' restart loops and the trainer read it)
# is this attempt's $LOG_DIR/restart.gate.
tepo_start_sglang() {
    local host i port gpus first last base=$FIT_SGLANG_PORT
    local -a urls=() srun_args
    local srun_line
    srun_line=$(tepo_srun_args) || tepo_die "no srun arguments for the SGLang steps (see above)"
    read -r -a srun_args <<<"$srun_line"
    if [[ "${FIT_PLACEMENT:-separate}" == colocated ]]; then
        export TEPO_SGLANG_RESTART_GATE=$LOG_DIR/restart.gate
        rm -f "$TEPO_SGLANG_RESTART_GATE"
    fi
    if [[ "$base" == 0 && "${TEPO_DRY_RUN:-0}" != 1 ]]; then
        if (( ${#TEPO_ROLLOUT_HOSTS[@]} != 1 )) || [[ "${TEPO_ROLLOUT_HOSTS[0]}" != "$(hostname -s)" ]]; then
            tepo_die "launch.sglang.port: 0 (free ports) needs the servers on this host, not ${TEPO_ROLLOUT_HOSTS[*]}"
        fi
    fi
    for host in "${TEPO_ROLLOUT_HOSTS[@]}"; do
        local script
        script="set -e; source $(printf '%q' "$TEPO_ROOT/slurm/lib.sh"); "
        for ((i = 0; i < FIT_SERVERS_PER_NODE; i++)); do
            if [[ "$base" == 0 ]]; then
                if [[ "${TEPO_DRY_RUN:-0}" == 1 ]]; then port=$((30000 + i)); else port=$(tepo_free_port); fi
            else
                port=$((base + i))
            fi
            if [[ "${FIT_DEVICE:-cuda}" != cpu ]]; then
                first=$((i * FIT_SGLANG_TP))
                last=$((first + FIT_SGLANG_TP - 1))
                gpus=$(seq -s, "$first" "$last")
                script+="CUDA_VISIBLE_DEVICES=$gpus "
            fi
            script+="tepo_keep_serving $(printf '%q' "$LOG_DIR/sglang.$host.$i.log") $(tepo_serve_cmd "$port")& p$i=\$!; "
            urls+=("http://$host:$port")
        done
        for ((i = 0; i < FIT_SERVERS_PER_NODE; i++)); do
            script+="wait \$p$i; "  # set -e: the step ends with the first server out of restarts
        done
        tepo_log "SGLang on $host: $FIT_SERVERS_PER_NODE server(s), TP=$FIT_SGLANG_TP, device ${FIT_DEVICE:-cuda}"
        tepo_run srun --nodes=1 --ntasks=1 --nodelist="$host" "${srun_args[@]}" --kill-on-bad-exit=1 \
            bash -c "$script" >>"$LOG_DIR/sglang.$host.srun.log" 2>&1 &
        TEPO_STEP_PIDS+=($!)
    done
    TEPO_SGLANG_URLS=$(IFS=,; printf '%s' "${urls[*]}")
    export TEPO_SGLANG_URLS
    printf '%s\n' "${urls[@]}" >"$RUN_DIR/sglang_urls.txt"
}

# tepo_wait_health [TIMEOUT_S]: wait until every URL in TEPO_SGLANG_URLS answers /health.
tepo_wait_health() {
    local timeout=${1:-${TEPO_HEALTH_TIMEOUT:-1800}}
    local deadline=$((SECONDS + timeout)) url pid
    local -a urls pending
    IFS=, read -r -a urls <<<"$TEPO_SGLANG_URLS"
    [[ "${TEPO_DRY_RUN:-0}" == 1 ]] && return 0
    pending=("${urls[@]}")
    while ((${#pending[@]})); do
        local -a still=()
        for url in "${pending[@]}"; do
            curl -sf -m 5 "$url/health" >/dev/null 2>&1 || still+=("$url")
        done
        pending=("${still[@]}")
        ((${#pending[@]})) || break
        for pid in "${TEPO_STEP_PIDS[@]}"; do
            kill -0 "$pid" 2>/dev/null || tepo_die "an SGLang srun step exited before it was healthy (logs: $LOG_DIR/sglang.*)"
        done
        ((SECONDS < deadline)) || tepo_die "SGLang not healthy after ${timeout}s: ${pending[*]} (logs: $LOG_DIR/sglang.*)"
        sleep "${TEPO_HEALTH_POLL:-$([[ "${FIT_DEVICE:-cuda}" == cpu ]] && echo 1 || echo 10)}"
    done
    tepo_log "all ${#urls[@]} SGLang server(s) healthy"
}

# tepo_start_trainer [OVERRIDE...]: srun one task per actor node, each running torchrun with
# GPUS_PER_NODE processes (CPU: processes), c10d rendezvous on the first actor node (one node
# without TEPO_RDZV_PORT: --standalone, a free local port), with tepo_trainer_env's settings (this
# step's only); runs in the background.
tepo_start_trainer() {
    local -a srun_args rdzv trainer_env
    local srun_line
    srun_line=$(tepo_srun_args) || tepo_die "no srun arguments for the trainer step (see above)"
    read -r -a srun_args <<<"$srun_line"
    mapfile -t trainer_env < <(tepo_trainer_env)
    # colocated: what the release step freed on every server (the fleet's initial state), shown in
    # the trainer's line like its other settings
    [[ -n "${TEPO_SGLANG_RELEASED:-}" ]] && trainer_env+=("TEPO_SGLANG_RELEASED=$TEPO_SGLANG_RELEASED")
    [[ -n "${TEPO_SGLANG_RESTART_GATE:-}" ]] && trainer_env+=("TEPO_SGLANG_RESTART_GATE=$TEPO_SGLANG_RESTART_GATE")
    local head=${TEPO_ACTOR_HOSTS[0]} nodelist
    nodelist=$(IFS=,; printf '%s' "${TEPO_ACTOR_HOSTS[*]}")
    if (( ${#TEPO_ACTOR_HOSTS[@]} == 1 )) && [[ -z "${TEPO_RDZV_PORT:-}" ]]; then
        rdzv=(--standalone)
        tepo_log "trainer on $head ($FIT_GPUS_PER_NODE processes, device ${FIT_DEVICE:-cuda}), standalone rendezvous"
    else
        rdzv=(--rdzv-backend=c10d --rdzv-endpoint="$head:${TEPO_RDZV_PORT:-29500}" --rdzv-id="${SLURM_JOB_ID:-tepo}")
        tepo_log "trainer on ${#TEPO_ACTOR_HOSTS[@]} node(s) ($nodelist), rendezvous $head:${TEPO_RDZV_PORT:-29500}"
    fi
    # the script's overrides (the fit check wrote them into run.yaml) less the launch file's own
    # sections, which the trainer's run config does not have
    local -a run_ov=()
    local ov
    for ov in "$@"; do
        [[ "$ov" == launch.* || "$ov" == architecture.* ]] || run_ov+=("$ov")
    done
    tepo_run srun --nodes="${#TEPO_ACTOR_HOSTS[@]}" --ntasks-per-node=1 --nodelist="$nodelist" "${srun_args[@]}" \
        --kill-on-bad-exit=1 \
        env "${trainer_env[@]}" "$(tepo_python)" -m torch.distributed.run --nnodes="${#TEPO_ACTOR_HOSTS[@]}" \
        --nproc-per-node="$FIT_GPUS_PER_NODE" "${rdzv[@]}" \
        "$TEPO_ROOT/tools/train.py" --config "$RUN_DIR/run.yaml" "${run_ov[@]}" \
        >>"$LOG_DIR/trainer.log" 2>&1 &
    TEPO_TRAINER_PID=$!
    TEPO_STEP_PIDS+=("$TEPO_TRAINER_PID")
}

tepo_stop_steps() {
    local pid
    for pid in "${TEPO_STEP_PIDS[@]}"; do
        kill -TERM "$pid" 2>/dev/null || true
    done
}

# Preemption / time limit: USR1 (sent 120 s before the end by --signal=B:USR1@120).
tepo_on_preempt() {
    tepo_log "signal received: stopping the job steps and requeueing job ${SLURM_JOB_ID:-?}"
    tepo_stop_steps
    if [[ -n "${SLURM_JOB_ID:-}" ]] && command -v scontrol >/dev/null 2>&1; then
        scontrol requeue "$SLURM_JOB_ID" || tepo_log "scontrol requeue failed"
    fi
    exit 0
}

# TERM: scancel (or Slurm's preemption): stop the steps, no requeue (from here: after this job's
# own `scontrol requeue`, Slurm stops the attempt with TERM too).
tepo_on_term() {
    if [[ "${TEPO_REQUEUED:-0}" == 1 ]]; then
        tepo_log "TERM received: stopping the job steps (the job is requeued)"
    else
        tepo_log "TERM received: stopping the job steps (no requeue)"
    fi
    tepo_stop_steps
    exit 143
}

# tepo_requeue_after_failure STATUS: the trainer step exited with STATUS (non-zero): requeue the
# job (`scontrol requeue`) unless an exit-reason file of this attempt says "requeue": false, the
# job was requeued after a failure TEPO_MAX_REQUEUES times already, or this is not a Slurm job. One
# line says which and why. The count: the attempts of this job that left the marker file
# requeued_after_failure in their log folder ($LOG_DIR's siblings <job>.<n>/), so time-limit
# requeues (USR1) do not use it up. Returns 0 (the caller exits with the trainer's status).
tepo_requeue_after_failure() {
    local rc=$1 max=${TEPO_MAX_REQUEUES:-3} count=0 f why=""
    [[ "$max" =~ ^[0-9]+$ ]] || tepo_die "TEPO_MAX_REQUEUES: expected a count >= 0, got '$max'"
    for f in "$(dirname "${LOG_DIR:-./x}")/${SLURM_JOB_ID:-local}".*/requeued_after_failure; do
        [[ -f "$f" ]] && count=$((count + 1))
    done
    for f in "${TEPO_EXIT_REASON_FILE:-}" "${TEPO_EXIT_REASON_FILE:-}".rank*; do
        [[ -n "$f" && -f "$f" ]] || continue
        if grep -q '"requeue": false' "$f"; then
            tepo_log "not requeued: the trainer stopped for a reason a new attempt would meet again: $(head -c 600 "$f")"
            return 0
        fi
        why=${why:-$(head -c 600 "$f")}
    done
    why=${why:-"no exit reason written (a crash, a lost node or a failed srun)"}
    local stacks=("$(dirname "${TEPO_EXIT_REASON_FILE:-./x}")"/stacks.rank*.txt)
    [[ -f "${stacks[0]}" ]] && tepo_log "the trainer's Python stacks, one file per rank: ${stacks[*]}"
    if [[ -z "${SLURM_JOB_ID:-}" ]] || ! command -v scontrol >/dev/null 2>&1; then
        tepo_log "not requeued: not a Slurm job (trainer status $rc: $why)"
    elif ((count >= max)); then
        tepo_log "not requeued: job $SLURM_JOB_ID was requeued after a failure $count time(s) already (TEPO_MAX_REQUEUES=$max); trainer status $rc: $why"
    else
        tepo_log "requeueing job $SLURM_JOB_ID (requeue $((count + 1)) of at most $max; it resumes from the newest complete checkpoint) after trainer status $rc: $why"
        TEPO_REQUEUED=1
        printf '%s\n' "$why" >"${LOG_DIR:-.}/requeued_after_failure"
        scontrol requeue "$SLURM_JOB_ID" || tepo_log "scontrol requeue failed"
    fi
    return 0
}

tepo_install_traps() {
    trap tepo_on_preempt USR1
    trap tepo_on_term TERM
    trap tepo_stop_steps EXIT
}

# The steps of the job (see the top of this file; FIT_STEPS names them in order). Each gets the
# overrides of the script; only the trainer uses them.
tepo_step_split_nodes() {
    tepo_split_nodes "$FIT_ACTOR_NODES" "$FIT_ROLLOUT_NODES" || tepo_die "node split failed"
    if [[ "${FIT_PLACEMENT:-separate}" == colocated ]]; then
        tepo_log "actor nodes: ${TEPO_ACTOR_HOSTS[*]}; SGLang colocated on their ${FIT_DEVICE:-cuda} devices (taking turns with the actor)"
    elif ((FIT_ROLLOUT_NODES == 0)); then
        tepo_log "actor nodes: ${TEPO_ACTOR_HOSTS[*]}; SGLang colocated on them"
    else
        tepo_log "actor nodes: ${TEPO_ACTOR_HOSTS[*]}; rollout nodes: ${TEPO_ROLLOUT_HOSTS[*]}"
    fi
}

tepo_step_job_env() {
    tepo_nccl_env
    tepo_api_key
    tepo_install_traps
}

tepo_step_servers() {
    tepo_start_sglang
}

tepo_step_health() {
    tepo_wait_health "${TEPO_HEALTH_TIMEOUT:-1800}"
}

# Colocated launches: every server releases its memory before the trainer starts (the launch
# sequence's release step, megatron_tepo/launch/sequence.py; the URLs and the API key reach it in the
# environment), and the trainer is told what is released (TEPO_SGLANG_RELEASED, exported now: the
# servers' step started before and does not get it).
tepo_step_release() {
    [[ -n "${FIT_RELEASE_TAGS:-}" ]] || tepo_die "FIT_RELEASE_TAGS: empty (the fit check names what to release)"
    tepo_log "releasing the memory of every SGLang server ($FIT_RELEASE_TAGS) before the trainer starts"
    if ! PYTHONPATH="$TEPO_ROOT${PYTHONPATH:+:$PYTHONPATH}" tepo_run "$(tepo_python)" \
            -m megatron_tepo.launch.release --tags "$FIT_RELEASE_TAGS" >>"$LOG_DIR/release.log" 2>&1; then
        cat "$LOG_DIR/release.log" >&2
        tepo_die "releasing the SGLang servers' memory failed (above; logs: $LOG_DIR/sglang.*)"
    fi
    export TEPO_SGLANG_RELEASED=$FIT_RELEASE_TAGS
}

# The trainer step: its status is the job's; a failed one may requeue the job.
tepo_step_trainer() {
    export TEPO_EXIT_REASON_FILE="$LOG_DIR/exit_reason.json"  # the trainer's ranks say why they stopped
    rm -f "$TEPO_EXIT_REASON_FILE" "$TEPO_EXIT_REASON_FILE".rank*
    tepo_start_trainer "$@"
    local rc=0
    # `wait` returns early when a trapped signal arrives; the trap then requeues
    wait "$TEPO_TRAINER_PID" || rc=$?
    tepo_log "trainer exited with status $rc"
    ((rc == 0)) || tepo_requeue_after_failure "$rc"
    return "$rc"
}

# tepo_main LAUNCH_FILE [OVERRIDE...]: the whole job (see the top of this file): the fit check, then
# each step of FIT_STEPS in turn; returns the last one's (the trainer's) status.
tepo_main() {
    local launch_file=$1
    shift
    TEPO_STEP_PIDS=()
    unset TEPO_SGLANG_RELEASED  # only this attempt's release step says what its servers released
    local attempt="${SLURM_JOB_ID:-local}.${SLURM_RESTART_COUNT:-0}"
    RUN_DIR="${TEPO_RUN_DIR:-${OUTPUT_DIR:-$TEPO_ROOT/outputs/$(basename "$launch_file" .yaml)}/launch/$attempt}"
    tepo_fit_check "$launch_file" "$@"
    LOG_DIR="$FIT_OUTPUT_DIR/logs/$attempt"
    [[ "$FIT_OUTPUT_DIR" = /* ]] || LOG_DIR="$TEPO_ROOT/$LOG_DIR"
    mkdir -p "$LOG_DIR"
    cp "$RUN_DIR/fit.log" "$LOG_DIR/fit.log"
    tepo_log "attempt $attempt; logs in $LOG_DIR; checkpoints in $FIT_OUTPUT_DIR (resume: newest complete one)"
    local -a steps
    local step i rc=0
    read -r -a steps <<<"${FIT_STEPS:-}"
    ((${#steps[@]})) || tepo_die "FIT_STEPS: empty (the fit check names the job's steps: $RUN_DIR/fit.env)"
    for step in "${steps[@]}"; do
        declare -F "tepo_step_$step" >/dev/null || tepo_die "FIT_STEPS: no step '$step' in slurm/lib.sh (FIT_STEPS='$FIT_STEPS')"
    done
    if [[ " ${steps[*]} " != *" servers "* ]]; then
        tepo_log "rollout.engine: ${FIT_ENGINE} (generates inside the trainer): no SGLang server started"
    fi
    for i in "${!steps[@]}"; do
        tepo_log "step $((i + 1)) of ${#steps[@]}: ${steps[i]}"
        rc=0
        "tepo_step_${steps[i]}" "$@" || rc=$?
    done
    return "$rc"
}
