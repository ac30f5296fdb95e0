"""Start one SGLang server in the foreground (the Slurm launchers run this on every rollout node).

    python -m megatron_tepo.rollout.serve --model-path /models/Qwen3-14B --port 30000 --tp 2 \\
        --device cuda [--host 0.0.0.0] [--mem-fraction-static 0.85] [--max-running-requests 64] \\
        [--context-length 10240] [--print] [-- EXTRA SGLANG ARGS]

The command line comes from :func:`megatron_tepo.rollout.sglang_fleet.server_command`, the same
function the fleet's ``launch_server`` uses, so the CPU flags and environment live in one place.
The SGLang python is ``--python``, else ``$MTEPO_SGLANG_PYTHON`` / ``<repo>/.venv-sglang/bin/python``
(the fleet's default); when neither exists, this python if it can import sglang. The process then
*execs* SGLang (same pid, so ``srun`` and signals reach the server itself). The API key, if any, is
read from the environment variable named by ``--api-key-env`` (default ``TEPO_SGLANG_API_KEY``)
and handed on in the server's environment (``TEPO_SGLANG_API_KEY``, which
``megatron_tepo/rollout/sglang_launch.py`` gives SGLang inside the process): it is on no command
line, this one or SGLang's, and masked in what is printed. ``--print`` prints the command (and
the environment it changes) instead of running it.
"""
from __future__ import annotations

import argparse
import importlib.util
import os
import shlex
import sys
from pathlib import Path
from typing import List, Optional


def find_sglang_python(explicit: Optional[str] = None) -> str:
    from megatron_tepo.rollout.sglang_fleet import default_sglang_python

    if explicit:
        return explicit
    py = default_sglang_python()
    if Path(py).exists() or "MTEPO_SGLANG_PYTHON" in os.environ:
        return py
    if importlib.util.find_spec("sglang") is not None:
        return sys.executable
    raise FileNotFoundError(f"no SGLang python: {py} does not exist and {sys.executable} cannot import "
                            "sglang; set MTEPO_SGLANG_PYTHON or --python (CPU: bash tools/install_sglang_cpu.sh)")


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m megatron_tepo.rollout.serve",
                                 description=__doc__.split("\n\n")[0])
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
    from megatron_tepo.rollout.sglang_fleet import FleetConfig, server_command

    cpu = args.device == "cpu"
    extra = list(args.extra)
    if extra and extra[0] == "--":
        extra = extra[1:]
    cfg = FleetConfig(
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
    from megatron_tepo.rollout.sglang_fleet import API_KEY_ENV

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
