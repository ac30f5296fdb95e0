"""Benchmark of checkpoint conversion: wall time and peak RSS per process, both directions.

    OMP_NUM_THREADS=1 python benchmarks/convert.py --workdir DIR [--tp 1 2] [--import-only | --export-only]
        [--hidden 1280 --layers 24 --vocab 32000 --kv-heads 4] [--max-shard-size 1GB] [--repo CHECKOUT]

Builds a random Llama-shaped HF checkpoint (default ~0.5B parameters: hidden 1280, 24 layers,
vocab 32000, 20 query / 4 KV heads so that TP=2 divides them; fp32, 1 GB shards) under --workdir
(reused when present), then times ``tools/convert_hf_to_megatron.py`` (torchrun with tp ranks)
and ``tools/convert_megatron_to_hf.py`` as subprocesses; each process's peak RSS is its
``resource.getrusage(RUSAGE_SELF).ru_maxrss``, written by a tiny ``sitecustomize`` hook at exit.
Peak memory is reported per process (the largest over the run's processes: the ranks and any
helper process dist_checkpointing starts) as a ratio to the model's fp32 safetensors size, and
summed over the ranks. ``--repo`` runs the tools of another checkout of this project (e.g. an
older commit unpacked with ``git archive``) for before/after figures on the same model. Prints a
markdown row per run as it finishes.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

HOOK = """
import atexit, json, os, resource
def _dump():
    d = os.environ.get("MTEPO_RSS_DIR")
    if d:
        with open(os.path.join(d, f"{os.getpid()}.json"), "w") as f:
            json.dump({"rank": os.environ.get("RANK"), "maxrss_kb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss}, f)
atexit.register(_dump)
"""


def build_hf(path: Path, hidden: int, layers: int, vocab: int, kv_heads: int) -> int:
    import torch
    import transformers

    cfg = transformers.LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=int(hidden * 2.75),
                                   num_hidden_layers=layers, num_attention_heads=hidden // 64,
                                   num_key_value_heads=kv_heads, tie_word_embeddings=False,
                                   max_position_embeddings=2048)
    cfg.architectures = ["LlamaForCausalLM"]
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    n = sum(p.numel() for p in model.parameters())
    model.save_pretrained(str(path), safe_serialization=True, max_shard_size="1GB")
    return n


def run(cmd, rss_dir: Path, repo: Path) -> tuple:
    for f in rss_dir.glob("*.json"):
        f.unlink()
    env = dict(os.environ, OMP_NUM_THREADS="1", MTEPO_RSS_DIR=str(rss_dir),
               PYTHONPATH=os.pathsep.join([str(rss_dir / "hook"), str(repo), os.environ.get("PYTHONPATH", "")]))
    t = time.time()
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
    wall = time.time() - t
    if proc.returncode:
        raise RuntimeError(proc.stderr[-4000:])
    rss = [json.loads(f.read_text()) for f in rss_dir.glob("*.json")]
    workers = [r for r in rss if r["rank"] is not None] or rss
    by_rank: dict = {}
    for r in workers:  # a rank's own peak (helper processes carry their parent's RANK too)
        by_rank[r["rank"]] = max(by_rank.get(r["rank"], 0), r["maxrss_kb"] * 1024)
    return wall, max(r["maxrss_kb"] for r in workers) * 1024, len(workers), sum(by_rank.values())


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--hidden", type=int, default=1280)
    p.add_argument("--layers", type=int, default=24)
    p.add_argument("--vocab", type=int, default=32000)
    p.add_argument("--kv-heads", type=int, default=4)
    p.add_argument("--tp", type=int, nargs="+", default=[1])
    p.add_argument("--workdir", default=None)
    p.add_argument("--repo", default=str(REPO), help="checkout whose tools/ are run (default: this one)")
    p.add_argument("--max-shard-size", default="1GB", help="export shard size (the writer holds one)")
    mode = p.add_mutually_exclusive_group()
    mode.add_argument("--export-only", action="store_true", help="reuse WORKDIR/mg-tp{N} from a previous run")
    mode.add_argument("--import-only", action="store_true", help="HF -> Megatron only")
    a = p.parse_args()
    repo = Path(a.repo).resolve()
    work = Path(a.workdir or tempfile.mkdtemp(prefix="mtepo-convert-bench-"))
    (work / "rss" / "hook").mkdir(parents=True, exist_ok=True)
    (work / "rss" / "hook" / "sitecustomize.py").write_text(HOOK)
    hf = work / "hf"
    n = build_hf(hf, a.hidden, a.layers, a.vocab, a.kv_heads) if not hf.exists() else None
    size = sum(f.stat().st_size for f in hf.glob("*.safetensors"))
    print(f"model: {n or '?'} parameters, {size / 2**30:.2f} GiB fp32 safetensors; tools of {repo}\n")
    print("| direction | processes | wall (s) | peak RSS per process (GiB) | peak / model size "
          "| sum over ranks (GiB) |")
    print("|---|---|---|---|---|---|", flush=True)

    def row(name, wall, peak, k, total):
        print(f"| {name} | {k} | {wall:.1f} | {peak / 2**30:.2f} | {peak / size:.2f} | {total / 2**30:.2f} |",
              flush=True)

    for tp in a.tp:
        mg, back = work / f"mg-tp{tp}", work / f"back-tp{tp}"
        shutil.rmtree(back, ignore_errors=True)
        if not a.export_only:
            shutil.rmtree(mg, ignore_errors=True)
            row(f"HF -> Megatron, TP={tp}", *run([sys.executable, str(repo / "tools/convert_hf_to_megatron.py"),
                                                  "--hf", str(hf), "--out", str(mg), "--tp", str(tp), "--quiet"],
                                                 work / "rss", repo))
        if not a.import_only:
            row(f"Megatron (TP={tp}) -> HF, {a.max_shard_size} shards",
                *run([sys.executable, str(repo / "tools/convert_megatron_to_hf.py"), "--megatron", str(mg),
                      "--out", str(back), "--max-shard-size", a.max_shard_size, "--quiet"], work / "rss", repo))


if __name__ == "__main__":
    main()
