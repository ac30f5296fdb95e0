#!/usr/bin/env python
"""Convergence and stability of TEPO against GRPO/DAPO, GSPO and the KL-mask variants, over
many seeds, on the tiny arithmetic task or the chain task.

For each method (a row config of examples/ablations combined with the task's sizes file) and each
seed, runs examples/tiny_tepo/run.py with several policy updates per rollout step (so the
importance ratios move), evaluates held-out greedy accuracy every ``--eval-every`` steps, and
records (a) the first evaluated step reaching ``--threshold`` (runs that never reach it count as
``--steps``, i.e. censored at the budget), (b) the accuracy at the final step and (c) whether the
run collapsed: ended below the held-out accuracy it started from. Reports per method the mean of
(a), (b) and of the lowest evaluated accuracy, the fraction of seeds that collapsed, and for every
method against GRPO/DAPO the ratio of mean steps-to-threshold with a bootstrap 95% interval
(resampling seeds within each method).

Tasks (``--task``):

* ``addition`` -- the main job's two-digit sums, 2-4-token answers (examples/tiny_tepo);
* ``chain`` -- column-by-column sums of 3-7-digit numbers, 14-73-token responses whose length
  varies within a group (examples/chain_task/chain.py says why that is where TEPO's mechanism can
  act);
* ``tir`` -- two-digit products with a Python tool (examples/tiny_tir/tir.py): multi-turn episodes,
  the tool's code in the sandbox; the model cannot multiply by itself. Its rows: TEPO and GRPO/DAPO
  with the tool, TEPO without it; each run also reports its episodes' tool calls per episode and
  the tool calls' success rate (no error) over its last 10 steps.

``--set KEY=VALUE`` applies to every run (the stability sweeps: ``optim.lr``,
``train.epochs_per_step``, ``algorithm.clip_low``/``clip_high``, ``algorithm.kl_coef``). With
``--out DIR`` each run's ``metrics.jsonl`` is kept, the seed-mean curves of each method are
written to ``DIR/<method>.jsonl``, and the paper's dynamics (reward, length, entropy, clip
fraction, gradient norm, KL-mask fraction, the four A/dH quadrants) are drawn from them by the
project's plot tool to ``DIR/dynamics.png``.

The one-step-off rows (``rollout.max_staleness: 1``) train each batch on weights one update newer
than those that generated it, with and without truncated token-level IS weights
(``rollout_is: token``, cap 2). The partial-rollout rows (``rollout.partial_rollout``) train on
tokens at most 1 or 2 updates old, a response possibly made by two weights; they are not
deterministic (when an update cuts a response depends on the machine's timing).

What it leaves out: the paper's scale (7B/14B, 64 x 8, 8k tokens); on tasks this small, seed noise
is large, so read the intervals, not the means. All runs of a task share one supervised warm-up
(made by the first run alone, then cached). ``--collect`` rebuilds the table from runs kept under
``--out`` by an earlier call, without running anything.

    python benchmarks/convergence.py --seeds 8 --steps 60 [--jobs 2] [--methods ...] --json out.json
    python benchmarks/convergence.py --task chain --jobs 2 --out /tmp/chain --json out.json
"""
from __future__ import annotations

import argparse
import json
import os
import random
import re
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
from megatron_tepo.net import free_port  # noqa: E402

SIZES = {"addition": "examples/tiny_tepo/sizes.yaml", "chain": "examples/chain_task/sizes.yaml",
         "tir": "examples/tiny_tir/sizes.yaml"}
OFF = ["rollout.max_staleness=1"]  # one-step-off generation
TIS = ["algorithm.rollout_correction.rollout_is=token"]  # truncated token IS weights (cap 2)
PARTIAL = ["rollout.partial_rollout=true"]  # partial rollout (trainer/partial.py), with a staleness bound
METHODS = {  # name: (row config, overrides)
    "TEPO": ("table1_tepo_qwen2.5_7b.yaml", []),
    "TEPO w/o KL": ("table3_tepo_wo_kl.yaml", []),
    "GRPO/DAPO": ("table1_grpo_dapo.yaml", []),
    "GSPO": ("table1_gspo.yaml", []),
    "TEPO, KL where A<0 and dH>0": ("table3_e_kl_neg_adv_inc_ent.yaml", []),  # Table 3, panel E
    "TEPO, KL where either": ("table3_e_kl_either.yaml", []),
    # the stability sweep: TEPO's sequence ratio under GSPO's clip range, and a 10x stronger KL
    "TEPO, clip 3e-4/4e-4": ("table1_tepo_qwen2.5_7b.yaml", ["algorithm.clip_low=3e-4", "algorithm.clip_high=4e-4"]),
    "TEPO, kl_coef 0.01": ("table1_tepo_qwen2.5_7b.yaml", ["algorithm.kl_coef=0.01"]),
    "TEPO, 1 step off": ("table1_tepo_qwen2.5_7b.yaml", OFF),
    "TEPO, 1 step off + TIS": ("table1_tepo_qwen2.5_7b.yaml", OFF + TIS),
    "GRPO/DAPO, 1 step off": ("table1_grpo_dapo.yaml", OFF),
    "GRPO/DAPO, 1 step off + TIS": ("table1_grpo_dapo.yaml", OFF + TIS),
    "TEPO, partial rollout, staleness 1": ("table1_tepo_qwen2.5_7b.yaml", PARTIAL + ["rollout.max_staleness=1"]),
    "TEPO, partial rollout, staleness 2": ("table1_tepo_qwen2.5_7b.yaml", PARTIAL + ["rollout.max_staleness=2"]),
    # the tool-integrated task: the same warmed-up model without its Python tool (one turn: a tool call
    # is then its final answer)
    "TEPO, no tool": ("table1_tepo_qwen2.5_7b.yaml", ["environment.name=none"]),
}
DEFAULT_METHODS = {"addition": ["TEPO", "TEPO w/o KL", "GRPO/DAPO", "GSPO"], "tir": ["TEPO", "GRPO/DAPO", "TEPO, no tool"],
                   "chain": ["TEPO", "TEPO w/o KL", "GRPO/DAPO", "GSPO", "TEPO, KL where A<0 and dH>0",
                             "TEPO, KL where either"]}


def slug(name: str) -> str:
    return re.sub(r"[^a-z0-9]+", "_", name.lower()).strip("_")


def run_one(name, seed, args, workdir):
    method_file, overrides = METHODS[name]
    out = Path(workdir) / f"{slug(name)}-s{seed}"
    cmd = [sys.executable, str(REPO / "examples/tiny_tepo/run.py"), "--task", args.task,
           "--config", str(REPO / "examples/ablations" / method_file),
           "--config", str(REPO / SIZES[args.task]), "--eval-size", str(args.eval_size),
           f"train.steps={args.steps}", f"train.seed={seed}", f"train.eval_every={args.eval_every}",
           f"train.mini_batch_prompts={args.mini_batch_prompts}", f"train.output_dir={out}",
           "train.save_every=0", "train.export_hf=false", *(args.tepo_clip if name.startswith("TEPO") else []),
           *overrides, *args.set]
    env = dict(os.environ, OMP_NUM_THREADS="1", MASTER_PORT=str(free_port()))
    t0 = time.time()
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, cwd=REPO)
    if proc.returncode != 0:
        raise RuntimeError(f"{name} seed {seed} failed:\n{proc.stderr[-3000:]}")
    return read_run(out, args, time.time() - t0)


def read_run(out: Path, args, seconds: float) -> dict:
    """One finished run's result from its folder (``metrics.jsonl``, ``summary.json``)."""
    recs = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    evals = [(r["step"], r["eval_acc"]) for r in recs if "eval_acc" in r]
    reach = next((s for s, a in evals if a >= args.threshold), args.steps)
    summary = json.loads((out / "summary.json").read_text())
    last = recs[-10:]
    calls = sum(r.get("tool_calls", 0.0) for r in last)
    tools = {"tool_calls_per_episode": sum(r.get("episode_tool_calls_mean", 0.0) for r in last) / len(last),
             "tool_success": (1 - sum(r.get("tool_errors", 0.0) for r in last) / calls) if calls else None}
    return {**tools, "steps_to_threshold": reach, "min_acc": min(a for _, a in evals),
            "reached": reach < args.steps or (evals and evals[-1][1] >= args.threshold),
            "final_acc": summary["accuracy_after"], "start_acc": summary["accuracy_before"],
            "collapsed": summary["accuracy_after"] < summary["accuracy_before"],
            "seconds": seconds, "log": str(out / "metrics.jsonl")}


def bootstrap_ratio(a, b, n=10000, seed=0):
    rng = random.Random(seed)
    ratios = []
    for _ in range(n):
        ra = [rng.choice(a) for _ in a]
        rb = [rng.choice(b) for _ in b]
        ratios.append((sum(ra) / len(ra)) / (sum(rb) / len(rb)))
    ratios.sort()
    return ratios[int(0.025 * n)], ratios[int(0.975 * n) - 1]


def mean_curves(logs):
    """Per step, the mean over runs of every numeric metric that all runs logged at that step."""
    runs = [[json.loads(x) for x in Path(p).read_text().splitlines()] for p in logs]
    by_step = {}
    for recs in runs:
        for r in recs:
            by_step.setdefault(r["step"], []).append(r)
    out = []
    for step in sorted(by_step):
        rows = by_step[step]
        keys = set.intersection(*(set(k for k, v in r.items() if isinstance(v, (int, float))) for r in rows))
        out.append({"step": step, **{k: sum(float(r[k]) for r in rows) / len(rows) for k in sorted(keys - {"step"})}})
    return out


def bootstrap_difference(a, b, n=10000, seed=0):
    """95% bootstrap interval of mean(a) - mean(b), resampling each list on its own."""
    rng = random.Random(seed)
    diffs = sorted(sum(rng.choice(a) for _ in a) / len(a) - sum(rng.choice(b) for _ in b) / len(b)
                   for _ in range(n))
    return diffs[int(0.025 * n)], diffs[int(0.975 * n) - 1]


def table(results, args):
    base = results.get("GRPO/DAPO")
    tools = args.task == "tir"
    lines = [f"| method | mean steps to {args.threshold} (censored at {args.steps}) | reached | "
             f"mean final accuracy [min, max] | final minus GRPO/DAPO's [95% bootstrap] | mean lowest accuracy | "
             f"collapsed (final < start) | steps ratio vs GRPO/DAPO [95% bootstrap] |"
             + (" tool calls per episode | tool calls without error |" if tools else ""),
             "| --- | --- | --- | --- | --- | --- | --- | --- |" + (" --- | --- |" if tools else "")]
    for name, rs in results.items():
        steps = [r["steps_to_threshold"] for r in rs]
        final = [r["final_acc"] for r in rs]
        ratio = diff = ""
        if base and name != "GRPO/DAPO":
            b = [r["steps_to_threshold"] for r in base]
            lo, hi = bootstrap_ratio(steps, b)
            ratio = f"{(sum(steps) / len(steps)) / (sum(b) / len(b)):.2f} [{lo:.2f}, {hi:.2f}]"
            bf = [r["final_acc"] for r in base]
            lo, hi = bootstrap_difference(final, bf)
            diff = f"{sum(final) / len(final) - sum(bf) / len(bf):+.3f} [{lo:+.3f}, {hi:+.3f}]"
        lines.append(f"| {name} | {sum(steps) / len(steps):.1f} | {sum(r['reached'] for r in rs)}/{len(rs)} | "
                     f"{sum(final) / len(final):.3f} [{min(final):.3f}, {max(final):.3f}] | {diff} | "
                     f"{sum(r['min_acc'] for r in rs) / len(rs):.3f} | "
                     f"{sum(r['collapsed'] for r in rs)}/{len(rs)} | "
                     f"{ratio} |" + (_tool_cells(rs) if tools else ""))
    return lines


def _tool_cells(rs) -> str:
    per = [r.get("tool_calls_per_episode", 0.0) for r in rs]
    ok = [r["tool_success"] for r in rs if r.get("tool_success") is not None]
    return (f" {sum(per) / len(per):.2f} |" + (f" {sum(ok) / len(ok):.3f} |" if ok else " - |"))


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--task", choices=sorted(SIZES), default="addition")
    ap.add_argument("--seeds", type=int, default=8)
    ap.add_argument("--steps", type=int, default=None, help="default: 120 (addition), 40 (chain), 60 (tir)")
    ap.add_argument("--eval-every", type=int, default=None, help="default: 10 (addition), 5 (chain)")
    ap.add_argument("--eval-size", type=int, default=200)
    ap.add_argument("--threshold", type=float, default=None, help="default: 0.75 (addition), 0.6 (chain)")
    ap.add_argument("--mini-batch-prompts", type=int, default=4, help="16 prompts / 4 = 4 updates per step")
    ap.add_argument("--methods", nargs="*", default=None, choices=list(METHODS),
                    help="default: " + "; ".join(f"{t}: {', '.join(m)}" for t, m in DEFAULT_METHODS.items()))
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                    help="a config override for every run (repeatable), e.g. optim.lr=3e-4")
    ap.add_argument("--tepo-clip", metavar="LOW/HIGH",
                    help="TEPO's clip range for the TEPO rows (default: the loss's own, 0.01/0.014 since #26); a row "
                         "that sets its own (TEPO, clip 3e-4/4e-4) keeps it; 0.2/0.28 was its default before #16, "
                         "3e-4/4e-4 before #26")
    ap.add_argument("--jobs", type=int, default=1,
                    help="runs at once, one core each (a run's results do not depend on it; its wall time does)")
    ap.add_argument("--out", type=Path, help="keep every run's metrics here, with seed-mean curves and dynamics.png")
    ap.add_argument("--json", help="write raw results here")
    ap.add_argument("--collect", action="store_true",
                    help="start no run: rebuild the results from the runs an earlier call kept under --out "
                         "(DIR/runs/<method>-s<seed>), with the same arguments")
    args = ap.parse_args(argv)
    chain = args.task == "chain"
    args.steps = args.steps or {"chain": 40, "tir": 60}.get(args.task, 120)
    args.eval_every = args.eval_every or (5 if chain else 10)
    args.threshold = args.threshold if args.threshold is not None else (0.6 if chain else 0.75)
    args.methods = args.methods or DEFAULT_METHODS[args.task]
    for s in args.set:
        if "=" not in s:
            ap.error(f"--set {s!r}: expected KEY=VALUE")
    if args.tepo_clip:
        low, _, high = args.tepo_clip.partition("/")
        try:
            float(low), float(high)
        except ValueError:
            ap.error(f"--tepo-clip {args.tepo_clip!r}: expected LOW/HIGH, e.g. 0.2/0.28")
        args.tepo_clip = [f"algorithm.clip_low={low}", f"algorithm.clip_high={high}"]
    else:
        args.tepo_clip = []
    if args.collect and not args.out:
        ap.error("--collect reads the runs kept under --out DIR: give it")
    t0 = time.time()
    results = {}
    runs = [(name, seed) for name in args.methods for seed in range(1, args.seeds + 1)]
    with tempfile.TemporaryDirectory() as tmp, ThreadPoolExecutor(max(1, args.jobs)) as pool:
        work = args.out / "runs" if args.out else Path(tmp)
        if args.collect:
            futures = {(n, s): pool.submit(read_run, work / f"{slug(n)}-s{s}", args, float("nan")) for n, s in runs}
        else:
            # the first run alone: it makes the task's shared warm-up (cached), which runs started
            # side by side would each make and race to write
            first = pool.submit(run_one, *runs[0], args, work)
            first.result()
            futures = {runs[0]: first, **{(n, s): pool.submit(run_one, n, s, args, work) for n, s in runs[1:]}}
        for (name, seed), fut in futures.items():
            r = fut.result()
            results.setdefault(name, []).append(r)
            print(f"{name:12s} seed {seed}: steps-to-{args.threshold} {r['steps_to_threshold']:4d} "
                  f"start {r['start_acc']:.3f} final {r['final_acc']:.3f}  ({r['seconds']:.0f}s)", flush=True)
        if args.out:
            from megatron_tepo.commands.plot_metrics import plot

            logs = []
            for name, rs in results.items():
                path = args.out / f"{slug(name)}.jsonl"
                path.write_text("".join(json.dumps(r) + "\n" for r in mean_curves([x["log"] for x in rs])))
                logs.append(str(path))
            plot(logs, list(results), args.out / "dynamics.png", smooth=5)
    lines = table(results, args)
    print("\n".join(lines))
    runs = [r["seconds"] for rs in results.values() for r in rs]
    print(f"({len(args.methods)} methods x {args.seeds} seeds in {time.time() - t0:.0f}s with {args.jobs} "
          f"job(s); {sum(runs) / len(runs):.0f}s per run)")
    if args.json:
        Path(args.json).write_text(json.dumps({"args": {k: (str(v) if isinstance(v, Path) else v)
                                                        for k, v in vars(args).items()},
                                               "results": results, "table": lines}, indent=1))


if __name__ == "__main__":
    main()
