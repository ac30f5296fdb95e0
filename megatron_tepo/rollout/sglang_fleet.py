"""A fleet of SGLang servers behind the :class:`RolloutEngine` interface.

Servers are either started here as subprocesses (SGLang's launch, through ``sglang_launch.py``
under the SGLang venv's python, each with a random API key -- its own, or one shared by the
servers behind a router -- handed over in the environment, never on the command line; bound to ``FleetConfig.host`` -- loopback by default -- on a free port) or attached to by URL
(with their API key). A step's requests (one per prompt group) are spread over the healthy servers: by sglang-router where it is installed (``FleetConfig.router``;
``auto``: when the SGLang python imports ``sglang_router`` and there are two servers or more), a
router process started here on loopback that holds the servers' API key and checks it on every
request; least-loaded first (fewest requests in flight) otherwise. A request that fails (connection
refused or reset, time-out, HTTP 5xx) -- through the router, after the router's own retries on its
other workers -- is moved to another server directly; the server it failed on is health-checked
and dropped from the rotation if it does not answer (a dead router is dropped the same way). When
no server is left -- or the step's deadline passes -- :class:`FleetError` names every server and
its last error. Weight updates and cache flushes go to every server directly, never through the
router.

SGLang on CPU: ``tools/install_sglang_cpu.sh`` builds the venv whose python starts the servers
(``FleetConfig.python``, default ``$MTEPO_SGLANG_PYTHON`` or ``<repo>/.venv-sglang/bin/python``).
"""
from __future__ import annotations

import logging
import os
import secrets
import signal
import subprocess
import threading
import time
from concurrent.futures import FIRST_COMPLETED, ThreadPoolExecutor, wait
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Dict, Iterable, List, Optional, Sequence, Tuple

import requests
import torch

from megatron_tepo.rollout.engine import (FINISH_LENGTH, FINISH_STOP, Group, RolloutEngine, Sample,
                                          make_params, validate_prompts)
from megatron_tepo.rollout.net import free_port

log = logging.getLogger(__name__)
REPO = Path(__file__).resolve().parents[2]


class FleetError(RuntimeError):
    """No server could answer (all dead, or the deadline passed)."""


class RequestFailed(Exception):
    """``status``: the HTTP status when the server answered one (404: it has no such route)."""

    def __init__(self, msg: str, server_dead: bool = False, retryable: bool = True,
                 status: Optional[int] = None):
        super().__init__(msg)
        self.server_dead, self.retryable, self.status = server_dead, retryable, status


def default_sglang_python() -> str:
    return os.environ.get("MTEPO_SGLANG_PYTHON", str(REPO / ".venv-sglang" / "bin" / "python"))


@dataclass
class FleetConfig:
    model_path: Optional[str] = None     # needed to launch servers
    num_servers: int = 0                 # servers to launch
    urls: Sequence[str] = ()             # servers to attach to
    api_keys: Sequence[Optional[str]] = ()  # one per url (None: no key)
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
    request_timeout: float = 120.0       # one HTTP request
    step_timeout: float = 600.0          # one generate() call, retries included
    max_attempts: int = 4                # per request, over distinct servers where possible
    health_timeout: float = 5.0
    max_concurrency: int = 64            # requests in flight over the whole fleet
    log_dir: Optional[str] = None
    # sglang-router in front of the servers: "auto" (when cfg.python imports sglang_router and
    # there are >= 2 servers), "sglang_router" (required), "none" (least-loaded dispatch here)
    router: str = "auto"
    router_policy: str = "cache_aware"   # sglang-router's --policy


class SGLangServer:
    """One server: its URL, key, (if launched here) its process, its load, and its TP size.

    ``tp_size``: the server's tensor-parallel size (how many TP workers join a weight-update
    group), known when the fleet launched it (``FleetConfig.tp``); ``None`` for an attached
    server until :meth:`resolve_tp_size` asks the server (``/server_info``)."""

    def __init__(self, url: str, api_key: Optional[str] = None, proc: Optional[subprocess.Popen] = None,
                 log_path: Optional[str] = None, tp_size: Optional[int] = None):
        self.url, self.api_key, self.proc, self.log_path = url.rstrip("/"), api_key, proc, log_path
        self.tp_size = tp_size
        self.inflight = 0
        self.alive = True
        self.last_error: Optional[str] = None
        self.served = 0

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

    def healthy(self, timeout: float = 5.0) -> bool:
        if self.proc is not None and self.proc.poll() is not None:
            return False
        try:
            r = requests.get(self.url + "/health", headers=self.headers(), timeout=timeout)
            return r.status_code == 200
        except requests.RequestException:
            return False

    def describe(self) -> str:
        state = "alive" if self.alive else "down"
        pid = f" pid={self.pid}" if self.pid else ""
        err = f" last error: {self.last_error}" if self.last_error else ""
        return f"{self.url}{pid} [{state}, served {self.served}]{err}"

    def __repr__(self):
        return f"SGLangServer({self.describe()})"


# run by path with the SGLang venv's python (which need not have megatron_tepo installed)
SGLANG_LAUNCHER = str(Path(__file__).resolve().with_name("sglang_launch.py"))
API_KEY_ENV = "TEPO_SGLANG_API_KEY"  # the servers' key, in their environment (sglang_launch.py reads it)


def server_command(cfg: FleetConfig, port: int, api_key: Optional[str] = None,
                   base_env: Optional[Dict[str, str]] = None) -> Tuple[List[str], Dict[str, str]]:
    """The command line and environment of one SGLang server: the single place that knows SGLang's
    flags (the fleet's :func:`launch_server` and ``python -m megatron_tepo.rollout.serve``, which
    slurm/lib.sh runs, both use it). Pure: ``base_env`` (default ``os.environ``) is copied.

    The server is ``cfg.python megatron_tepo/rollout/sglang_launch.py ARGS``, SGLang's own launch
    with the API key read from the environment (``TEPO_SGLANG_API_KEY``, set here to ``api_key``;
    removed when there is none): no key on a command line, where ``ps`` shows it to every user.

    ``cfg.device == "cpu"`` adds the CPU engine's flags (torch-native attention, PyTorch sampling,
    no CUDA graphs, sleep when idle) and env (``SGLANG_USE_CPU_ENGINE=1``, no visible GPU, ``threads_per_server``
    OMP/MKL threads); ``"cuda"`` leaves the GPU choice to the caller's ``CUDA_VISIBLE_DEVICES``.
    """
    if not cfg.model_path:
        raise ValueError("FleetConfig.model_path is needed to launch SGLang servers")
    if cfg.device not in ("cpu", "cuda"):
        raise ValueError(f"FleetConfig.device: expected cpu or cuda, found {cfg.device!r}")
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


def launch_server(cfg: FleetConfig, index: int = 0, api_key: Optional[str] = None) -> SGLangServer:
    """Start one server subprocess (own session, free port; its own random API key unless one is
    given -- servers behind one router share the router's) and return it unready."""
    if not cfg.model_path:
        raise ValueError("FleetConfig.model_path is needed to launch SGLang servers")
    if not Path(cfg.python).exists():
        raise FileNotFoundError(
            f"SGLang python {cfg.python} not found: run `bash tools/install_sglang_cpu.sh` "
            "(or set MTEPO_SGLANG_PYTHON / FleetConfig.python)")
    port = free_port(cfg.host)
    key = api_key or secrets.token_hex(16)
    cmd, env = server_command(cfg, port, key)
    log_dir = Path(cfg.log_dir or os.environ.get("TMPDIR", "/tmp"))
    log_dir.mkdir(parents=True, exist_ok=True)
    log_path = str(log_dir / f"sglang_server_{index}_{port}.log")
    with open(log_path, "w") as f:
        proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, env=env,
                                start_new_session=True)
    return SGLangServer(f"http://{cfg.host}:{port}", key, proc, log_path, tp_size=cfg.tp)


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
    s.alive = False


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


def use_router(cfg: FleetConfig, n_servers: int) -> bool:
    """Resolve ``cfg.router`` for a fleet of ``n_servers``; errors name the setting."""
    if cfg.router not in ("auto", "sglang_router", "none"):
        raise ValueError(f"FleetConfig.router: expected auto, sglang_router or none, found {cfg.router!r}")
    if cfg.router_policy not in ROUTER_POLICIES:
        raise ValueError(f"FleetConfig.router_policy: expected one of {ROUTER_POLICIES}, found {cfg.router_policy!r}")
    if cfg.router == "none":
        return False
    if cfg.router == "auto":
        return n_servers >= 2 and router_installed(cfg.python)
    if not router_installed(cfg.python):
        raise FleetError(f"FleetConfig.router=sglang_router but {cfg.python} cannot import sglang_router: "
                         "`bash tools/install_sglang_cpu.sh` installs it (or pip install sglang-router)")
    return True


def router_command(cfg: FleetConfig, urls: Sequence[str], port: int, api_key: Optional[str] = None,
                   base_env: Optional[Dict[str, str]] = None) -> Tuple[List[str], Dict[str, str]]:
    """The command line and environment of sglang-router on loopback ``port`` in front of ``urls``.
    Pure: ``base_env`` (default ``os.environ``) is copied. The router is ``cfg.python
    megatron_tepo/rollout/sglang_launch.py router ARGS`` (sglang_router's own launch), its API key
    in the environment (``TEPO_SGLANG_API_KEY``; removed when there is none), never on the command
    line, where ``ps`` shows it to every user."""
    cmd = [cfg.python, SGLANG_LAUNCHER, "router", "--host", "127.0.0.1", "--port", str(int(port)),
           "--worker-urls", *urls, "--policy", cfg.router_policy,
           "--request-timeout-secs", str(int(max(cfg.request_timeout, 1))), "--log-level", "warn"]
    env = {k: v for k, v in (os.environ if base_env is None else base_env).items()
           if k not in ("PYTHONPATH", API_KEY_ENV)}
    if api_key:
        env[API_KEY_ENV] = api_key
    return cmd, env


def launch_router(cfg: FleetConfig, servers: List[SGLangServer]) -> SGLangServer:
    """Start sglang-router on loopback in front of ``servers`` (one API key, which the router
    passes to them and checks on every request; given to it in the environment, see
    :func:`router_command`), and wait until it has registered every one."""
    keys = {s.api_key for s in servers}
    if len(keys) != 1:
        raise FleetError("sglang-router needs one API key for all servers; these have different keys: "
                         + ", ".join(s.url for s in servers))
    key = keys.pop()
    port = free_port("127.0.0.1")
    cmd, env = router_command(cfg, [s.url for s in servers], port, key)
    log_dir = Path(cfg.log_dir or os.environ.get("TMPDIR", "/tmp"))
    log_dir.mkdir(parents=True, exist_ok=True)
    log_path = str(log_dir / f"sglang_router_{port}.log")
    with open(log_path, "w") as f:
        proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, env=env, start_new_session=True)
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


def parse_generate_output(out: dict) -> Sample:
    meta = out.get("meta_info", {})
    fr = meta.get("finish_reason") or {}
    kind = fr.get("type") if isinstance(fr, dict) else str(fr)
    lps = meta.get("output_token_logprobs") or []
    ids = out.get("output_ids")
    if ids is None:
        ids = [int(t[1]) for t in lps]
    if kind == "abort":
        raise RequestFailed(f"request aborted by the server: {fr}")
    reason = FINISH_STOP if kind == "stop" else FINISH_LENGTH
    return Sample([int(t) for t in ids], [float(t[0]) for t in lps], reason,
                  meta={"matched_stop": fr.get("matched") if isinstance(fr, dict) else None})


class SGLangFleet(RolloutEngine):
    def __init__(self, cfg: FleetConfig, weight_sync=None):
        self.cfg = cfg
        self.servers: List[SGLangServer] = []
        self._lock = threading.Lock()
        self.router: Optional[SGLangServer] = None
        keys = list(cfg.api_keys) + [None] * (len(cfg.urls) - len(cfg.api_keys))
        self.servers += [SGLangServer(u, k) for u, k in zip(cfg.urls, keys)]
        routed = use_router(cfg, len(self.servers) + cfg.num_servers)
        if routed and len(set(keys)) > 1:
            if cfg.router == "sglang_router":
                raise ValueError("FleetConfig.api_keys: sglang-router needs one API key for all servers")
            log.warning("SGLang fleet: the attached servers have different API keys; least-loaded "
                        "dispatch instead of sglang-router")
            routed = False
        # servers behind one router share its key (the attached servers' one, or a new one)
        shared_key = (keys[0] if keys else secrets.token_hex(16)) if routed else None
        try:
            launched = [launch_server(cfg, i, shared_key) for i in range(cfg.num_servers)]
            self.servers += launched
            wait_ready(self.servers, cfg.startup_timeout)
            if not self.servers:
                raise ValueError("FleetConfig names no server: set num_servers or urls")
            if routed:
                self.router = launch_router(cfg, self.servers)
        except BaseException:
            self.close()
            raise
        self.routed = 0  # requests answered through the router
        self.weight_sync = weight_sync

    # ------------------------------------------------------------------ dispatch
    def alive_servers(self) -> List[SGLangServer]:
        return [s for s in self.servers if s.alive]

    def _describe_all(self) -> str:
        out = "; ".join(s.describe() for s in self.servers)
        if self.router is not None:
            out += f"; sglang-router {self.router.describe()}"
        return out

    def _pick(self, exclude: set) -> Optional[SGLangServer]:
        with self._lock:
            cands = [s for s in self.servers if s.alive and s.url not in exclude]
            if not cands:
                cands = [s for s in self.servers if s.alive]  # all tried: reuse a live one
            if not cands:
                return None
            best = min(cands, key=lambda s: (s.inflight, s.served))
            best.inflight += 1
            return best

    def _mark_failed(self, s: SGLangServer, err: RequestFailed) -> None:
        s.last_error = str(err)
        if err.server_dead or not s.healthy(self.cfg.health_timeout):
            if s.alive:
                log.warning("SGLang server %s dropped from the fleet: %s", s.url, err)
            s.alive = False

    def _run_one(self, path: str, payload: dict, deadline: float, parse):
        """Send one request, moving it to another server on failure, until the deadline."""
        tried: set = set()
        errors: List[str] = []
        router = self.router
        if router is not None and router.alive and self.alive_servers():
            try:
                out = router.post(path, payload, timeout=min(self.cfg.request_timeout,
                                                              max(deadline - time.monotonic(), 0.1)))
                result = parse(out)
                with self._lock:
                    self.routed += 1
                return result
            except RequestFailed as e:  # the router retried its other workers already
                errors.append(f"via sglang-router: {e}")
                if not e.retryable:
                    raise FleetError(f"request rejected by sglang-router {router.url}: {e}") from e
                self._mark_failed(router, e)
                # which server failed it? drop the dead ones
                self._drop_unhealthy("no answer to /health",
                                     min(self.cfg.health_timeout, max(deadline - time.monotonic(), 0.5)))
        for attempt in range(self.cfg.max_attempts):
            left = deadline - time.monotonic()
            if left <= 0:
                break
            s = self._pick(tried)
            if s is None:
                break
            tried.add(s.url)
            try:
                out = s.post(path, payload, timeout=min(self.cfg.request_timeout, left))
                result = parse(out)
                s.served += 1
                return result
            except RequestFailed as e:
                errors.append(str(e))
                if not e.retryable:
                    raise FleetError(f"request rejected by {s.url}: {e}") from e
                self._mark_failed(s, e)
            finally:
                with self._lock:
                    s.inflight -= 1
        reason = ("the step time-out passed" if time.monotonic() >= deadline else
                  "no SGLang server is left" if not self.alive_servers() else
                  f"{self.cfg.max_attempts} attempts failed")
        raise FleetError(f"{reason}; attempts: {errors or 'none'}; servers: {self._describe_all()}")

    def _run_all(self, path: str, payloads: List[dict], parse) -> List[Any]:
        deadline = time.monotonic() + self.cfg.step_timeout
        if not self.alive_servers():
            raise FleetError(f"no SGLang server is left; servers: {self._describe_all()}")
        workers = max(1, min(self.cfg.max_concurrency, len(payloads)))
        results: List[Any] = [None] * len(payloads)
        pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="sglang-req")
        try:
            futs = {pool.submit(self._run_one, path, p, deadline, parse): i for i, p in enumerate(payloads)}
            pending = set(futs)
            while pending:
                left = deadline - time.monotonic() + 5.0  # requests honour the deadline themselves
                done, pending = wait(pending, timeout=max(left, 0.1), return_when=FIRST_COMPLETED)
                if not done and time.monotonic() > deadline + 5.0:
                    raise FleetError(f"step time-out ({self.cfg.step_timeout:.0f} s) passed with "
                                     f"{len(pending)} requests unanswered; servers: {self._describe_all()}")
                for f in done:
                    results[futs[f]] = f.result()  # raises FleetError of that request
        finally:
            pool.shutdown(wait=False, cancel_futures=True)
        if self.router is not None:
            # behind the router a dead server goes unnoticed here (the router retries on the
            # others), but the weight sync talks to every live server
            self._drop_unhealthy("no answer to /health after a routed step", self.cfg.health_timeout)
        return results

    def _drop_unhealthy(self, why: str, timeout: float) -> None:
        """Drop from the fleet every live server that does not answer /health within ``timeout``."""
        for s in self.alive_servers():
            if not s.healthy(timeout):
                self._mark_failed(s, RequestFailed(f"{s.url}: {why}", server_dead=True))

    # ------------------------------------------------------------------ RolloutEngine
    def generate(self, prompts: List[List[int]], n: int = 1, temperature: float = 1.0,
                 top_p: float = 1.0, max_new_tokens: int = 128,
                 stop_token_ids: Sequence[int] = (), seed: Optional[int] = None) -> List[Group]:
        sp = make_params(n, temperature, top_p, max_new_tokens, stop_token_ids)
        validate_prompts(prompts)
        sampling = {"n": sp.n, "temperature": sp.temperature, "top_p": sp.top_p, "top_k": -1,
                    "max_new_tokens": sp.max_new_tokens, "stop_token_ids": list(sp.stop_token_ids),
                    # SGLang checks stop_token_ids only when ignore_eos is false; then the model's
                    # own EOS id also stops (pass it in stop_token_ids to be explicit)
                    "ignore_eos": not sp.stop_token_ids, "skip_special_tokens": False}
        payloads = []
        for i, p in enumerate(prompts):
            s = dict(sampling)
            if seed is not None:
                s["sampling_seed"] = int(seed) + i
            payloads.append({"input_ids": [int(t) for t in p], "sampling_params": s,
                             "return_logprob": True, "logprob_start_len": -1})

        def parse(out):
            outs = out if isinstance(out, list) else [out]
            if len(outs) != sp.n:
                raise RequestFailed(f"expected {sp.n} samples, got {len(outs)}")
            return [parse_generate_output(o) for o in outs]

        return self._run_all("/generate", payloads, parse)

    def score(self, sequences: List[List[int]], prompt_lens: List[int],
              temperature: float = 1.0) -> List[List[float]]:
        """The server's log-probs of ``seq[prompt_len:]`` (prefill only, no sampling).

        SGLang's input-token log-probs are ``log_softmax(logits)`` (temperature 1) whatever the
        sampling temperature; the log-probs that :meth:`generate` returns are under ``logits / T``.
        """
        if temperature != 1.0:
            raise NotImplementedError("SGLang scores fixed tokens at temperature 1 only")
        payloads = [{"input_ids": [int(t) for t in seq],
                     "sampling_params": {"max_new_tokens": 0, "temperature": temperature},
                     "return_logprob": True, "logprob_start_len": int(pl) - 1}
                    for seq, pl in zip(sequences, prompt_lens)]

        def parse(out):
            out = out[0] if isinstance(out, list) else out
            lps = out["meta_info"]["input_token_logprobs"]
            return [float(t[0]) for t in lps[1:]]  # the first is the prompt's last token's own

        return self._run_all("/generate", payloads, parse)

    def broadcast(self, path: str, payload: Optional[dict] = None, timeout: Optional[float] = None) -> List[Any]:
        """POST to every live server (weight updates, cache flushes); a failure is an error."""
        outs = []
        for s in self.alive_servers():
            try:
                outs.append(s.post(path, payload, timeout=timeout or self.cfg.request_timeout))
            except RequestFailed as e:
                self._mark_failed(s, e)
                raise FleetError(f"{path} failed on {s.url}: {e}; servers: {self._describe_all()}") from e
        return outs

    def update_weights(self, named_tensors: Iterable[Tuple[str, torch.Tensor]]) -> None:
        """Push the stream to every live server (the fleet's :class:`WeightSync`; ``tensor`` mode
        unless the trainer set another up), servers paused, then one cache flush."""
        if self.weight_sync is None:
            from megatron_tepo.rollout.sglang.weight_sync import TensorSync

            self.weight_sync = TensorSync(self)
        self.weight_sync.push(named_tensors)

    def flush_cache(self) -> None:
        self.broadcast("/flush_cache")

    def close(self) -> None:
        ws, self.weight_sync = getattr(self, "weight_sync", None), None
        if ws is not None and hasattr(ws, "close"):
            ws.close()
        router, self.router = getattr(self, "router", None), None
        if router is not None:
            stop_server(router)
        for s in self.servers:
            stop_server(s)
