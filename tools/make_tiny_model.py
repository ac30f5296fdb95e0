#!/usr/bin/env python
"""Write the tiny task as files: a Hugging Face model directory and prompt files.

    python tools/make_tiny_model.py --out DIR

DIR/model is the main job's warmed-up tiny Qwen3 (2 layers, hidden 128, 16-token character
vocabulary) with a Hugging Face tokenizer and generation config, so SGLang servers and
``tools/train.py`` load it like any checkpoint; DIR/train.jsonl and DIR/eval.jsonl hold two-digit
addition problems (``{"prompt": "37+45=", "answer": "82"}``; score them with
``reward.kind: exact_match``). Used by slurm/local_cpu_tepo.sh and the multi-process trainer tests.
Idempotent: existing complete outputs are kept (the warm-up is cached in .cache/tiny_tepo).

Left out: anything resembling real math data; this is a fixture for the launch path on CPU.
"""
import argparse
import os
import sys
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")
REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO), str(REPO / "examples" / "tiny_tepo")]  # the package, the task


def make(out: Path, n_train: int = 5000, n_eval: int = 200) -> Path:
    from addition import save_hf_model, warm_up, write_prompt_file

    out.mkdir(parents=True, exist_ok=True)
    if not (out / "model" / "tokenizer.json").exists():
        save_hf_model(warm_up(REPO / ".cache" / "tiny_tepo"), out / "model")
    for name, n, seed in (("train.jsonl", n_train, 1), ("eval.jsonl", n_eval, 2)):
        if not (out / name).exists():
            tmp = out / f".{name}.tmp{os.getpid()}"
            write_prompt_file(tmp, n, seed).replace(out / name)
    return out


def cli(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True, type=Path, help="output directory")
    ap.add_argument("--train-size", type=int, default=5000)
    ap.add_argument("--eval-size", type=int, default=200)
    args = ap.parse_args(argv)
    out = make(args.out, args.train_size, args.eval_size)
    print(out)


if __name__ == "__main__":
    cli()
