#!/usr/bin/env python
"""Convert a Megatron checkpoint back to a Hugging Face directory: one written by
tools/convert_hf_to_megatron.py, or a trainer checkpoint (``train.output_dir/checkpoints/step_N``).

    python tools/convert_megatron_to_hf.py --megatron DIR --out DIR [--max-shard-size 2GB] [--force]

Runs in one process (gloo world of 1, no torchrun needed) whatever TP/PP/EP the checkpoint was
saved at: the tensors are read in the TP=PP=EP=1 layout (every MoE expert included). Writes sharded safetensors
(``model-0000i-of-0000N.safetensors`` + ``model.safetensors.index.json``), and copies config.json,
generation_config.json and the tokenizer files from the checkpoint's ``hf_source/``. Every HF
tensor recorded at import is produced once with its original name, shape and dtype (else an
error naming it). Progress per layer; the output appears only when complete
(``<out>.tmp-<pid>`` renamed at the end, removed on error); an existing --out needs --force.

Streaming: each parameter is read from the checkpoint files only when it is written, so peak
memory is about one output shard plus the largest tensor (see megatron_tepo/checkpoint/megatron_to_hf.py).

Deliberately left out: checkpoints made by other tools (they lack the ``hf_source/`` and
``megatron_tepo_checkpoint.json`` sidecars), optimizer state.
"""
from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]  # a checkout (the package's parent), for torchrun's PYTHONPATH

from megatron_tepo.cli import add_traceback_flag, prog, user_errors


def parse_size(text: str) -> int:
    units = {"KB": 10 ** 3, "MB": 10 ** 6, "GB": 10 ** 9, "KIB": 2 ** 10, "MIB": 2 ** 20, "GIB": 2 ** 30}
    t = text.strip().upper()
    for u, f in units.items():
        if t.endswith(u):
            return int(float(t[: -len(u)]) * f)
    return int(t)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--megatron", required=True, help="checkpoint made by convert_hf_to_megatron.py")
    p.add_argument("--out", required=True, help="output HF directory")
    p.add_argument("--max-shard-size", default="2GB", help="e.g. 500MB, 2GB (default 2GB)")
    p.add_argument("--force", action="store_true", help="replace an existing --out")
    p.add_argument("--quiet", action="store_true")
    add_traceback_flag(p)
    args = p.parse_args(argv)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    import torch

    torch.set_num_threads(1)
    from megatron_tepo.megatron.parallel import destroy_parallel
    from megatron_tepo.checkpoint import convert_megatron_to_hf

    try:
        with user_errors(prog(), args.traceback):  # one line; nothing written
            convert_megatron_to_hf(args.megatron, args.out, force=args.force,
                                   max_shard_bytes=parse_size(args.max_shard_size), progress=not args.quiet)
    finally:
        destroy_parallel()
    return 0


if __name__ == "__main__":
    sys.exit(main())
