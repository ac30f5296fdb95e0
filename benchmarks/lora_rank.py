#!/usr/bin/env python
"""LoRA rank 8 and rank 32 against full-parameter TEPO on the main job's task, over seeds.

Each variant is the main job (examples/tiny_tepo/run.py, examples/tiny_tepo/config.yaml: TEPO's
Table 1 row, 16 prompts x 8 responses, 2 policy updates per rollout step) with its own
overrides: ``full`` (lr 1e-4, the main job's), ``lora r8`` and ``lora r32`` (``actor.lora.rank``,
alpha 16, every target linear, lr 1e-3: 10x, as LoRA usually wants). Every run evaluates held-out
greedy accuracy every ``--eval-every`` steps; per variant the table gives the mean first evaluated
step reaching ``--threshold`` (censored at ``--steps``), how many seeds reached it, the mean final
accuracy, and the optimizer's memory: the bytes of optimizer state one actor of that variant
holds (fp32 main parameters where they are not the model's own, and the two Adam moments),
counted from the optimizer's tensors after one step, not timed and not estimated.

Runs go under ``--out DIR/runs/<variant>-s<seed>``; ``--collect`` rebuilds the table from the
runs kept there without starting any (missing runs are named, not fatal). What it leaves out:
other learning rates or alphas per rank (one setting each), the 14B scale (the fit check prices
that: docs/LAUNCH.md), and wall time (the machine is shared).

    python benchmarks/lora_rank.py --seeds 4 --steps 100 --jobs 2 --out /tmp/lfit
    python benchmarks/lora_rank.py --seeds 4 --steps 100 --out /tmp/lfit --collect
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
from megatron_tepo.net import free_port  # noqa: E402

VARIANTS = {"full": [], "lora r8": ["actor.lora.rank=8", "optim.lr=1.0e-3"],
            "lora r32": ["actor.lora.rank=32", "optim.lr=1.0e-3"]}


def slug(name: str) -> str:
    return name.replace(" ", "_")


def run_one(name: str, seed: int, args) -> None:
    out = args.out / "runs" / f"{slug(name)}-s{seed}"
    cmd = [sys.executable, str(REPO / "examples/tiny_tepo/run.py"), "--eval-size", str(args.eval_size),
           f"train.steps={args.steps}", f"train.seed={seed}", f"train.eval_every={args.eval_every}",
           f"train.output_dir={out}", "train.save_every=0", "train.export_hf=false", *VARIANTS[name]]
    env = dict(os.environ, OMP_NUM_THREADS="1", MASTER_PORT=str(free_port()))
    out.mkdir(parents=True, exist_ok=True)
    with open(out / "log.txt", "w") as log:
        proc = subprocess.run(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, cwd=REPO)
    if proc.returncode != 0:
        print(f"{name} seed {seed} failed (exit {proc.returncode}): {out / 'log.txt'}", flush=True)


def read_run(out: Path, args) -> dict | None:
    """A finished run's result (``None`` if it has no ``summary.json``)."""
    if not (out / "summary.json").exists():
        return None
    recs = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    evals = [(r["step"], r["eval_acc"]) for r in recs if "eval_acc" in r]
    summary = json.loads((out / "summary.json").read_text())
    reach = next((s for s, a in evals if a >= args.threshold), None)
    if reach is None and summary["accuracy_after"] >= args.threshold:
        reach = args.steps
    return {"steps_to_threshold": reach if reach is not None else args.steps, "reached": reach is not None,
            "start_acc": summary["accuracy_before"], "final_acc": summary["accuracy_after"],
            "seconds": summary["seconds"]}


def optimizer_bytes(name: str) -> dict:
    """Builds one actor of the variant (the main job's config and warm-up), takes one step and
    counts the optimizer's state: its main parameters that are not the model's own tensors, and
    every tensor of its per-parameter state (Adam's two moments). In a fresh process (gloo)."""
    code = f"""
import json, sys, torch
from pathlib import Path
sys.path.insert(0, {str(REPO)!r}); sys.path.insert(0, {str(REPO / 'examples/tiny_tepo')!r})
import addition
from megatron_tepo.config import load_config
from megatron_tepo.trainer.main import build_actor_and_engine
from megatron_tepo.trainer import Task, train
cfg = load_config([{str(REPO / 'examples/tiny_tepo/config.yaml')!r}],
                  ["train.steps=1", "train.save_every=0", "train.export_hf=false",
                   "train.output_dir=/tmp/lora_rank_memory", *{VARIANTS[name]!r}])
torch.manual_seed(1)
actor, engine = build_actor_and_engine(cfg, str(addition.warm_up(Path({str(REPO / '.cache/tiny_tepo')!r}))), addition.PAD)
items = addition.problems(64, seed=1)
task = Task([p for p, _ in items], [a for _, a in items], addition.reward_fn, stop_token_ids=[addition.EOS],
            pad_token_id=addition.PAD)
train(cfg, actor, engine, task)
model = {{t.data_ptr() for c in actor.model for t in c.parameters()}}
main = state = 0
trainable = sum(p.numel() for c in actor.model for p in c.parameters() if p.requires_grad)
for opt in getattr(actor.optimizer, "chained_optimizers", [actor.optimizer]):
    inner = opt.optimizer
    for group in inner.param_groups:
        for p in group["params"]:
            if p.data_ptr() not in model:
                main += p.numel() * p.element_size()
            for v in (inner.state.get(p) or {{}}).values():
                if torch.is_tensor(v) and v.numel() > 1:
                    state += v.numel() * v.element_size()
print("RESULT", json.dumps({{"trainable_params": trainable, "main_param_bytes": main, "adam_state_bytes": state,
                            "optimizer_bytes": main + state}}))
"""
    env = dict(os.environ, OMP_NUM_THREADS="1", MASTER_PORT=str(free_port()))
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, cwd=REPO)
    line = next((x for x in proc.stdout.splitlines() if x.startswith("RESULT ")), None)
    if line is None:
        raise RuntimeError(f"{name}: the memory count failed:\n{proc.stderr[-3000:]}")
    return json.loads(line[len("RESULT "):])


def table(results: dict, memory: dict, args) -> list[str]:
    lines = [f"| variant | trainable parameters | optimizer state (bytes) | mean steps to {args.threshold} "
             f"(censored at {args.steps}) | reached | mean final accuracy [min, max] | runs |",
             "| --- | --- | --- | --- | --- | --- | --- |"]
    for name, rs in results.items():
        m = memory.get(name, {})
        params, opt = (f"{m[k]:,}" if k in m else "-" for k in ("trainable_params", "optimizer_bytes"))
        done = [r for r in rs.values() if r is not None]
        missing = [s for s, r in rs.items() if r is None]
        runs = f"{len(done)}/{len(rs)}" + (f" (missing seeds {', '.join(map(str, missing))})" if missing else "")
        if not done:
            lines.append(f"| {name} | {params} | {opt} | - | - | - | {runs} |")
            continue
        steps = [r["steps_to_threshold"] for r in done]
        final = [r["final_acc"] for r in done]
        lines.append(f"| {name} | {params} | {opt} | "
                     f"{sum(steps) / len(steps):.1f} | {sum(r['reached'] for r in done)}/{len(done)} | "
                     f"{sum(final) / len(final):.3f} [{min(final):.3f}, {max(final):.3f}] | {runs} |")
    return lines


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seeds", type=int, default=4)
    ap.add_argument("--steps", type=int, default=100)
    ap.add_argument("--eval-every", type=int, default=10)
    ap.add_argument("--eval-size", type=int, default=200)
    ap.add_argument("--threshold", type=float, default=0.75)
    ap.add_argument("--variants", nargs="*", default=list(VARIANTS), choices=list(VARIANTS))
    ap.add_argument("--jobs", type=int, default=1, help="runs at once (results do not depend on it)")
    ap.add_argument("--out", type=Path, required=True, help="runs go under DIR/runs/<variant>-s<seed>")
    ap.add_argument("--collect", action="store_true", help="start no run: the table from the runs under --out")
    ap.add_argument("--no-memory", action="store_true", help="skip the optimizer-memory count")
    ap.add_argument("--json", help="write raw results here")
    args = ap.parse_args(argv)
    t0 = time.time()
    runs = [(name, seed) for seed in range(1, args.seeds + 1) for name in args.variants]  # seed-major
    if not args.collect:
        (REPO / ".cache").mkdir(exist_ok=True)
        run_one(*runs[0], args)  # alone: it makes the shared warm-up if it is not cached
        with ThreadPoolExecutor(max(1, args.jobs)) as pool:
            list(pool.map(lambda r: run_one(*r, args), runs[1:]))
    results = {name: {seed: read_run(args.out / "runs" / f"{slug(name)}-s{seed}", args)
                      for seed in range(1, args.seeds + 1)} for name in args.variants}
    memory = {} if args.no_memory else {name: optimizer_bytes(name) for name in args.variants}
    lines = table(results, memory, args)
    print("\n".join(lines))
    print(f"({time.time() - t0:.0f}s)")
    if args.json:
        Path(args.json).write_text(json.dumps({"args": {k: (str(v) if isinstance(v, Path) else v)
                                                        for k, v in vars(args).items()},
                                               "results": results, "memory": memory, "table": lines}, indent=1))


if __name__ == "__main__":
    main()
