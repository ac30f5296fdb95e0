"""One SGLang server as a process of this one: :func:`launch_server` starts it (its command line
from ``options.py``'s :func:`~megatron_tepo.rollout.sglang.options.server_command`, its own session
so that its whole process group can be stopped, a free port, a random API key handed over in its
environment), :func:`wait_ready` waits for its ``/health``, :func:`stop_server` ends its process
group. :func:`spawn` and :func:`log_tail` are shared with sglang-router's process (``router.py``).

``python -m megatron_tepo.rollout.sglang.server`` is the serve command (``serve.py``: one server in
the foreground on a rollout node; the Slurm launchers and users run it by this name).

Left out: the options and SGLang's flags (``options.py``), the HTTP calls (``client.py``), the
router (``router.py``), spreading requests over the servers and retrying them (``dispatch.py``),
weight updates (``weight_sync/``), and what runs inside the server process (``launch.py``).
"""
from __future__ import annotations

import os
import secrets
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Dict, List, Optional

from megatron_tepo.net import free_port
from megatron_tepo.rollout.sglang.client import FleetError, SGLangServer
from megatron_tepo.rollout.sglang.health import Event, State
from megatron_tepo.rollout.sglang.options import ServerConfig, default_sglang_python, server_command

# ServerConfig and its default python are options.py's; named here too, as what launch_server takes
__all__ = ["ServerConfig", "default_sglang_python", "launch_server", "spawn", "log_tail", "wait_ready", "stop_server"]


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
    proc, log_path = spawn(*server_command(cfg, port, key), cfg.log_dir, f"sglang_server_{index}_{port}.log")
    return SGLangServer(f"http://{cfg.host}:{port}", key, proc, log_path, tp_size=cfg.tp)


def spawn(cmd: List[str], env: Dict[str, str], log_dir: Optional[str], log_name: str):
    """``cmd`` as a subprocess in its own session (its process group is what :func:`stop_server`
    ends), stdout and stderr into ``log_name`` in ``log_dir`` (default ``$TMPDIR`` or /tmp)."""
    folder = Path(log_dir or os.environ.get("TMPDIR", "/tmp"))
    folder.mkdir(parents=True, exist_ok=True)
    log_path = str(folder / log_name)
    with open(log_path, "w") as f:
        proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    return proc, log_path


def log_tail(path: Optional[str], n: int = 3000) -> str:
    """The last ``n`` characters of a log ("" when there is none)."""
    if not path or not os.path.exists(path):
        return ""
    with open(path, errors="replace") as f:
        return f.read()[-n:]


def wait_ready(servers: List[SGLangServer], timeout: float) -> None:
    """Until every server answers ``/health``; :class:`FleetError` with the logs when one exits or
    the time-out passes."""
    deadline = time.monotonic() + timeout
    pending = list(servers)
    while pending:
        for s in list(pending):
            if s.proc is not None and s.proc.poll() is not None:
                raise FleetError(f"SGLang server {s.url} exited with code {s.proc.returncode} while "
                                 f"starting; log {s.log_path}:\n{log_tail(s.log_path)}")
            if s.healthy(timeout=2.0):
                pending.remove(s)
        if pending and time.monotonic() > deadline:
            raise FleetError(f"SGLang servers not ready after {timeout:.0f} s: "
                             + "; ".join(f"{s.url} (log {s.log_path}):\n{log_tail(s.log_path, 1500)}"
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


if __name__ == "__main__":
    from megatron_tepo.rollout.sglang.serve import main

    sys.exit(main())
