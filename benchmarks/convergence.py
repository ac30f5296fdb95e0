#!/usr/bin/env python
"""Convergence of TEPO against GRPO/DAPO and GSPO on the tiny arithmetic task, over many seeds.

For each method (a row config of examples/ablations combined with examples/tiny_tepo/sizes.yaml)
and each seed, runs examples/tiny_tepo/run.py with several policy updates per rollout step (so the
importance ratios move), evaluates held-out greedy accuracy every ``--eval-every`` steps, and
records (a) the first evaluated step reaching ``--threshold`` (runs that never reach it count as
``--steps``, i.e. censored at the budget) and (b) the accuracy at the final step. Reports per
method the mean of each, and for every method against GRPO/DAPO the ratio of mean steps-to-
threshold with a bootstrap 95% interval (resampling seeds within each method). The one-step-off
rows (``rollout.max_staleness: 1``) train each batch on weights one update newer than those that
generated it, with and without truncated token-level IS weights (``rollout_is: token``, cap 2).

What it leaves out: the paper's scale (7B/14B, 64 x 8, 8k tokens); on a task this small, seed
noise is large, so read the intervals, not the means. All runs share one supervised warm-up.

    python benchmarks/convergence.py --seeds 8 --steps 120 [--jobs 2] [--methods ...] --json out.json
"""
from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
from megatron_tepo.rollout.net import free_port  # noqa: E402

OFF = ["rollout.max_staleness=1"]  # one-step-off generation
TIS = ["algorithm.rollout_correction.rollout_is=token"]  # truncated token IS weights (cap 2)
METHODS = {  # name: (row config, overrides)
    "TEPO": ("table1_tepo_qwen2.5_7b.yaml", []),
    "TEPO w/o KL": ("table3_tepo_wo_kl.yaml", []),
    "GRPO/DAPO": ("table1_grpo_dapo.yaml", []),
    "GSPO": ("table1_gspo.yaml", []),
    "TEPO, 1 step off": ("table1_tepo_qwen2.5_7b.yaml", OFF),
    "TEPO, 1 step off + TIS": ("table1_tepo_qwen2.5_7b.yaml", OFF + TIS),
    "GRPO/DAPO, 1 step off": ("table1_grpo_dapo.yaml", OFF),
    "GRPO/DAPO, 1 step off + TIS": ("table1_grpo_dapo.yaml", OFF + TIS),
}


def run_one(method, seed, args, workdir):
    method_file, overrides = method
    out = Path(workdir) / f"{Path(method_file).stem}-{len(overrides)}-s{seed}"
    cmd = [sys.executable, str(REPO / "examples/tiny_tepo/run.py"),
           "--config", str(REPO / "examples/ablations" / method_file),
           "--config", str(REPO / "examples/tiny_tepo/sizes.yaml"), "--eval-size", str(args.eval_size),
           f"train.steps={args.steps}", f"train.seed={seed}", f"train.eval_every={args.eval_every}",
           f"train.mini_batch_prompts={args.mini_batch_prompts}", f"train.output_dir={out}", *overrides]
    env = dict(os.environ, OMP_NUM_THREADS="1", MASTER_PORT=str(free_port()))
    t0 = time.time()
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, cwd=REPO)
    if proc.returncode != 0:
        raise RuntimeError(f"{method_file} seed {seed} failed:\n{proc.stderr[-3000:]}")
    recs = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    evals = [(r["step"], r["eval_acc"]) for r in recs if "eval_acc" in r]
    reach = next((s for s, a in evals if a >= args.threshold), args.steps)
    summary = json.loads((out / "summary.json").read_text())
    return {"steps_to_threshold": reach, "reached": reach < args.steps or (evals and evals[-1][1] >= args.threshold),
            "final_acc": summary["accuracy_after"], "start_acc": summary["accuracy_before"],
            "seconds": time.time() - t0}


def bootstrap_ratio(a, b, n=10000, seed=0):
    rng = random.Random(seed)
    ratios = []
    for _ in range(n):
        ra = [rng.choice(a) for _ in a]
        rb = [rng.choice(b) for _ in b]
        ratios.append((sum(ra) / len(ra)) / (sum(rb) / len(rb)))
    ratios.sort()
    return ratios[int(0.025 * n)], ratios[int(0.975 * n) - 1]


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seeds", type=int, default=8)
    ap.add_argument("--steps", type=int, default=120)
    ap.add_argument("--eval-every", type=int, default=10)
    ap.add_argument("--eval-size", type=int, default=200)
    ap.add_argument("--threshold", type=float, default=0.75)
    ap.add_argument("--mini-batch-prompts", type=int, default=4, help="16 prompts / 4 = 4 updates per step")
    ap.add_argument("--methods", nargs="*", default=list(METHODS)[:4], choices=list(METHODS),
                    help="default: the four methods without one-step-off generation")
    ap.add_argument("--jobs", type=int, default=1,
                    help="runs at once, one core each (a run's results do not depend on it; its wall time does)")
    ap.add_argument("--json", help="write raw results here")
    args = ap.parse_args(argv)
    t0 = time.time()
    results = {}
    with tempfile.TemporaryDirectory() as work, ThreadPoolExecutor(max(1, args.jobs)) as pool:
        futures = {(name, seed): pool.submit(run_one, METHODS[name], seed, args, work)
                   for name in args.methods for seed in range(1, args.seeds + 1)}
        for (name, seed), fut in futures.items():
            r = fut.result()
            results.setdefault(name, []).append(r)
            print(f"{name:12s} seed {seed}: steps-to-{args.threshold} {r['steps_to_threshold']:4d} "
                  f"final {r['final_acc']:.3f}  ({r['seconds']:.0f}s)", flush=True)
    base = results.get("GRPO/DAPO")
    lines = [f"| method | mean steps to {args.threshold} (censored at {args.steps}) | reached | "
             f"mean final accuracy | steps ratio vs GRPO/DAPO [95% bootstrap] |", "| --- | --- | --- | --- | --- |"]
    for name, rs in results.items():
        steps = [r["steps_to_threshold"] for r in rs]
        ratio = ""
        if base and name != "GRPO/DAPO":
            b = [r["steps_to_threshold"] for r in base]
            lo, hi = bootstrap_ratio(steps, b)
            ratio = f"{(sum(steps) / len(steps)) / (sum(b) / len(b)):.2f} [{lo:.2f}, {hi:.2f}]"
        lines.append(f"| {name} | {sum(steps) / len(steps):.1f} | {sum(r['reached'] for r in rs)}/{len(rs)} | "
                     f"{sum(r['final_acc'] for r in rs) / len(rs):.3f} | {ratio} |")
    print("\n".join(lines))
    runs = [r["seconds"] for rs in results.values() for r in rs]
    print(f"({len(args.methods)} methods x {args.seeds} seeds in {time.time() - t0:.0f}s with {args.jobs} "
          f"job(s); {sum(runs) / len(runs):.0f}s per run)")
    if args.json:
        Path(args.json).write_text(json.dumps({"args": vars(args), "results": results, "table": lines}, indent=1))


if __name__ == "__main__":
    main()
