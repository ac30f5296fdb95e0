"""The serve command: one SGLang server in the foreground, what slurm/lib.sh and the nemo-run
launcher run on every rollout node (as ``python -m megatron_tepo.rollout.sglang.server``)::

    python -m megatron_tepo.rollout.sglang.server --model-path /models/Qwen3-14B --port 30000 --tp 2 \\
        --device cuda [--host 127.0.0.1] [--mem-fraction-static 0.85] [--max-running-requests 64] \\
        [--context-length 10240] [--make-api-key | --allow-open] [--print] [-- EXTRA SGLANG ARGS]

Its options are :class:`~megatron_tepo.rollout.sglang.options.ServerConfig`'s, read back into that
type (what the launchers write with ``ServerConfig.to_argv``; defaults: the config's, and for the
device :data:`~megatron_tepo.rollout.sglang.options.SERVE_COMMAND_DEFAULTS`); the command
line is ``server_command``'s (so the CPU flags and environment live in one place), and the command
*execs* SGLang (same pid, so ``srun`` and signals reach the server itself). Its own arguments: the
``--port``; the SGLang python ``--python``, else ``find_sglang_python``'s
(``$MTEPO_SGLANG_PYTHON`` / ``<repo>/.venv-sglang/bin/python``, else this python if it can import
sglang); the API key, read from the environment variable named by ``--api-key-env`` (default
``TEPO_SGLANG_API_KEY``) and handed on in the server's environment (``TEPO_SGLANG_API_KEY``, which
``launch.py`` gives SGLang inside the process): it is on no command line, this one or SGLang's,
and masked in what is printed; ``--print`` prints the command (and the environment it changes)
instead of running it.

Who can reach it (:func:`check_exposure`): the server listens on 127.0.0.1 unless ``--host`` says
otherwise (the launchers say ``--host 0.0.0.0`` and give the job's key). Any address other than a
loopback one needs an API key: the environment's, or ``--make-api-key`` (a new random key, printed
once on stderr for the user to give the clients, and handed to the server in its environment), or
``--allow-open``, the user's explicit word that anyone who reaches the host may load weights into
the server or stop it. Without one of them the command refuses in one line, before anything starts.

Left out: starting servers as subprocesses of a fleet (``server.py``), restarting one that exits
(slurm/lib.sh's ``tepo_keep_serving``).
"""
from __future__ import annotations

import argparse
import ipaddress
import os
import secrets
import shlex
import socket
import sys
from typing import List, Optional

from megatron_tepo.rollout.sglang.options import (API_KEY_ENV, SERVE_COMMAND_DEFAULTS, ServerConfig, find_sglang_python,
                                                  server_command)


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m megatron_tepo.rollout.sglang.server",
                                 description="Start one SGLang server in the foreground (the Slurm launchers run "
                                             "this on every rollout node).")
    ap.add_argument("--port", type=int, required=True)
    ap.add_argument("--python", default=None, help="the python with sglang")
    ap.add_argument("--api-key-env", default=API_KEY_ENV,
                    help="environment variable holding the API key (unset or empty: no key)")
    ap.add_argument("--print", action="store_true", help="print the command instead of running it")
    ap.add_argument("--make-api-key", action="store_true",
                    help="a --host other than loopback without a key in the environment: make a random key, "
                         "print it once on stderr and require it")
    ap.add_argument("--allow-open", action="store_true",
                    help="listen on a --host other than loopback WITHOUT an API key: anyone who reaches the host "
                         "can load weights into the server or stop it")
    ServerConfig.add_arguments(ap, required=("model_path",), **SERVE_COMMAND_DEFAULTS)
    return ap


def is_loopback(host: str) -> bool:
    """Whether ``host`` (an address or a name) is only reachable from this machine: a loopback
    address, or a name whose every address is one (a name that does not resolve: not loopback)."""
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        pass
    try:
        addrs = {info[4][0] for info in socket.getaddrinfo(host, None)}
    except (OSError, UnicodeError):
        return False
    return bool(addrs) and all(ipaddress.ip_address(a.split("%")[0]).is_loopback for a in addrs)


def check_exposure(host: str, api_key: Optional[str], args: argparse.Namespace) -> Optional[str]:
    """The API key a server on ``host`` gets: ``api_key`` (the environment's), else on a host other
    than loopback a new one (``--make-api-key``) or none (``--allow-open``); ValueError (one line)
    when a host other than loopback has none of the three."""
    if api_key or is_loopback(host):
        return api_key
    if args.make_api_key:
        return secrets.token_hex(16)
    if args.allow_open:
        return None
    raise ValueError(f"--host {host} is reachable from other machines and no API key is set: give one in "
                     f"${args.api_key_env} (the key clients send; never on a command line), or --make-api-key "
                     f"(a new one, printed once), or --allow-open (no key: anyone who reaches this host can "
                     f"load weights or stop the server); without --host it listens on 127.0.0.1 only")


def command(args: argparse.Namespace, api_key: Optional[str] = None):
    """The server's command line and environment from the serve command's arguments (``api_key``:
    the key to require, by default the environment's)."""
    cfg = ServerConfig.from_namespace(args, python=find_sglang_python(args.python))
    return server_command(cfg, args.port, api_key if api_key is not None else os.environ.get(args.api_key_env) or None)


def main(argv: Optional[List[str]] = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        given = os.environ.get(args.api_key_env) or None
        key = check_exposure(args.host, given, args)
        argv_out, env = command(args, key or "")
    except (ValueError, FileNotFoundError) as exc:
        print(f"serve: {exc}", file=sys.stderr)
        return 2
    if key and not given:  # made here: the user needs it for the clients (once; never on a command line)
        print(f"serve: API key (made with --make-api-key; clients send 'Authorization: Bearer <key>', the trainer "
              f"reads ${API_KEY_ENV}): {key}", file=sys.stderr, flush=True)
    elif not key and not is_loopback(args.host):
        print(f"serve: WARNING: --allow-open: {args.host} without an API key", file=sys.stderr, flush=True)
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
