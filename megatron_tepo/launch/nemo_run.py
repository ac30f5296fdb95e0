"""The Slurm job of slurm/<model>_tepo.sh, launched through nemo-run (SlurmExecutor or LocalExecutor).

    python tools/launch_nemo_run.py --launch examples/models/qwen3_14b.yaml --executor slurm \\
        --account ACCT --partition PART [--time 48:00:00] [--dryrun] [--detach] [train.steps=500 ...]
    python tools/launch_nemo_run.py --launch examples/models/tiny_cpu.yaml --executor local [...]

The fit check first (:func:`make_plan`: the launch file through :func:`megatron_tepo.launch.load_launch`
and :func:`~megatron_tepo.launch.check_fit`, the code tools/fit_check.py runs, and on
``launch.device: cuda`` :func:`~megatron_tepo.launch.check_pythons` of the nodes' pythons; a misfit
or a CPU environment exits 2 before any experiment exists), then one nemo-run experiment with one
job of two tasks, ``sglang`` and ``trainer`` (``trainer`` alone for a run without servers), which
nemo-run merges into one homogeneous allocation (one sbatch script, one ``srun`` line per task).
The job follows the launch sequence of :mod:`megatron_tepo.launch.sequence`, step by step in its
order, as slurm/lib.sh does: the setup lines split the nodes and set the job's environment with
lib.sh's own functions and name the servers' ports and URLs; the tasks run the two steps of this
module on the nodes: ``step-sglang`` (the servers, each the serve command of
:func:`megatron_tepo.launch.serve_args`, stopped with the trainer's status) and ``step-trainer``
(waits for every server's ``/health``; in a colocated launch node 0 then releases every server's
memory, the ``release`` step, before its torchrun joins the rendezvous; then torchrun with the
trainer's own settings, lib.sh's ``tepo_trainer_env``, and ``TEPO_SGLANG_RELEASED``). The nodes' python is lib.sh's ``tepo_python`` unless ``--python`` names one.
The steps start, watch and stop the servers with the SGLang fleet's own process code
(``megatron_tepo.rollout.sglang.server``: ``wait_ready``, ``stop_server``). What the job does step
by step, why this shape (no heterogeneous job, no nemo-run torchrun launcher), the environment it
reads and what is left out (containers, code packaging, SSH tunnels, multi-node ``--executor
local``, paths holding ``/nemo_run``): docs/LAUNCH.md ("Through nemo-run").
``tools/launch_nemo_run.py`` runs :func:`main`.
"""
from __future__ import annotations

import argparse
import os
import secrets
import shlex
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Dict, List, Optional, Sequence

from megatron_tepo.launch.sequence import RELEASE_TAGS, job_steps, node_python, release_servers, trainer_env
from megatron_tepo.launch.spec import LaunchSpec, serve_args
from megatron_tepo.net import free_port  # outside the ephemeral range

ROOT = Path(__file__).resolve().parents[2]  # the checkout the job runs (its tools/, slurm/, .venv)
TOOL = ROOT / "tools" / "launch_nemo_run.py"  # what the steps run on the nodes

EXIT_FIT = 2  # a misfit or a bad launch file (a user error): nothing rendered
TASK_STEP = {"sglang": "servers", "trainer": "trainer"}  # the step of the sequence each task carries out


class Raw(str):
    """A shell word that is written as is (it holds ``"$VAR"`` references), not quoted."""


def sh(words: Sequence[str]) -> List[str]:
    """Quote each word for the shell (nemo-run joins srun arguments with spaces), except Raw ones."""
    return [str.__str__(w) if isinstance(w, Raw) else shlex.quote(str(w)) for w in words]


def env_overrides(environ=os.environ) -> List[str]:
    """slurm/lib.sh's environment settings (``tepo_fit_check``) as dotted overrides."""
    out = []
    for var, key in (("ACTOR_NODES", "launch.actor_nodes"), ("ROLLOUT_NODES", "launch.rollout_nodes"),
                     ("MODEL_PATH", "model.path"), ("TRAIN_FILES", "data.train_files"),
                     ("OUTPUT_DIR", "train.output_dir")):
        if environ.get(var):
            out.append(f"{key}={environ[var]}")
    return out


# --------------------------------------------------------------------------------------------
# The plan: everything the job needs, from the fit check's numbers
# --------------------------------------------------------------------------------------------
@dataclass
class Plan:
    name: str  # launch file stem, e.g. qwen3_14b
    spec: LaunchSpec  # the launch file as the fit check read it
    report: str  # the fit check's arithmetic, for the log

    @property
    def launch_file(self) -> Path:
        return self.spec.path

    @property
    def device(self) -> str:  # launch.device: cuda or cpu
        return self.spec.launch.device

    @property
    def actor_nodes(self) -> int:
        return self.spec.launch.actor_nodes

    @property
    def rollout_nodes(self) -> int:  # 0: the servers share the actor nodes (colocated, or beside it on CPU)
        return self.spec.launch.rollout_nodes

    @property
    def server_nodes(self) -> int:
        return self.actor_nodes if self.spec.launch.shares_actor_nodes else self.rollout_nodes

    @property
    def total_nodes(self) -> int:
        return self.actor_nodes + self.rollout_nodes

    @property
    def procs_per_node(self) -> int:  # GPUs per node; trainer processes per node on CPU
        return self.spec.launch.gpus_per_node

    @property
    def servers_per_node(self) -> int:
        return self.spec.launch.servers_per_node

    @property
    def first_port(self) -> int:  # 0: free ports of the batch host
        return self.spec.launch.rollout.port

    @property
    def steps(self):  # the job's steps (megatron_tepo/launch/sequence.py), as lib.sh runs them
        return job_steps(self.spec.cfg, self.spec.launch)

    @property
    def roles(self) -> List[str]:  # the tasks: the servers' (their step) and the trainer's
        return [role for role in ("sglang", "trainer") if TASK_STEP[role] in self.steps]

    @property
    def output_dir(self) -> Path:
        out = Path(self.spec.cfg.train.output_dir)
        return out if out.is_absolute() else ROOT / out


def make_plan(launch_file: str, overrides: Sequence[str]) -> Plan:
    """Load the launch file and run the fit check; raises ConfigError/FitError naming the setting."""
    from megatron_tepo.launch import check_fit, load_launch

    spec = load_launch(launch_file, list(overrides))
    report = check_fit(spec.shape(), spec.cfg, spec.launch)
    plan = Plan(Path(launch_file).stem, spec, report.render())
    if plan.first_port == 0 and plan.server_nodes != 1:
        key = f"{plan.spec.launch.rollout.key}.port"
        raise ValueError(f"{key}: 0 (free ports of the batch host) needs the servers on one "
                         f"node, not {plan.server_nodes}; give {key} a fixed port")
    return plan


def server_command(plan: Plan, python: str) -> List[str]:
    """One SGLang server, ``{port}`` filled in per server by step-sglang: the serve command of
    :func:`megatron_tepo.launch.serve_args`, what slurm/lib.sh's ``tepo_serve_cmd`` runs too."""
    return [python, *serve_args(plan.spec), "--port", "{port}"]


def step_commands(plan: Plan, run_dir: Path, python: str, *, slurm: bool, rdzv_port: int,
                  health_timeout: float, ports: Sequence[int] = (), extra: Sequence[str] = ()
                  ) -> Dict[str, List[str]]:
    """The tasks' command lines (shell words), by role (:attr:`Plan.roles`). ``slurm``: node names,
    the attempt and free ports come from the variables the setup lines export; else (one machine)
    everything is literal."""
    me = str(TOOL)
    if slurm:
        attempt = '"${SLURM_JOB_ID:-0}.${SLURM_RESTART_COUNT:-0}"'
        done = Raw(f"{shlex.quote(str(run_dir))}/done.{attempt}")
        logs = Raw(f'{shlex.quote(str(plan.output_dir / "logs"))}/nemo-run.{attempt}')
        port_list = Raw('"$TEPO_SGLANG_PORTS"') if plan.first_port == 0 else \
            ",".join(str(plan.first_port + i) for i in range(plan.servers_per_node))
        rdzv = [Raw(f'--rdzv-endpoint="$TEPO_RDZV_HOST":{rdzv_port}'), Raw('--rdzv-id="${SLURM_JOB_ID:-tepo}"')]
    else:
        done = str(run_dir / "done.local")
        logs = str(plan.output_dir / "logs" / "nemo-run.local")
        port_list = ",".join(str(p) for p in ports)
        rdzv = [f"--rdzv-endpoint=127.0.0.1:{rdzv_port}", "--rdzv-id=tepo-local"]
    if plan.actor_nodes == 1:  # slurm/lib.sh's rule: one actor node -> a free local port
        rdzv = ["--standalone"]
    else:
        rdzv = ["--rdzv-backend=c10d", *rdzv]
    sglang = [python, me, "step-sglang", "--ports", port_list, "--gpus-per-server",
              str(plan.spec.launch.rollout.server.tp),
              "--device", plan.device, "--done-file", done, "--log-dir", logs, "--",
              *server_command(plan, python)]
    torchrun = [python, "-m", "torch.distributed.run", f"--nnodes={plan.actor_nodes}",
                f"--nproc-per-node={plan.procs_per_node}", *rdzv,
                str(ROOT / "tools" / "train.py"), "--config", str(run_dir / "run.yaml"), *extra]
    release = ["--release", ",".join(RELEASE_TAGS)] if "release" in plan.steps else []
    trainer = [python, me, "step-trainer", "--health-timeout", f"{health_timeout:g}", "--done-file", done,
               "--device", plan.device, *release, "--", *torchrun]
    return {role: cmd for role, cmd in (("sglang", sglang), ("trainer", trainer)) if role in plan.roles}


def setup_lines(plan: Plan, python: str) -> str:
    """Shell lines run in the batch script before the srun lines: the batch shell's part of each
    step of :attr:`Plan.steps`, in their order, with slurm/lib.sh's own functions (the node split,
    the job's environment, the servers' ports and URLs; ``health``: step-trainer waits; ``trainer``:
    its task)."""
    lines = [f"# megatron_tepo: {plan.launch_file.name}, fit check passed at submission",
             f"export TEPO_ROOT={shlex.quote(str(ROOT))} TEPO_PYTHON={shlex.quote(python)} FIT_DEVICE={plan.device}",
             'source "$TEPO_ROOT/slurm/lib.sh"']
    for step in plan.steps:
        lines += [f"# step {step}", *_SETUP[step](plan)]
    return "\n".join(lines)


def _setup_split_nodes(plan: Plan) -> List[str]:  # lib.sh's split (rollout 0: the servers on the actor hosts)
    return [
        f'tepo_split_nodes {plan.actor_nodes} {plan.rollout_nodes} || {{ echo "node split failed" >&2; exit 1; }}',
        'TEPO_ACTOR_NODELIST=$(IFS=,; printf %s "${TEPO_ACTOR_HOSTS[*]}")',
        'TEPO_ROLLOUT_NODELIST=$(IFS=,; printf %s "${TEPO_ROLLOUT_HOSTS[*]}")',
        'TEPO_RDZV_HOST=${TEPO_ACTOR_HOSTS[0]}',
        'export TEPO_ACTOR_NODELIST TEPO_ROLLOUT_NODELIST TEPO_RDZV_HOST',
        'echo "actor nodes: $TEPO_ACTOR_NODELIST; rollout nodes: $TEPO_ROLLOUT_NODELIST"']


def _setup_job_env(plan: Plan) -> List[str]:
    return [
        "tepo_nccl_env",  # the job's NCCL network settings; the trainer's own: step-trainer (trainer_env)
        # every srun step gets the node's CPUs (steps do not inherit the job's count): lib.sh's rule
        'TEPO_STEP_CPUS=$(tepo_cpus_per_node) || { echo "no CPU count per node (see above)" >&2; exit 1; }',
        "tepo_api_key",  # TEPO_SGLANG_API_KEY: the user's or a random one, exported to the steps' environment
        # USR1 only (--signal=B:USR1@120, before the time limit): a TERM is scancel, not a requeue;
        # preemption requeues through Slurm itself (--requeue)
        "trap 'TEPO_STEP_PIDS=(\"${pids[@]}\"); tepo_on_preempt' USR1"]


def _setup_servers(plan: Plan) -> List[str]:  # the ports of a node's servers and every server's URL
    spn = plan.servers_per_node
    if plan.first_port == 0:  # one server node (checked): free ports of the batch host
        ports = f'$(for ((i = 0; i < {spn}; i++)); do tepo_free_port; done | paste -sd, -)'
    else:
        ports = ",".join(str(plan.first_port + i) for i in range(spn))
    return [
        f"TEPO_SGLANG_PORTS={ports}",
        'TEPO_SGLANG_URLS=$(for h in "${TEPO_ROLLOUT_HOSTS[@]}"; do IFS=, read -r -a ps <<<"$TEPO_SGLANG_PORTS"; '
        'for p in "${ps[@]}"; do printf "http://%s:%s\\n" "$h" "$p"; done; done | paste -sd, -)',
        'export TEPO_SGLANG_PORTS TEPO_SGLANG_URLS',
        'echo "SGLang: $TEPO_SGLANG_URLS"']


_SETUP = {"split_nodes": _setup_split_nodes, "job_env": _setup_job_env, "servers": _setup_servers,
          "health": lambda plan: [], "release": lambda plan: [],  # (step-trainer waits, then releases)
          "trainer": lambda plan: []}  # (its task)


def srun_args(plan: Plan, role: str) -> List[str]:
    nodes = plan.actor_nodes if role == "trainer" else plan.server_nodes
    var = "TEPO_ACTOR_NODELIST" if role == "trainer" else "TEPO_ROLLOUT_NODELIST"
    args = [f"--nodes={nodes}", "--ntasks-per-node=1", f'--nodelist="${var}"']
    # slurm/lib.sh's tepo_srun_args: GPUs per node on cuda; on cpu the steps share the CPUs; and
    # always all of the node's CPUs (tepo_cpus_per_node, in the setup lines): since Slurm 22.05 a
    # step does not inherit --cpus-per-task, and under CPU binding a one-CPU step is one core
    args.append(f"--gpus-per-node={plan.procs_per_node}" if plan.device == "cuda" else "--overlap")
    if plan.device == "cuda" and plan.spec.launch.colocated:
        args.append("--overlap")  # the servers and the trainer share the actor nodes' GPUs
    args.append('--cpus-per-task="$TEPO_STEP_CPUS"')  # (a plain str: nemo-run serialises these)
    return args


# --------------------------------------------------------------------------------------------
# nemo-run
# --------------------------------------------------------------------------------------------
def build_experiment(plan: Plan, args, extra: Sequence[str]):
    """Create the experiment and write the run config; returns (exp, run_dir, sbatch path, add):
    ``add()`` adds the job (inside ``with exp:``, as nemo-run requires)."""
    import nemo_run as run
    from megatron_tepo.launch import write_run_config

    name = args.job_name or f"{plan.name}_tepo"
    exp = run.Experiment(name, executor=None, log_level=args.log_level)
    run_dir = plan.output_dir / "launch" / "nemo-run" / exp._id
    write_run_config(plan.spec, run_dir / "run.yaml")
    (run_dir / "fit.log").write_text(plan.report + "\n", encoding="utf-8")
    python = args.python or node_python()  # (checked by launch on cuda)
    slurm = args.executor == "slurm"
    ports = [] if slurm else ([free_port() for _ in range(plan.servers_per_node)] if plan.first_port == 0
                              else [plan.first_port + i for i in range(plan.servers_per_node)])
    cmds = step_commands(plan, run_dir, python, slurm=slurm, rdzv_port=args.rdzv_port if slurm else free_port(),
                         health_timeout=args.health_timeout, ports=ports, extra=extra)
    if slurm:  # nemo-run rewrites "/nemo_run" in a non-container sbatch script into the job folder
        bad = [w for role in cmds for w in cmds[role] if "/nemo_run" in w]
        if bad:
            from megatron_tepo.cli import UserError

            raise UserError(f"a path contains '/nemo_run', which nemo-run rewrites in the sbatch script: "
                            f"{bad[0]} (move the checkout or train.output_dir)")
    quote = sh if slurm else list  # nemo-run joins a Slurm command with spaces; local runs argv as is
    tasks = [run.Script(entrypoint=cmds[role][0], path=cmds[role][1], args=quote(cmds[role][2:]))
             for role in plan.roles]
    if slurm:
        common = dict(
            account=args.account, partition=args.partition, time=args.time, qos=args.qos,
            nodes=plan.total_nodes, ntasks_per_node=1,
            gpus_per_node=plan.procs_per_node if plan.device == "cuda" else None,
            exclusive=True if plan.device == "cuda" else None, signal="B:USR1@120",
            # cpu: a CPU per trainer process (slurm/local_cpu_tepo.sh's --cpus-per-task=2), which
            # every step then gets (TEPO_STEP_CPUS); cuda: --exclusive, the whole node
            cpus_per_task=plan.procs_per_node if plan.device == "cpu" else None,
            job_name_prefix=f"{name}.", tunnel=run.LocalTunnel(job_dir=""), packager=run.Packager(),
            setup_lines=setup_lines(plan, python), wait_time_for_group_job=0,
            monitor_group_job_wait_time=args.monitor_interval,
            additional_parameters={"requeue": True}, retries=args.retries)
        executors = [run.SlurmExecutor(**common, srun_args=srun_args(plan, role)) for role in plan.roles]
    else:
        # no API key here: nemo-run writes env_vars to its experiment folder (configs/*_executor.yaml,
        # _TASKS) and prints them in a dry run; the steps inherit it from this process at run time
        # (local_api_key, in launch)
        env = {"TEPO_ROOT": str(ROOT), "TEPO_RDZV_HOST": "127.0.0.1",  # (the servers' step's URLs: none without it)
               "TEPO_SGLANG_URLS": ",".join(f"http://127.0.0.1:{p}" for p in ports) if "sglang" in plan.roles else ""}
        if plan.device == "cpu":  # slurm/lib.sh's tepo_nccl_env on CPU (the trainer's threads: step-trainer)
            env.update(CUDA_VISIBLE_DEVICES="")
        executors = [run.LocalExecutor(env_vars=dict(env)) for _ in plan.roles]
    sbatch = Path(exp._exp_dir) / f"{name}_sbatch.sh"
    return exp, run_dir, sbatch, lambda: exp.add(tasks, executor=executors, name=name)


# --------------------------------------------------------------------------------------------
# The two steps (run on the nodes): the servers' processes through the SGLang fleet's own code
# (megatron_tepo.rollout.sglang.server: its wait for /health and its stop of a process group;
# importing it loads torch, which the trainer's step runs anyway); no nemo-run imports
# --------------------------------------------------------------------------------------------
def _log(msg: str) -> None:
    print(f"[tepo {time.strftime('%H:%M:%S')} {socket.gethostname()}] {msg}", file=sys.stderr, flush=True)


def _write_done(path: str, rc: int) -> None:
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    tmp = p.with_name(p.name + f".{os.getpid()}.tmp")
    tmp.write_text(f"{rc}\n")
    tmp.replace(p)


def step_sglang(argv: Sequence[str]) -> int:
    ap = argparse.ArgumentParser(prog="launch_nemo_run.py step-sglang")
    ap.add_argument("--ports", required=True, help="comma-separated: one server per port")
    ap.add_argument("--gpus-per-server", type=int, required=True)
    ap.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    ap.add_argument("--done-file", required=True)
    ap.add_argument("--log-dir", required=True)
    ap.add_argument("--poll", type=float, default=2.0)
    ap.add_argument("--grace", type=float, default=20.0, help="seconds from TERM to KILL when stopping")
    ap.add_argument("cmd", nargs=argparse.REMAINDER)
    a = ap.parse_args(argv)
    from concurrent.futures import ThreadPoolExecutor

    from megatron_tepo.rollout.sglang.client import SGLangServer
    from megatron_tepo.rollout.sglang.server import stop_server

    cmd = a.cmd[1:] if a.cmd[:1] == ["--"] else a.cmd
    host = socket.gethostname()
    log_dir = Path(a.log_dir)
    log_dir.mkdir(parents=True, exist_ok=True)
    os.chdir(ROOT)
    servers: List[SGLangServer] = []
    stop = {"sig": None}

    def on_signal(signum, _frame):
        stop["sig"] = signum

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    for i, port in enumerate(int(p) for p in a.ports.split(",") if p):
        env = dict(os.environ)
        if a.device == "cuda":
            first = i * a.gpus_per_server
            env["CUDA_VISIBLE_DEVICES"] = ",".join(str(g) for g in range(first, first + a.gpus_per_server))
        argv_i = [w.replace("{port}", str(port)) for w in cmd]
        log = log_dir / f"sglang.{host}.{i}.log"
        _log(f"server {i}: port {port}{' GPUs ' + env['CUDA_VISIBLE_DEVICES'] if a.device == 'cuda' else ''}: "
             f"{shlex.join(argv_i)} > {log}")
        with open(log, "ab") as f:  # its own session: stop_server ends its whole process group
            proc = subprocess.Popen(argv_i, stdout=f, stderr=subprocess.STDOUT, env=env, start_new_session=True)
        servers.append(SGLangServer(f"http://{host}:{port}", proc=proc, log_path=str(log)))
    rc = 0
    while True:
        if stop["sig"] is not None:
            _log(f"signal {stop['sig']}: stopping the servers")
            rc = 128 + int(stop["sig"])
            break
        if Path(a.done_file).exists():
            text = Path(a.done_file).read_text().strip()
            rc = int(text) if text.lstrip("-").isdigit() else 1
            _log(f"the trainer finished with status {rc}: stopping the servers")
            break
        dead = [(i, s) for i, s in enumerate(servers) if s.proc.poll() is not None]
        if dead:
            for i, s in dead:
                tail = Path(s.log_path).read_text(errors="replace")[-2000:] if Path(s.log_path).exists() else ""
                _log(f"server {i} exited with status {s.proc.returncode}; log tail:\n{tail}")
            rc = 1
            break
        time.sleep(a.poll)
    with ThreadPoolExecutor(max(1, len(servers))) as pool:  # all at once: TERM, then KILL after the grace
        list(pool.map(lambda s: stop_server(s, a.grace), servers))
    return rc


def step_trainer(argv: Sequence[str]) -> int:
    ap = argparse.ArgumentParser(prog="launch_nemo_run.py step-trainer")
    ap.add_argument("--health-timeout", type=float, default=1800.0)
    ap.add_argument("--done-file", required=True)
    ap.add_argument("--urls", default=None, help="comma-separated (default: $TEPO_SGLANG_URLS)")
    ap.add_argument("--device", choices=("cuda", "cpu"), default="cuda",
                    help="the trainer's own settings for this device (slurm/lib.sh's tepo_trainer_env)")
    ap.add_argument("--release", default="",
                    help="colocated: the memory tags node 0 releases on every server before torchrun starts")
    ap.add_argument("cmd", nargs=argparse.REMAINDER)
    a = ap.parse_args(argv)
    from megatron_tepo.rollout.sglang.client import FleetError, SGLangServer
    from megatron_tepo.rollout.sglang.options import API_KEY_ENV, RELEASED_ENV
    from megatron_tepo.rollout.sglang.server import wait_ready

    cmd = a.cmd[1:] if a.cmd[:1] == ["--"] else a.cmd
    node0 = os.environ.get("SLURM_NODEID", "0") == "0"
    os.chdir(ROOT)
    urls = [u for u in (a.urls or os.environ.get("TEPO_SGLANG_URLS", "")).split(",") if u]
    _log(f"waiting for {len(urls)} SGLang server(s): {','.join(urls)}")
    try:  # the servers' key (slurm/lib.sh's variable) is sent when set; /health answers without it
        wait_ready([SGLangServer(u, os.environ.get(API_KEY_ENV) or None) for u in urls], a.health_timeout)
    except FleetError as exc:
        _log(f"SGLang not healthy after {a.health_timeout:g}s ({' '.join(str(exc).split())})")
        rc = 1
    else:
        rc = 0
    tags = [t for t in a.release.split(",") if t]
    if rc == 0 and tags and node0:  # the release step, once per job: node 0 (the others' torchrun
        try:  # waits at the rendezvous for node 0's, which starts after it)
            release_servers(urls, os.environ.get(API_KEY_ENV) or None, tags, log=_log)
        except RuntimeError as exc:
            _log(str(exc))
            rc = 1
    if rc == 0:
        own = trainer_env(a.device)
        if tags:
            own[RELEASED_ENV] = ",".join(tags)
        _log("all SGLang servers healthy; " + shlex.join(["env", *(f"{k}={v}" for k, v in own.items()), *cmd]))
        proc = subprocess.Popen(cmd, env={**os.environ, **own})
        forward = lambda signum, _frame: proc.send_signal(signum)  # noqa: E731
        signal.signal(signal.SIGTERM, forward)
        signal.signal(signal.SIGINT, forward)
        rc = proc.wait()
        _log(f"trainer exited with status {rc}")
    if node0:
        _write_done(a.done_file, rc)
    return rc


# --------------------------------------------------------------------------------------------
# CLI
# --------------------------------------------------------------------------------------------
def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--launch", required=True, help="launch file, e.g. examples/models/qwen3_14b.yaml")
    ap.add_argument("--executor", choices=("slurm", "local"), default="slurm")
    ap.add_argument("--account", default=None, help="Slurm account (required for --executor slurm)")
    ap.add_argument("--partition", default=None)
    ap.add_argument("--qos", default=None)
    ap.add_argument("--time", default="48:00:00")
    ap.add_argument("--job-name", default=None, help="default: <launch file stem>_tepo")
    ap.add_argument("--dryrun", action="store_true", help="render (sbatch script) and stop")
    ap.add_argument("--detach", action="store_true", help="submit and return without waiting")
    ap.add_argument("--nemorun-home", default=None, help="nemo-run's home (default: $NEMORUN_HOME)")
    ap.add_argument("--python", default=None, help="python on the nodes (default: slurm/lib.sh's tepo_python: "
                                                     "$TEPO_PYTHON, else .venv, else python3)")
    ap.add_argument("--health-timeout", type=float, default=1800.0, help="seconds to wait for SGLang")
    ap.add_argument("--rdzv-port", type=int, default=29500)
    ap.add_argument("--monitor-interval", type=int, default=30,
                    help="seconds between nemo-run's checks of the job steps")
    ap.add_argument("--retries", type=int, default=0, help="requeues of a failed job (nemo-run retries)")
    ap.add_argument("--log-level", default="WARN")
    ap.add_argument("overrides", nargs="*", help="dotted overrides: launch.actor_nodes=4 train.steps=10 ...")
    from megatron_tepo.cli import add_traceback_flag

    add_traceback_flag(ap)
    return ap


def main(argv: Optional[Sequence[str]] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["step-sglang"]:
        return step_sglang(argv[1:])
    if argv[:1] == ["step-trainer"]:
        return step_trainer(argv[1:])
    args = build_parser().parse_args(argv)
    from megatron_tepo.cli import user_errors

    with user_errors("launch_nemo_run.py", args.traceback):  # (nemo-run missing, a bad path: one line)
        return launch(args)


def local_api_key(environ=os.environ) -> None:
    """``--executor local``: the servers' API key (``TEPO_SGLANG_API_KEY``: the user's, else a new
    random one) set in this process's environment, which nemo-run's local processes inherit
    (torchx copies ``os.environ``). Not in the executor's ``env_vars``: nemo-run writes those to
    files in its experiment folder. A Slurm job makes its own (lib.sh's ``tepo_api_key``)."""
    if not environ.get("TEPO_SGLANG_API_KEY"):
        environ["TEPO_SGLANG_API_KEY"] = secrets.token_hex(16)


def launch(args) -> int:
    if args.executor == "slurm" and not args.account:
        print("launch_nemo_run: --account is required with --executor slurm", file=sys.stderr)
        return 2
    from megatron_tepo.config import ConfigError
    from megatron_tepo.launch import FitError
    from megatron_tepo.launch.pythons import check_pythons

    try:
        plan = make_plan(args.launch, env_overrides() + list(args.overrides))
        if args.executor == "local" and (plan.actor_nodes != 1 or plan.rollout_nodes > 1):
            print(f"launch_nemo_run: --executor local runs on this machine: needs launch.actor_nodes=1 and "
                  f"launch.rollout_nodes 0 or 1, not {plan.actor_nodes} and {plan.rollout_nodes}", file=sys.stderr)
            return EXIT_FIT
        # launch.device cuda: the pythons of the nodes (megatron_tepo/launch/pythons.py), probed from here
        found = check_pythons(plan.spec, args.python or node_python(), setting="--python (or TEPO_PYTHON)")
    except (ConfigError, FitError, NotImplementedError, ValueError, OSError) as exc:
        if args.traceback:
            raise
        msg = " ".join(str(exc).split())
        print(f"launch_nemo_run.py: error: fit check FAILED (nothing rendered or submitted): {msg}", file=sys.stderr)
        return EXIT_FIT
    plan.report = "\n".join([plan.report, *found])
    print(plan.report, file=sys.stderr)
    if args.nemorun_home:
        os.environ["NEMORUN_HOME"] = str(Path(args.nemorun_home).resolve())
    exp, run_dir, sbatch, add = build_experiment(plan, args, extra=())
    print(f"run config: {run_dir / 'run.yaml'}")
    with exp:
        add()
        if args.dryrun:
            exp.dryrun(delete_exp_dir=False)
            if args.executor == "slurm":
                print(f"sbatch script: {sbatch}")
            return 0
        if args.executor == "local":
            local_api_key()
        exp.run(detach=args.detach, tail_logs=False)
        status = exp.status(return_dict=True) if args.detach else wait_terminal(exp, args.monitor_interval)
    for info in status.values():
        if args.executor == "slurm" and info.get("job_id"):
            print(f"slurm job: {info['job_id']}", flush=True)
    if args.detach:
        print(f"submitted: experiment {exp._id} in {exp._exp_dir}")
        return 0
    states = {name: getattr(info.get("status"), "name", str(info.get("status"))) for name, info in status.items()}
    print(f"experiment {exp._id}: " + ", ".join(f"{k} {v}" for k, v in states.items()))
    return 0 if states and all(v == "SUCCEEDED" for v in states.values()) else 1


def wait_terminal(exp, poll: float) -> dict:
    """``exp.status`` until every job is SUCCEEDED, FAILED or CANCELLED. nemo-run's own wait gives up
    with UNKNOWN when ``sacct`` does not list a fresh job within ~10 polls (slurmdbd lags under
    load) and then returns while the job still runs; this keeps polling (the job's time limit
    bounds it)."""
    from torchx.specs.api import is_terminal

    while True:
        status = exp.status(return_dict=True) or {}
        if status and all(info.get("status") is not None and is_terminal(info["status"])
                          for info in status.values()):
            return status
        time.sleep(max(1.0, poll))


if __name__ == "__main__":
    sys.exit(main())
