"""``python -m megatron_tepo.launch.release [--tags T,T] [--timeout S]``: the launch sequence's
``release`` step as slurm/lib.sh's batch shell runs it (``tepo_step_release``): every server of
``$TEPO_SGLANG_URLS`` releases its memory (:func:`megatron_tepo.launch.sequence.release_servers`),
with the key of ``$TEPO_SGLANG_API_KEY`` -- the environment of the job's steps, so no key on a
command line. One line per server on stderr; exit 1 naming the server that refused, 2 without
servers. (The nemo-run launcher calls the same function in its trainer task.)"""
from __future__ import annotations

import argparse
import os
import sys
from typing import Optional, Sequence

from megatron_tepo.launch.sequence import RELEASE_TAGS, release_servers


def main(argv: Optional[Sequence[str]] = None) -> int:
    from megatron_tepo.rollout.sglang.options import API_KEY_ENV

    ap = argparse.ArgumentParser(prog="python -m megatron_tepo.launch.release",
                                 description="Release the memory of every server of $TEPO_SGLANG_URLS.")
    ap.add_argument("--tags", default=",".join(RELEASE_TAGS), help="SGLang's memory tags, comma-separated")
    ap.add_argument("--timeout", type=float, default=600.0, help="seconds per server")
    a = ap.parse_args(argv)
    urls = [u for u in os.environ.get("TEPO_SGLANG_URLS", "").split(",") if u]
    if not urls:
        print("release: TEPO_SGLANG_URLS is empty: no server to release", file=sys.stderr)
        return 2
    try:
        release_servers(urls, os.environ.get(API_KEY_ENV) or None, [t for t in a.tags.split(",") if t], a.timeout,
                        log=lambda msg: print(msg, file=sys.stderr, flush=True))
    except RuntimeError as exc:
        print(exc, file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
