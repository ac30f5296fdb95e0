"""One SGLang server: how it is started and stopped, its address, its health, sglang-router in
front of several, and the serve command.

* :class:`ServerConfig` -- how a server is started (model, device, dtype, TP, memory, threads,
  start-up time-out, log folder, extra SGLang flags).
* :func:`server_command` -- the command line and environment of one server: the single place that
  knows SGLang's flags. The server runs ``launch.py`` (SGLang's own launch) under the SGLang
  venv's python, with its API key in the environment, never on a command line.
* :func:`launch_server`, :func:`wait_ready`, :func:`stop_server` -- a server as a subprocess of
  this one: its own session (its whole process group is stopped), a free port, a random API key.
* :class:`SGLangServer` -- one server (launched here or attached by URL): its address, key and
  process, its HTTP calls, ``/health`` and the generation probe, its TP size, its health state
  (``health.py``); the fleet also keeps its load on it.
* sglang-router: :func:`router_installed`, :func:`router_command`, :func:`launch_router`.
* the serve command, what slurm/lib.sh runs on every rollout node::

    python -m megatron_tepo.rollout.sglang.server --model-path /models/Qwen3-14B --port 30000 --tp 2 \\
        --device cuda [--host 0.0.0.0] [--mem-fraction-static 0.85] [--max-running-requests 64] \\
        [--context-length 10240] [--print] [-- EXTRA SGLANG ARGS]

  It builds the command line with :func:`server_command` (so the CPU flags and environment live in
  one place), then *execs* SGLang (same pid, so ``srun`` and signals reach the server itself). The
  SGLang python is ``--python``, else ``$MTEPO_SGLANG_PYTHON`` / ``<repo>/.venv-sglang/bin/python``
  (the fleet's default); when neither exists, this python if it can import sglang. The API key, if
  any, is read from the environment variable named by ``--api-key-env`` (default
  ``TEPO_SGLANG_API_KEY``) and handed on in the server's environment (``TEPO_SGLANG_API_KEY``, which
  ``launch.py`` gives SGLang inside the process): it is on no command line, this one or SGLang's,
  and masked in what is printed. ``--print`` prints the command (and the environment it changes)
  instead of running it.

SGLang on CPU: ``tools/install_sglang_cpu.sh`` builds the venv whose python starts the servers
(``ServerConfig.python``, default ``$MTEPO_SGLANG_PYTHON`` or ``<repo>/.venv-sglang/bin/python``)
and marks it (:data:`CPU_BUILD_MARKERS`): a ``cuda`` server is refused such a python
(:func:`server_command`), and so is a ``launch.device: cuda`` job, by its fit check, before any
server starts (``megatron_tepo/launch/pythons.py``). The CPU flags are 0.5.23's, the version that
script installs (``--cuda-graph-backend-*`` is not in 0.5.6 to 0.5.11, which name it
``--disable-cuda-graph``); the ``cuda`` flags are in every version of the declared range (read in
the 0.5.6, 0.5.10 and 0.5.11 ``server_args.py``).

Left out: spreading requests over the servers and retrying them (``fleet.py``), weight updates
(``weight_sync/``), and what runs inside the server process (``launch.py``).
"""
from __future__ import annotations

import argparse
import importlib.util
import os
import secrets
import shlex
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence, Tuple

import requests

from megatron_tepo.net import free_port
from megatron_tepo.rollout.sglang.health import Event, ServerHealth, State

REPO = Path(__file__).resolve().parents[3]
# run by path with the SGLang venv's python (which need not have megatron_tepo installed)
SGLANG_LAUNCHER = str(Path(__file__).resolve().with_name("launch.py"))
API_KEY_ENV = "TEPO_SGLANG_API_KEY"  # the servers' key, in their environment (launch.py reads it)


class FleetError(RuntimeError):
    """No server could answer (all dead, or the deadline passed), or one could not start."""


class RequestFailed(Exception):
    """``status``: the HTTP status when the server answered one (404: it has no such route)."""

    def __init__(self, msg: str, server_dead: bool = False, retryable: bool = True,
                 status: Optional[int] = None):
        super().__init__(msg)
        self.server_dead, self.retryable, self.status = server_dead, retryable, status


class SGLangServer:
    """One server: its URL, key, (if launched here) its process, its load, and its TP size.

    ``tp_size``: the server's tensor-parallel size (how many TP workers join a weight-update
    group), known when it was launched here (``ServerConfig.tp``); ``None`` for an attached
    server until :meth:`resolve_tp_size` asks the server (``/server_info``)."""

    def __init__(self, url: str, api_key: Optional[str] = None, proc: Optional[subprocess.Popen] = None,
                 log_path: Optional[str] = None, tp_size: Optional[int] = None):
        self.url, self.api_key, self.proc, self.log_path = url.rstrip("/"), api_key, proc, log_path
        self.tp_size = tp_size
        self.inflight = 0
        self.health = ServerHealth()
        self.last_error: Optional[str] = None
        self.served = 0  # requests answered (by every incarnation)

    @property
    def alive(self) -> bool:
        """Reachable: healthy, suspect, or stale (a weight sync goes to it); not dead, not restarting."""
        return self.health.reachable

    @property
    def state(self) -> State:
        return self.health.state

    @property
    def incarnation(self) -> int:
        """+1 every time the server comes back (a new process: a new weight-update group)."""
        return self.health.incarnation

    def replace_process(self, url: str, proc: subprocess.Popen, log_path: Optional[str]) -> None:
        """A restart: the new process's address and log (the key and TP size stay)."""
        self.url, self.proc, self.log_path = url.rstrip("/"), proc, log_path
        self.inflight = 0

    @property
    def pid(self) -> Optional[int]:
        return self.proc.pid if self.proc is not None else None

    def headers(self) -> Dict[str, str]:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}

    def post(self, path: str, payload: Optional[dict] = None, timeout: float = 60.0) -> Any:
        return self._request("post", path, timeout, json=payload if payload is not None else {})

    def get(self, path: str, timeout: float = 60.0) -> Any:
        return self._request("get", path, timeout)

    def _request(self, method: str, path: str, timeout: float, **kw) -> Any:
        try:
            r = requests.request(method, self.url + path, headers=self.headers(), timeout=timeout, **kw)
        except requests.Timeout as e:
            raise RequestFailed(f"{self.url}{path}: timed out after {timeout:.0f} s") from e
        except requests.ConnectionError as e:
            raise RequestFailed(f"{self.url}{path}: connection failed ({type(e).__name__})",
                                server_dead=True) from e
        return self._answer(path, r)

    def _answer(self, path: str, r) -> Any:
        if r.status_code >= 500:
            raise RequestFailed(f"{self.url}{path}: HTTP {r.status_code}: {r.text[:300]}", status=r.status_code)
        if r.status_code >= 400:
            raise RequestFailed(f"{self.url}{path}: HTTP {r.status_code}: {r.text[:300]}", retryable=False,
                                status=r.status_code)
        try:
            return r.json()
        except ValueError:
            return r.text

    def server_info(self, timeout: float = 60.0) -> dict:
        """The server's ``/server_info`` (``/get_server_info`` on an SGLang without it)."""
        try:
            out = self.get("/server_info", timeout=timeout)
        except RequestFailed as e:
            if e.status != 404:
                raise
            out = self.get("/get_server_info", timeout=timeout)
        if not isinstance(out, dict):
            raise RequestFailed(f"{self.url}/server_info: expected a JSON object, got {str(out)[:200]!r}",
                                retryable=False)
        return out

    def resolve_tp_size(self, timeout: float = 60.0) -> int:
        """The server's TP size: the known one, else asked of the server once (its
        ``/server_info`` reports ``tp_size``). A missing or bad value is an error naming the field."""
        if self.tp_size is None:
            info = self.server_info(timeout)
            if "tp_size" not in info:
                raise ValueError(f"SGLang server {self.url}: /server_info reports no tp_size "
                                 f"(keys: {sorted(info)[:20]})")
            self.tp_size = info["tp_size"]
        tp = self.tp_size
        if isinstance(tp, bool) or not isinstance(tp, int) or tp < 1:
            raise ValueError(f"SGLang server {self.url}: tp_size must be an integer >= 1, got {tp!r}")
        return tp

    def exited(self) -> bool:
        """A process launched here that is gone (False for an attached server)."""
        return self.proc is not None and self.proc.poll() is not None

    def healthy(self, timeout: float = 5.0) -> bool:
        """``/health`` answers 200 (the HTTP server is up; it says nothing of the scheduler)."""
        if self.exited():
            return False
        try:
            r = requests.get(self.url + "/health", headers=self.headers(), timeout=timeout)
            return r.status_code == 200
        except requests.RequestException:
            return False

    def probe(self, timeout: float) -> Tuple[bool, str]:
        """A real generation within ``timeout``: SGLang's ``/health_generate`` (it runs a
        one-token generation, or sees the scheduler answer what it already runs), or, on a
        server without that route, a one-token ``/generate``. A port that accepts connections
        proves nothing: a frozen scheduler answers ``/health`` but not this. Returns (ok, why)."""
        if self.exited():
            return False, f"process exited with code {self.proc.returncode}"
        try:
            r = requests.get(self.url + "/health_generate", headers=self.headers(), timeout=timeout)
            if r.status_code == 404:
                r = requests.post(self.url + "/generate", headers=self.headers(), timeout=timeout,
                                  json={"input_ids": [1], "sampling_params": {"max_new_tokens": 1, "temperature": 0}})
        except requests.Timeout:
            return False, f"no answer to a one-token generation within {timeout:.0f} s"
        except requests.RequestException as e:
            return False, f"probe failed: {type(e).__name__}"
        if r.status_code != 200:
            return False, f"probe answered HTTP {r.status_code}"
        return True, ""

    def describe(self) -> str:
        pid = f" pid={self.pid}" if self.pid else ""
        err = f" last error: {self.last_error}" if self.last_error else ""
        return f"{self.url}{pid} [{self.health.state.value}, served {self.served}]{err}"

    def __repr__(self):
        return f"SGLangServer({self.describe()})"


def default_sglang_python() -> str:
    return os.environ.get("MTEPO_SGLANG_PYTHON", str(REPO / ".venv-sglang" / "bin" / "python"))


#: files in a venv that tools/install_sglang_cpu.sh made (the first: its mark, written before it
#: installs anything; the second: its stamp, in venvs made before the mark was)
CPU_BUILD_MARKERS = (".mtepo-sglang-cpu", ".mtepo-sglang-installed")


def cpu_build_marker(python: str, prefix: Optional[str] = None) -> Optional[Path]:
    """The mark of tools/install_sglang_cpu.sh in the venv of ``python`` (``<venv>/bin/python``; a
    bare name is looked up on PATH) or in ``prefix`` (its ``sys.prefix``, where known), or None.
    A marked python is SGLang's CPU build, which cannot serve on a GPU."""
    if prefix is None:
        where = shutil.which(python) if os.sep not in python else python
        if where is None:
            return None
        prefix = str(Path(where).parent.parent)  # not resolved: a venv's python links elsewhere
    return next((Path(prefix) / m for m in CPU_BUILD_MARKERS if (Path(prefix) / m).is_file()), None)


@dataclass
class ServerConfig:
    """How the servers launched here are started (an attached server was started elsewhere)."""
    model_path: Optional[str] = None     # needed to launch servers
    host: str = "127.0.0.1"
    python: str = field(default_factory=default_sglang_python)
    dtype: str = "bfloat16"
    device: str = "cpu"                  # cpu or cuda
    tp: int = 1                          # GPUs per server (--tp-size)
    # CPU: SGLang budgets this fraction of the machine's memory and counts what other processes
    # allocate while it loads as weights; 0.05 failed on a busy machine. The KV pool itself stays
    # capped by max_total_tokens.
    mem_fraction_static: float = 0.5
    max_total_tokens: Optional[int] = 4096
    max_running_requests: Optional[int] = None  # None: SGLang's default
    context_length: Optional[int] = None        # None: the model's
    skip_warmup: bool = True
    extra_args: Sequence[str] = ()
    env: Dict[str, str] = field(default_factory=dict)
    threads_per_server: int = 1          # OMP threads of a launched CPU server
    startup_timeout: float = 180.0
    log_dir: Optional[str] = None


def server_command(cfg: ServerConfig, port: int, api_key: Optional[str] = None,
                   base_env: Optional[Dict[str, str]] = None) -> Tuple[List[str], Dict[str, str]]:
    """The command line and environment of one SGLang server: the single place that knows SGLang's
    flags (:func:`launch_server` and the serve command, ``python -m megatron_tepo.rollout.sglang.server``,
    which slurm/lib.sh runs, both use it). Pure: ``base_env`` (default ``os.environ``) is copied.

    The server is ``cfg.python megatron_tepo/rollout/sglang/launch.py ARGS``, SGLang's own launch
    with the API key read from the environment (``TEPO_SGLANG_API_KEY``, set here to ``api_key``;
    removed when there is none): no key on a command line, where ``ps`` shows it to every user.

    ``cfg.device == "cpu"`` adds the CPU engine's flags (torch-native attention, PyTorch sampling,
    no CUDA graphs, sleep when idle) and env (``SGLANG_USE_CPU_ENGINE=1``, no visible GPU, ``threads_per_server``
    OMP/MKL threads); ``"cuda"`` leaves the GPU choice to the caller's ``CUDA_VISIBLE_DEVICES``.
    """
    if not cfg.model_path:
        raise ValueError("ServerConfig.model_path is needed to launch SGLang servers")
    if cfg.device not in ("cpu", "cuda"):
        raise ValueError(f"ServerConfig.device: expected cpu or cuda, found {cfg.device!r}")
    marker = cpu_build_marker(cfg.python) if cfg.device == "cuda" else None
    if marker is not None:
        raise ValueError(f"device cuda: the SGLang python {cfg.python} is the CPU build of "
                         f"tools/install_sglang_cpu.sh ({marker}); set MTEPO_SGLANG_PYTHON (or --python) "
                         f"to a python with a CUDA build of SGLang")
    cmd = [cfg.python, SGLANG_LAUNCHER, "--model-path", str(cfg.model_path),
           "--host", cfg.host, "--port", str(int(port))]
    cmd += ["--dtype", cfg.dtype, "--device", cfg.device, "--mem-fraction-static", str(cfg.mem_fraction_static)]
    if cfg.skip_warmup:
        cmd += ["--skip-server-warmup"]
    if cfg.tp != 1:
        cmd += ["--tp-size", str(cfg.tp)]
    if cfg.max_total_tokens:
        cmd += ["--max-total-tokens", str(cfg.max_total_tokens)]
    if cfg.max_running_requests:
        cmd += ["--max-running-requests", str(cfg.max_running_requests)]
    if cfg.context_length:
        cmd += ["--context-length", str(cfg.context_length)]
    env = dict(os.environ if base_env is None else base_env)
    if cfg.device == "cpu":
        cmd += ["--attention-backend", "torch_native", "--sampling-backend", "pytorch",
                "--cuda-graph-backend-decode", "disabled", "--cuda-graph-backend-prefill", "disabled",
                # an idle CPU scheduler busy-polls: measured 101% of a core (2% with this flag), which
                # the trainer sharing the node loses; a request wakes it at once (zmq poll)
                "--sleep-on-idle"]
        env.update({"SGLANG_USE_CPU_ENGINE": "1", "CUDA_VISIBLE_DEVICES": "",
                    "OMP_NUM_THREADS": str(cfg.threads_per_server),
                    "MKL_NUM_THREADS": str(cfg.threads_per_server)})
    cmd += list(cfg.extra_args)
    env.pop("PYTHONPATH", None)  # the server runs in its own venv
    env.update(cfg.env)
    env.pop(API_KEY_ENV, None)
    if api_key:
        env[API_KEY_ENV] = api_key
    return cmd, env


def launch_server(cfg: ServerConfig, index: int = 0, api_key: Optional[str] = None) -> SGLangServer:
    """Start one server subprocess (own session, free port; its own random API key unless one is
    given -- servers behind one router share the router's) and return it unready."""
    if not cfg.model_path:
        raise ValueError("ServerConfig.model_path is needed to launch SGLang servers")
    if not Path(cfg.python).exists():
        raise FileNotFoundError(
            f"SGLang python {cfg.python} not found: run `bash tools/install_sglang_cpu.sh` "
            "(or set MTEPO_SGLANG_PYTHON / ServerConfig.python)")
    port = free_port(cfg.host)
    key = api_key or secrets.token_hex(16)
    proc, log_path = _spawn(*server_command(cfg, port, key), cfg.log_dir, f"sglang_server_{index}_{port}.log")
    return SGLangServer(f"http://{cfg.host}:{port}", key, proc, log_path, tp_size=cfg.tp)


def _spawn(cmd: List[str], env: Dict[str, str], log_dir: Optional[str], log_name: str):
    """``cmd`` as a subprocess in its own session (its process group is what :func:`stop_server`
    ends), stdout and stderr into ``log_name`` in ``log_dir`` (default ``$TMPDIR`` or /tmp)."""
    folder = Path(log_dir or os.environ.get("TMPDIR", "/tmp"))
    folder.mkdir(parents=True, exist_ok=True)
    log_path = str(folder / log_name)
    with open(log_path, "w") as f:
        proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    return proc, log_path


def _log_tail(path: Optional[str], n: int = 3000) -> str:
    if not path or not os.path.exists(path):
        return ""
    with open(path, errors="replace") as f:
        return f.read()[-n:]


def wait_ready(servers: List[SGLangServer], timeout: float) -> None:
    deadline = time.monotonic() + timeout
    pending = list(servers)
    while pending:
        for s in list(pending):
            if s.proc is not None and s.proc.poll() is not None:
                raise FleetError(f"SGLang server {s.url} exited with code {s.proc.returncode} while "
                                 f"starting; log {s.log_path}:\n{_log_tail(s.log_path)}")
            if s.healthy(timeout=2.0):
                pending.remove(s)
        if pending and time.monotonic() > deadline:
            raise FleetError(f"SGLang servers not ready after {timeout:.0f} s: "
                             + "; ".join(f"{s.url} (log {s.log_path}):\n{_log_tail(s.log_path, 1500)}"
                                         for s in pending))
        if pending:
            time.sleep(0.5)


def stop_server(s: SGLangServer, grace: float = 10.0) -> None:
    """Terminate a server this fleet launched: its whole process group (it forks workers)."""
    if s.proc is None:
        return
    pgid = s.proc.pid  # launched with start_new_session=True: the group id is the leader's pid
    for sig, wait_s in ((signal.SIGTERM, grace), (signal.SIGKILL, 5.0)):
        try:
            os.killpg(pgid, sig)
        except ProcessLookupError:
            break
        try:
            s.proc.wait(timeout=wait_s)
        except subprocess.TimeoutExpired:
            continue
        break
    try:  # workers of the group may outlive their leader (e.g. after the leader was killed)
        os.killpg(pgid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    if s.proc.poll() is None:
        s.proc.kill()
        s.proc.wait(timeout=5)
    if s.health.state not in (State.DEAD, State.RESTARTING):
        s.health.fire(Event.EXITED, "stopped")


# sglang-router ------------------------------------------------------------------------------
ROUTER_POLICIES = ("random", "round_robin", "cache_aware", "power_of_two")
_router_installed: Dict[str, bool] = {}


def router_installed(python: str) -> bool:
    """Whether ``python`` (the SGLang venv's) can import sglang_router (asked once per python)."""
    if python not in _router_installed:
        ok = Path(python).exists()
        if ok:
            env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
            try:
                ok = subprocess.run([python, "-c", "import sglang_router.launch_router"], env=env,
                                    capture_output=True, timeout=120).returncode == 0
            except (OSError, subprocess.TimeoutExpired):
                ok = False
        _router_installed[python] = ok
    return _router_installed[python]


def router_command(python: str, urls: Sequence[str], port: int, api_key: Optional[str] = None,
                   policy: str = "cache_aware", request_timeout: float = 120.0,
                   base_env: Optional[Dict[str, str]] = None) -> Tuple[List[str], Dict[str, str]]:
    """The command line and environment of sglang-router on loopback ``port`` in front of ``urls``
    (``policy``: its ``--policy``; ``request_timeout``: seconds it waits for a server).
    Pure: ``base_env`` (default ``os.environ``) is copied. The router is ``python
    megatron_tepo/rollout/sglang/launch.py router ARGS`` (sglang_router's own launch), its API key
    in the environment (``TEPO_SGLANG_API_KEY``; removed when there is none), never on the command
    line, where ``ps`` shows it to every user."""
    cmd = [python, SGLANG_LAUNCHER, "router", "--host", "127.0.0.1", "--port", str(int(port)),
           "--worker-urls", *urls, "--policy", policy,
           "--request-timeout-secs", str(int(max(request_timeout, 1))), "--log-level", "warn"]
    env = {k: v for k, v in (os.environ if base_env is None else base_env).items()
           if k not in ("PYTHONPATH", API_KEY_ENV)}
    if api_key:
        env[API_KEY_ENV] = api_key
    return cmd, env


def launch_router(cfg: ServerConfig, servers: List[SGLangServer], policy: str = "cache_aware",
                  request_timeout: float = 120.0) -> SGLangServer:
    """Start sglang-router on loopback in front of ``servers`` (one API key, which the router
    passes to them and checks on every request; given to it in the environment, see
    :func:`router_command`), with ``cfg``'s python, log folder and start-up time-out, and wait
    until it has registered every one."""
    keys = {s.api_key for s in servers}
    if len(keys) != 1:
        raise FleetError("sglang-router needs one API key for all servers; these have different keys: "
                         + ", ".join(s.url for s in servers))
    key = keys.pop()
    port = free_port("127.0.0.1")
    cmd, env = router_command(cfg.python, [s.url for s in servers], port, key, policy, request_timeout)
    proc, log_path = _spawn(cmd, env, cfg.log_dir, f"sglang_router_{port}.log")
    router = SGLangServer(f"http://127.0.0.1:{port}", key, proc, log_path)
    deadline = time.monotonic() + cfg.startup_timeout
    try:
        while True:  # healthy first, then every worker registered (it checks their /health)
            if proc.poll() is not None:
                raise FleetError(f"sglang-router exited with code {proc.returncode} while starting; "
                                 f"log {log_path}:\n{_log_tail(log_path)}")
            try:
                r = requests.get(router.url + "/workers", headers=router.headers(), timeout=2.0)
                if r.status_code == 200 and int(r.json().get("total", 0)) >= len(servers):
                    return router
            except (requests.RequestException, ValueError):
                pass
            if time.monotonic() > deadline:
                raise FleetError(f"sglang-router did not register {len(servers)} servers within "
                                 f"{cfg.startup_timeout:.0f} s; log {log_path}:\n{_log_tail(log_path, 1500)}")
            time.sleep(0.25)
    except BaseException:
        stop_server(router)
        raise


# the serve command ----------------------------------------------------------------------------
def configured_sglang_python() -> Optional[str]:
    """``$MTEPO_SGLANG_PYTHON``, else ``<repo>/.venv-sglang/bin/python`` where it exists; None when
    neither: then the serve command's own python serves, if it imports sglang."""
    py = default_sglang_python()
    return py if Path(py).exists() or "MTEPO_SGLANG_PYTHON" in os.environ else None


def find_sglang_python(explicit: Optional[str] = None) -> str:
    if explicit:
        return explicit
    py = configured_sglang_python()
    if py is not None:
        return py
    if importlib.util.find_spec("sglang") is not None:
        return sys.executable
    raise FileNotFoundError(f"no SGLang python: {default_sglang_python()} does not exist and {sys.executable} "
                            "cannot import sglang; set MTEPO_SGLANG_PYTHON or --python "
                            "(CPU: bash tools/install_sglang_cpu.sh)")


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m megatron_tepo.rollout.sglang.server",
                                 description="Start one SGLang server in the foreground (the Slurm launchers run "
                                             "this on every rollout node).")
    ap.add_argument("--model-path", required=True)
    ap.add_argument("--port", type=int, required=True)
    ap.add_argument("--host", default="0.0.0.0")
    ap.add_argument("--tp", type=int, default=1, help="GPUs per server (SGLang --tp-size)")
    ap.add_argument("--device", choices=("cpu", "cuda"), default="cuda")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--mem-fraction-static", type=float, default=None,
                    help="default: 0.85 on cuda, 0.5 on cpu (the KV pool is capped by --max-total-tokens)")
    ap.add_argument("--max-running-requests", type=int, default=None)
    ap.add_argument("--context-length", type=int, default=None)
    ap.add_argument("--max-total-tokens", type=int, default=None, help="KV pool in tokens (CPU default 4096)")
    ap.add_argument("--threads", type=int, default=1, help="OMP threads of a CPU server")
    ap.add_argument("--warmup", action="store_true", help="let SGLang run its warm-up request")
    ap.add_argument("--python", default=None, help="the python with sglang")
    ap.add_argument("--api-key-env", default="TEPO_SGLANG_API_KEY",
                    help="environment variable holding the API key (unset or empty: no key)")
    ap.add_argument("--print", action="store_true", help="print the command instead of running it")
    ap.add_argument("extra", nargs=argparse.REMAINDER, help="after --: passed to SGLang's launch_server")
    return ap


def command(args: argparse.Namespace):
    """The server's command line and environment from the serve command's arguments."""
    cpu = args.device == "cpu"
    extra = list(args.extra)
    if extra and extra[0] == "--":
        extra = extra[1:]
    cfg = ServerConfig(
        model_path=args.model_path, host=args.host, python=find_sglang_python(args.python),
        dtype=args.dtype, device=args.device, tp=args.tp,
        mem_fraction_static=args.mem_fraction_static if args.mem_fraction_static is not None
        else (0.5 if cpu else 0.85),
        max_total_tokens=args.max_total_tokens if args.max_total_tokens is not None else (4096 if cpu else None),
        max_running_requests=args.max_running_requests, context_length=args.context_length,
        skip_warmup=not args.warmup, extra_args=extra, threads_per_server=args.threads)
    return server_command(cfg, args.port, os.environ.get(args.api_key_env) or None)


def main(argv: Optional[List[str]] = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        argv_out, env = command(args)
    except (ValueError, FileNotFoundError) as exc:
        print(f"serve: {exc}", file=sys.stderr)
        return 2
    shown = shlex.join(argv_out)
    if args.print:
        changed = {k: v for k, v in env.items() if os.environ.get(k) != v or k == API_KEY_ENV}
        removed = sorted(k for k in os.environ if k not in env)
        print(" ".join([*(f"{k}={'***' if k == API_KEY_ENV else shlex.quote(v)}" for k, v in sorted(changed.items())),
                        *(f"-u {k}" for k in removed)]))
        print(shown)
        return 0
    print(f"serve: {shown}", file=sys.stderr, flush=True)
    os.execvpe(argv_out[0], argv_out, env)
    return 1  # pragma: no cover - exec does not return


if __name__ == "__main__":
    sys.exit(main())
