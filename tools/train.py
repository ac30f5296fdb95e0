#!/usr/bin/env python
"""Train a Hugging Face checkpoint with TEPO (or any baseline) on prompt files, in one process.

    python tools/train.py --config examples/ablations/table1_tepo_qwen2.5_7b.yaml --config my_run.yaml \\
        model.path=/models/Qwen2.5-7B data.train_files=[dapo_math.parquet] train.output_dir=runs/tepo

See megatron_tepo/trainer/main.py for what it wires together and what it leaves out.
"""
import argparse
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def cli(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--config", action="append", required=True, help="config file (repeatable, merged in order)")
    ap.add_argument("overrides", nargs="*", help="dotted overrides, e.g. train.steps=10")
    args = ap.parse_args(argv)
    from megatron_tepo.trainer.main import main

    summary = main(args.config, args.overrides)
    if os.environ.get("RANK", "0") == "0":
        print(summary)


if __name__ == "__main__":
    cli()
