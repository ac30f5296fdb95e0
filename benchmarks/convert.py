"""Benchmark of checkpoint conversion: wall time and peak RSS per process, both directions.

    OMP_NUM_THREADS=1 python benchmarks/convert.py [--hidden 1280 --layers 24 --vocab 32000] [--tp 1]
        [--max-shard-size 1GB] [--export-only]

Builds a random Llama-shaped HF checkpoint (default ~0.5B parameters, fp32, 1 GB shards) under
--workdir, then times ``tools/convert_hf_to_megatron.py`` (torchrun with tp ranks) and
``tools/convert_megatron_to_hf.py`` as subprocesses; each worker's peak RSS is its
``resource.getrusage(RUSAGE_SELF).ru_maxrss``, written by a tiny ``sitecustomize`` hook at exit.
Peak memory is reported as a ratio to the model's fp32 size. Prints a markdown table.
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


def build_hf(path: Path, hidden: int, layers: int, vocab: int) -> int:
    import torch
    import transformers

    cfg = transformers.LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=int(hidden * 2.75),
                                   num_hidden_layers=layers, num_attention_heads=hidden // 64,
                                   num_key_value_heads=max(1, hidden // 256), tie_word_embeddings=False,
                                   max_position_embeddings=2048)
    cfg.architectures = ["LlamaForCausalLM"]
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    n = sum(p.numel() for p in model.parameters())
    model.save_pretrained(str(path), safe_serialization=True, max_shard_size="1GB")
    return n


def run(cmd, rss_dir: Path) -> tuple:
    for f in rss_dir.glob("*.json"):
        f.unlink()
    env = dict(os.environ, OMP_NUM_THREADS="1", MTEPO_RSS_DIR=str(rss_dir),
               PYTHONPATH=os.pathsep.join([str(rss_dir / "hook"), str(REPO), os.environ.get("PYTHONPATH", "")]))
    t = time.time()
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
    wall = time.time() - t
    if proc.returncode:
        raise RuntimeError(proc.stderr[-4000:])
    rss = [json.loads(f.read_text()) for f in rss_dir.glob("*.json")]
    workers = [r["maxrss_kb"] for r in rss if r["rank"] is not None] or [r["maxrss_kb"] for r in rss]
    return wall, max(workers) * 1024, len(workers)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--hidden", type=int, default=1280)
    p.add_argument("--layers", type=int, default=24)
    p.add_argument("--vocab", type=int, default=32000)
    p.add_argument("--tp", type=int, nargs="+", default=[1])
    p.add_argument("--workdir", default=None)
    p.add_argument("--max-shard-size", default="1GB", help="export shard size (the writer holds one)")
    p.add_argument("--export-only", action="store_true", help="reuse WORKDIR/mg-tp{N} from a previous run")
    a = p.parse_args()
    work = Path(a.workdir or tempfile.mkdtemp(prefix="mtepo-convert-bench-"))
    (work / "rss" / "hook").mkdir(parents=True, exist_ok=True)
    (work / "rss" / "hook" / "sitecustomize.py").write_text(HOOK)
    hf = work / "hf"
    if not hf.exists():
        n = build_hf(hf, a.hidden, a.layers, a.vocab)
    else:
        n = None
    size = sum(f.stat().st_size for f in hf.glob("*.safetensors"))
    rows = []
    for tp in a.tp:
        mg, back = work / f"mg-tp{tp}", work / f"back-tp{tp}"
        shutil.rmtree(back, ignore_errors=True)
        if not a.export_only:
            shutil.rmtree(mg, ignore_errors=True)
            w1, r1, k1 = run([sys.executable, str(REPO / "tools/convert_hf_to_megatron.py"), "--hf", str(hf),
                              "--out", str(mg), "--tp", str(tp), "--quiet"], work / "rss")
            rows.append((f"HF -> Megatron, TP={tp}", k1, w1, r1))
        w2, r2, k2 = run([sys.executable, str(REPO / "tools/convert_megatron_to_hf.py"), "--megatron", str(mg),
                          "--out", str(back), "--max-shard-size", a.max_shard_size, "--quiet"], work / "rss")
        rows.append((f"Megatron (TP={tp}) -> HF, {a.max_shard_size} shards", k2, w2, r2))
    print(f"model: {n or '?'} parameters, {size / 2**30:.2f} GiB fp32 safetensors\n")
    print("| direction | processes | wall (s) | peak RSS per process (GiB) | peak / model size |")
    print("|---|---|---|---|---|")
    for name, k, w, r in rows:
        print(f"| {name} | {k} | {w:.1f} | {r / 2**30:.2f} | {r / size:.2f} |")


if __name__ == "__main__":
    main()
