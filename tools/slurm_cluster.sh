#!/usr/bin/env bash
# A real one-node Slurm cluster on this machine, for the `slurm` tests and slurm/local_cpu_tepo.sh.
#
#   bash tools/slurm_cluster.sh start    # install if missing, start (or reuse) the cluster;
#                                        # the last stdout line is `export SLURM_CONF=...`
#   bash tools/slurm_cluster.sh status   # exit 0 when sinfo shows the node up and sacct answers
#   bash tools/slurm_cluster.sh env      # print the `export SLURM_CONF=...` line
#   bash tools/slurm_cluster.sh conf     # print the slurm.conf that `start` writes (nothing started)
#   bash tools/slurm_cluster.sh stop     # kill the daemons this script started (state is kept)
#
# What it does:
# - installs Debian 12's slurmctld slurmd slurm-client munge slurmdbd mariadb-server with apt-get,
#   only those that are missing (as root; quiet);
# - keeps ALL state under one folder, $MTEPO_SLURM_DIR (default /tmp/mtepo-slurm): configs in
#   etc/, munge key + socket in munge/, the MariaDB data dir in db/, spool dirs, logs in log/,
#   pid files in run/. SLURM_CONF points at etc/slurm.conf; nothing under /etc is written (apt's
#   own package files aside), no systemd;
# - starts, in order: munged (--force, its own key and socket, named in slurm.conf's AuthInfo),
#   mariadbd on 127.0.0.1 (a private data dir and port), slurmdbd (accounting, so `sacct` works;
#   nemo-run polls it), the cluster/account/user in sacctmgr, slurmctld, slurmd; then waits until
#   `sinfo` shows the node idle;
# - one node = this host (NodeAddr 127.0.0.1), CPUs = the CPUs this process may run on (nproc
#   without OMP_NUM_THREADS, which nproc obeys and tools/test.sh sets to 1), RealMemory = the machine's memory,
#   select/cons_tres with CR_CPU (memory is not a consumable: a job may use all of it); job steps
#   of one job run side by side when they are started with `srun --overlap` (slurm/lib.sh does so
#   on CPU). CPU binding is on (TaskPlugin=task/affinity), as on most GPU clusters: a step's tasks
#   may run only on the CPUs the step was given, so a step started without a CPU count is bound
#   to one CPU (tests/slurm/test_step_cpus.py relies on this). `start` is idempotent: a running healthy cluster is reused; a half-running one is
#   stopped and started again, and so is a running one whose slurm.conf is not what this script
#   writes now (e.g. written by an older version of it).
#
# What it leaves out: cgroups (ProctrackType=proctrack/linuxproc; CPU binding by sched_setaffinity
# only, no memory limits), GPUs/GRES, MPI/PMIx (MpiDefault=none), more than one node, running
# as a non-root user, and any hardening (the database password is in the state folder).
#
# Settings (environment): MTEPO_SLURM_DIR (state folder), MTEPO_SLURM_PORT (first of three ports:
# slurmctld, slurmd, slurmdbd; default 6817), MTEPO_SLURM_DB_PORT (MariaDB, default 33061),
# MTEPO_SLURM_TIMEOUT (seconds to wait for each daemon, default 60).
set -euo pipefail

DIR=${MTEPO_SLURM_DIR:-/tmp/mtepo-slurm}
PORT=${MTEPO_SLURM_PORT:-6817}
DB_PORT=${MTEPO_SLURM_DB_PORT:-33061}
TIMEOUT=${MTEPO_SLURM_TIMEOUT:-60}
HOST=$(hostname -s)
CLUSTER=mtepo
CONF="$DIR/etc/slurm.conf"
DBD_CONF="$DIR/etc/slurmdbd.conf"
MUNGE_SOCKET="$DIR/munge/munge.socket"
DB_SOCKET="$DIR/db/mysqld.sock"
PACKAGES=(slurmctld slurmd slurm-client munge slurmdbd mariadb-server)
DAEMONS=(slurmd slurmctld slurmdbd mariadbd munged)  # stop order

log() { printf '[slurm_cluster] %s\n' "$*" >&2; }
die() { log "ERROR: $*"; exit 1; }

# wait_for SECONDS WHAT CMD...: poll CMD every 0.5 s
wait_for() {
    local timeout=$1 what=$2
    shift 2
    local deadline=$((SECONDS + timeout))
    until "$@" >/dev/null 2>&1; do
        ((SECONDS < deadline)) || return 1
        sleep 0.5
    done
    log "$what: up"
}

install_packages() {
    local -a missing=()
    local p
    for p in "${PACKAGES[@]}"; do
        dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
    done
    ((${#missing[@]})) || return 0
    ((EUID == 0)) || die "missing packages ${missing[*]}: run as root or \`sudo apt-get install ${missing[*]}\`"
    log "apt-get install ${missing[*]}"
    export DEBIAN_FRONTEND=noninteractive
    apt-get install -y -qq --no-install-recommends "${missing[@]}" >"$DIR/log/apt.log" 2>&1 || {
        apt-get update -qq >>"$DIR/log/apt.log" 2>&1
        apt-get install -y -qq --no-install-recommends "${missing[@]}" >>"$DIR/log/apt.log" 2>&1
    } || die "apt-get install failed: see $DIR/log/apt.log"
}

pid_alive() {  # pid_alive NAME: its pid file names a live process
    local f="$DIR/run/$1.pid" pid
    [[ -s "$f" ]] || return 1
    pid=$(<"$f")
    [[ "$pid" =~ ^[0-9]+$ ]] && kill -0 "$pid" 2>/dev/null
}

db_password() {
    [[ -s "$DIR/etc/db.pass" ]] || { umask 077; od -An -tx1 -N16 /dev/urandom | tr -d ' \n' >"$DIR/etc/db.pass"; }
    cat "$DIR/etc/db.pass"
}

# The text of slurm.conf (stdout).
slurm_conf_text() {
    local cpus mem_mb
    cpus=$(env -u OMP_NUM_THREADS -u OMP_THREAD_LIMIT nproc)  # nproc obeys OMP_*: tools/test.sh sets OMP_NUM_THREADS=1
    mem_mb=$(awk '/^MemTotal:/ {print int($2 / 1024)}' /proc/meminfo)
    cat <<EOF
# written by tools/slurm_cluster.sh: a one-node cluster, all state under $DIR
ClusterName=$CLUSTER
SlurmctldHost=$HOST(127.0.0.1)
SlurmctldPort=$PORT
SlurmdPort=$((PORT + 1))
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
AuthInfo=socket=$MUNGE_SOCKET
CredType=cred/munge
StateSaveLocation=$DIR/spool/ctld
SlurmdSpoolDir=$DIR/spool/d
SlurmctldPidFile=$DIR/run/slurmctld.pid
SlurmdPidFile=$DIR/run/slurmd.pid
SlurmctldLogFile=$DIR/log/slurmctld.log
SlurmdLogFile=$DIR/log/slurmd.log
SlurmctldDebug=info
SlurmdDebug=info
ProctrackType=proctrack/linuxproc
TaskPlugin=task/affinity
MpiDefault=none
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
SlurmdParameters=config_overrides
ReturnToService=2
JobRequeue=1
KillWait=10
MinJobAge=600
InactiveLimit=0
SchedulerType=sched/backfill
JobAcctGatherType=jobacct_gather/none
JobCompType=jobcomp/none
AccountingStorageType=accounting_storage/slurmdbd
AccountingStorageHost=127.0.0.1
AccountingStoragePort=$((PORT + 2))
AccountingStoragePass=$MUNGE_SOCKET
NodeName=$HOST NodeAddr=127.0.0.1 NodeHostname=$HOST CPUs=$cpus RealMemory=$mem_mb State=UNKNOWN
PartitionName=local Nodes=$HOST Default=YES MaxTime=INFINITE State=UP
EOF
}

write_configs() {
    slurm_conf_text >"$CONF"
    (
        umask 077
        cat >"$DBD_CONF" <<EOF
# written by tools/slurm_cluster.sh
AuthType=auth/munge
AuthInfo=socket=$MUNGE_SOCKET
DbdAddr=127.0.0.1
DbdHost=$HOST
DbdPort=$((PORT + 2))
SlurmUser=root
PidFile=$DIR/run/slurmdbd.pid
LogFile=$DIR/log/slurmdbd.log
DebugLevel=info
StorageType=accounting_storage/mysql
StorageHost=127.0.0.1
StoragePort=$DB_PORT
StorageUser=slurm
StoragePass=$(db_password)
StorageLoc=${CLUSTER}_acct_db
EOF
    )
}

start_munge() {
    pid_alive munged && return 0
    if [[ ! -s "$DIR/munge/munge.key" ]]; then
        mungekey --create --keyfile="$DIR/munge/munge.key" --force >/dev/null 2>&1 \
            || { umask 077; dd if=/dev/urandom of="$DIR/munge/munge.key" bs=1024 count=1 status=none; }
        chmod 400 "$DIR/munge/munge.key"
    fi
    chmod 700 "$DIR/munge"
    rm -f "$MUNGE_SOCKET" "$MUNGE_SOCKET.lock"
    munged --force --key-file="$DIR/munge/munge.key" --socket="$MUNGE_SOCKET" \
        --pid-file="$DIR/run/munged.pid" --log-file="$DIR/log/munged.log" \
        --seed-file="$DIR/munge/munged.seed" || die "munged failed: see $DIR/log/munged.log"
    wait_for "$TIMEOUT" munged munge --socket="$MUNGE_SOCKET" -n || die "munged not answering: $DIR/log/munged.log"
}

sql() { mariadb --no-defaults --socket="$DB_SOCKET" -u root "$@"; }

start_db() {
    if ! pid_alive mariadbd; then
        if [[ ! -d "$DIR/db/data/mysql" ]]; then
            log "initialising MariaDB in $DIR/db/data"
            mariadb-install-db --no-defaults --datadir="$DIR/db/data" --user=root \
                --auth-root-authentication-method=socket >"$DIR/log/mariadb-install.log" 2>&1 \
                || die "mariadb-install-db failed: see $DIR/log/mariadb-install.log"
        fi
        rm -f "$DB_SOCKET"
        setsid mariadbd --no-defaults --datadir="$DIR/db/data" --user=root --bind-address=127.0.0.1 \
            --port="$DB_PORT" --socket="$DB_SOCKET" --pid-file="$DIR/run/mariadbd.pid" \
            --log-error="$DIR/log/mariadb.log" --innodb-buffer-pool-size=64M \
            --innodb-log-file-size=48M --skip-name-resolve </dev/null >/dev/null 2>&1 &
        wait_for "$TIMEOUT" mariadbd sql -e "SELECT 1" || die "MariaDB did not start: see $DIR/log/mariadb.log"
    fi
    local pass
    pass=$(db_password)
    sql -e "CREATE USER IF NOT EXISTS 'slurm'@'127.0.0.1' IDENTIFIED BY '$pass';
            ALTER USER 'slurm'@'127.0.0.1' IDENTIFIED BY '$pass';
            GRANT ALL ON \`${CLUSTER}_acct_db\`.* TO 'slurm'@'127.0.0.1'; FLUSH PRIVILEGES;" \
        || die "could not create the slurm database user"
}

start_slurmdbd() {
    pid_alive slurmdbd && return 0
    # slurmdbd has no -f: it reads slurmdbd.conf next to $SLURM_CONF
    slurmdbd >>"$DIR/log/slurmdbd.out" 2>&1 || die "slurmdbd failed: see $DIR/log/slurmdbd.log"
    wait_for "$TIMEOUT" slurmdbd sacctmgr -n show cluster || die "slurmdbd not answering: see $DIR/log/slurmdbd.log"
    sacctmgr -n -P show cluster format=cluster | grep -qx "$CLUSTER" \
        || sacctmgr -i add cluster "$CLUSTER" >/dev/null
    sacctmgr -n -P show account format=account | grep -qx local \
        || sacctmgr -i add account local Cluster="$CLUSTER" Description=local Organization=local >/dev/null
    sacctmgr -n -P show user format=user | grep -qx root \
        || sacctmgr -i add user root Account=local Cluster="$CLUSTER" >/dev/null
}

node_state() { sinfo -h -N -n "$HOST" -o %T 2>/dev/null | head -n 1; }

node_ready() {
    local state
    state=$(node_state)
    [[ "$state" =~ ^(idle|mixed|allocated|completing)$ ]]
}

start_slurm() {
    if ! pid_alive slurmctld; then
        slurmctld -i -f "$CONF" >>"$DIR/log/slurmctld.out" 2>&1 || die "slurmctld failed: see $DIR/log/slurmctld.log"
        wait_for "$TIMEOUT" slurmctld scontrol ping || die "slurmctld not answering: see $DIR/log/slurmctld.log"
    fi
    if ! pid_alive slurmd; then
        slurmd -f "$CONF" -N "$HOST" >>"$DIR/log/slurmd.out" 2>&1 || die "slurmd failed: see $DIR/log/slurmd.log"
    fi
    local deadline=$((SECONDS + TIMEOUT)) state
    until node_ready; do
        state=$(node_state)
        if [[ "$state" =~ ^(down|drain|drained|draining|fail)[*~#]*$ ]]; then
            scontrol update NodeName="$HOST" State=RESUME >/dev/null 2>&1 || true
        fi
        ((SECONDS < deadline)) || die "node $HOST not idle after ${TIMEOUT}s (state '$state'): see $DIR/log/slurmd.log"
        sleep 0.5
    done
    log "node $HOST: $(node_state)"
}

healthy() {
    local d
    for d in "${DAEMONS[@]}"; do pid_alive "$d" || return 1; done
    node_ready && sacct -n -X -S now-1minute >/dev/null 2>&1
}

any_running() {
    local d
    for d in "${DAEMONS[@]}"; do pid_alive "$d" && return 0; done
    return 1
}

stop_all() {
    local d pid i
    for d in "${DAEMONS[@]}"; do
        pid_alive "$d" || continue
        pid=$(<"$DIR/run/$d.pid")
        kill -TERM "$pid" 2>/dev/null || true
        for ((i = 0; i < 40; i++)); do kill -0 "$pid" 2>/dev/null || break; sleep 0.25; done
        kill -0 "$pid" 2>/dev/null && kill -KILL "$pid" 2>/dev/null
        rm -f "$DIR/run/$d.pid"
        log "stopped $d ($pid)"
    done
}

print_env() { printf 'export SLURM_CONF=%s\n' "$CONF"; }

cmd=${1:-}
case "$cmd" in
    start)
        mkdir -p "$DIR"/{etc,munge,db,spool/ctld,spool/d,log,run}
        export SLURM_CONF="$CONF"
        if [[ -f "$CONF" ]] && healthy; then
            if [[ "$(slurm_conf_text)" == "$(<"$CONF")" ]]; then
                log "reusing the running cluster in $DIR"
                print_env
                exit 0
            fi
            log "the running cluster's slurm.conf differs from this script's: restarting it"
        fi
        if any_running; then
            log "the cluster in $DIR is only partly up: restarting it"
            stop_all
        fi
        install_packages
        write_configs
        start_munge
        start_db
        start_slurmdbd
        start_slurm
        healthy || die "the cluster started but is not healthy (sinfo/sacct): see $DIR/log/"
        print_env
        ;;
    stop)
        stop_all
        ;;
    status)
        export SLURM_CONF="$CONF"
        if [[ -f "$CONF" ]] && healthy; then
            sinfo
            exit 0
        fi
        log "no healthy cluster in $DIR"
        exit 1
        ;;
    env)
        print_env
        ;;
    conf)
        slurm_conf_text
        ;;
    *)
        printf 'usage: %s {start|stop|status|env|conf}\n' "$0" >&2
        exit 2
        ;;
esac
