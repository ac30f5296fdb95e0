"""sglang-router in front of several SGLang servers: whether the SGLang python has it
(:func:`router_installed`), its command line (:func:`router_command`) and its process on loopback
(:func:`launch_router`, which waits until it has registered every server).

Left out: whether the fleet has one (``fleet.py``), when it uses it and rebuilds it
(``dispatch.py``); one server's process (``server.py``) and HTTP calls (``client.py``), which the
router's process reuses.
"""
from __future__ import annotations

import os
import subprocess
import time
from pathlib import Path
from typing import Dict, List, Optional, Sequence, Tuple

import requests

from megatron_tepo.net import free_port
from megatron_tepo.rollout.sglang.client import FleetError, SGLangServer
from megatron_tepo.rollout.sglang.options import API_KEY_ENV, SGLANG_LAUNCHER, ServerConfig
from megatron_tepo.rollout.sglang.server import log_tail, spawn, stop_server

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
    proc, log_path = spawn(cmd, env, cfg.log_dir, f"sglang_router_{port}.log")
    router = SGLangServer(f"http://127.0.0.1:{port}", key, proc, log_path)
    deadline = time.monotonic() + cfg.startup_timeout
    try:
        while True:  # healthy first, then every worker registered (it checks their /health)
            if proc.poll() is not None:
                raise FleetError(f"sglang-router exited with code {proc.returncode} while starting; "
                                 f"log {log_path}:\n{log_tail(log_path)}")
            try:
                r = requests.get(router.url + "/workers", headers=router.headers(), timeout=2.0)
                if r.status_code == 200 and int(r.json().get("total", 0)) >= len(servers):
                    return router
            except (requests.RequestException, ValueError):
                pass
            if time.monotonic() > deadline:
                raise FleetError(f"sglang-router did not register {len(servers)} servers within "
                                 f"{cfg.startup_timeout:.0f} s; log {log_path}:\n{log_tail(log_path, 1500)}")
            time.sleep(0.25)
    except BaseException:
        stop_server(router)
        raise
