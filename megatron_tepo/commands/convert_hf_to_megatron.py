#!/usr/bin/env python
"""Convert a Hugging Face checkpoint (safetensors) to a megatron-core dist_checkpointing one.

    python tools/convert_hf_to_megatron.py --hf DIR --out DIR --tp N --pp N [--ep N] [--force]

Started as a plain script it first checks the input (architecture known, TP/PP/EP valid for the
model, every HF tensor present with the shape config.json implies -- headers only, nothing
created), then re-launches itself under torchrun with tp*pp*ep local gloo processes (one
thread each); already under torchrun it just runs. Each rank streams: it reads only the HF
tensors of its own pipeline stage (and experts), layer by layer, maps them through
megatron_tepo.models (the one HF<->Megatron mapping) and writes each piece of its shard as soon
as it is cut, into a torch_dist checkpoint laid out by ``GPTModel.sharded_state_dict()`` of an
untouched model skeleton -- the same keys and bytes as megatron-core's own save, loadable at any
other TP/PP -- plus ``hf_source/`` (config, generation config, tokenizer) and
``megatron_tepo_checkpoint.json`` so that tools/convert_megatron_to_hf.py needs nothing else.
Peak memory per rank is the process baseline (~0.4 GiB of imports) plus about one layer or the
largest single tensor (embedding / lm_head), not the model: 0.30x of a 1.9 GiB model at TP=1
(docs/BENCHMARKS.md). Progress is printed per layer on rank 0.
The output appears only when complete (written to ``<out>.tmp-<pid>``, then renamed; removed on
any error); an existing --out is refused unless --force.

MoE (Qwen3-MoE): --ep N spreads the experts over N ranks (each reads only its own experts); on CPU
MoE needs --tp 1 --pp 1 (megatron-core limits, models/qwen3_moe/README.md).

Deliberately left out: pytorch_model.bin inputs (not lazily readable: convert to safetensors
first), multi-node launching (run it under your own torchrun with WORLD_SIZE = tp*pp*ep),
optimizer state.
"""
from __future__ import annotations

import argparse
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]  # a checkout (the package's parent), for torchrun's PYTHONPATH

from megatron_tepo.cli import add_traceback_flag, prog, user_errors


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--hf", required=True, help="HF model directory (config.json + *.safetensors)")
    p.add_argument("--out", required=True, help="output megatron checkpoint directory")
    p.add_argument("--tp", type=int, default=1)
    p.add_argument("--pp", type=int, default=1)
    p.add_argument("--ep", type=int, default=1)
    p.add_argument("--force", action="store_true", help="replace an existing --out")
    p.add_argument("--quiet", action="store_true", help="no progress lines")
    add_traceback_flag(p)
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    world = args.tp * args.pp * args.ep
    under_torchrun = "LOCAL_RANK" in os.environ and "WORLD_SIZE" in os.environ
    if not under_torchrun:
        from megatron_tepo.checkpoint.common import check_out_dir
        from megatron_tepo.checkpoint.hf_to_megatron import check_hf_input

        with user_errors(prog(), args.traceback):  # one line, nothing written
            check_out_dir(Path(args.out).absolute(), args.force)
            check_hf_input(args.hf, tp=args.tp, pp=args.pp, ep=args.ep)
    if under_torchrun or world == 1:
        import torch

        torch.set_num_threads(1)
        from megatron_tepo.checkpoint import convert_hf_to_megatron

        try:
            with user_errors(prog(), args.traceback):
                convert_hf_to_megatron(args.hf, args.out, tp=args.tp, pp=args.pp, ep=args.ep,
                                       force=args.force, progress=not args.quiet)
        finally:
            from megatron_tepo.megatron.parallel import destroy_parallel

            destroy_parallel()
        return 0
    return launch_torchrun(world, sys.argv[1:] if argv is None else list(argv))


def launch_torchrun(nproc: int, argv) -> int:
    from megatron_tepo.net import free_port

    port = free_port()
    env = dict(os.environ, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1")
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), env.get("PYTHONPATH", "")])
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={nproc}",
           "--master-addr=127.0.0.1", f"--master-port={port}", "-m",
           "megatron_tepo.commands.convert_hf_to_megatron", *argv]
    return subprocess.call(cmd, env=env)


if __name__ == "__main__":
    sys.exit(main())
