"""The serve command: one SGLang server in the foreground, what slurm/lib.sh and the nemo-run
launcher run on every rollout node (as ``python -m megatron_tepo.rollout.sglang.server``)::

    python -m megatron_tepo.rollout.sglang.server --model-path /models/Qwen3-14B --port 30000 --tp 2 \\
        --device cuda [--host 0.0.0.0] [--mem-fraction-static 0.85] [--max-running-requests 64] \\
        [--context-length 10240] [--print] [-- EXTRA SGLANG ARGS]

Its options are :class:`~megatron_tepo.rollout.sglang.options.ServerConfig`'s, read back into that
type (what the launchers write with ``ServerConfig.to_argv``; defaults: the config's, and for the
host and device :data:`~megatron_tepo.rollout.sglang.options.SERVE_COMMAND_DEFAULTS`); the command
line is ``server_command``'s (so the CPU flags and environment live in one place), and the command
*execs* SGLang (same pid, so ``srun`` and signals reach the server itself). Its own arguments: the
``--port``; the SGLang python ``--python``, else ``find_sglang_python``'s
(``$MTEPO_SGLANG_PYTHON`` / ``<repo>/.venv-sglang/bin/python``, else this python if it can import
sglang); the API key, read from the environment variable named by ``--api-key-env`` (default
``TEPO_SGLANG_API_KEY``) and handed on in the server's environment (``TEPO_SGLANG_API_KEY``, which
``launch.py`` gives SGLang inside the process): it is on no command line, this one or SGLang's,
and masked in what is printed; ``--print`` prints the command (and the environment it changes)
instead of running it.

Left out: starting servers as subprocesses of a fleet (``server.py``), restarting one that exits
(slurm/lib.sh's ``tepo_keep_serving``).
"""
from __future__ import annotations

import argparse
import os
import shlex
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
    ServerConfig.add_arguments(ap, required=("model_path",), **SERVE_COMMAND_DEFAULTS)
    return ap


def command(args: argparse.Namespace):
    """The server's command line and environment from the serve command's arguments."""
    cfg = ServerConfig.from_namespace(args, python=find_sglang_python(args.python))
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
