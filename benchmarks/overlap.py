"""Benchmark of one-step-off generation: step time with generation and training alternating
(``rollout.max_staleness: 0``) and overlapped (``1``), with a real SGLang CPU server and a TP=2
actor on this machine.

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/overlap.py --layout disjoint --epochs 1 [--json PATH]
    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/overlap.py --layout shared --epochs 2 [--json PATH]

What it measures. The tiny model and prompt files of ``tools/make_tiny_model.py`` (a tiny Qwen3
with a character tokenizer, addition prompts); one SGLang CPU server (bf16, from the SGLang venv of
``tools/install_sglang_cpu.sh``) started here and shared by both runs; per staleness one training
run of ``tools/train.py`` under ``torchrun --nproc-per-node 2`` (``parallel.tp=2``,
``rollout.engine=sglang``, the documented command) from the same starting weights, for ``--steps``
steps. From each run's ``metrics.jsonl``, over the steps after the first two (start-up: step 1
generates on-policy in both modes, and the first updates pay one-time allocations):

* ``step_s``: the wall time of a step, median;
* its parts (medians, and as a share of the median step): ``rollout_s`` (the step waiting for its
  rollout: all of generation when alternating; with one step off only what the training did not
  cover), ``train_s`` (old log-probs and updates) and ``sync_s`` (the weight push).

The speed-up is the ratio of the median step times. Size the run (``--prompts``, ``--n-samples``,
``--epochs``) so that generation and training take similar time when alternating: the overlap can
at best hide the shorter of the two.

``--layout`` says where the processes run. ``disjoint`` pins the server to the last core and both
actor ranks to the first: the disaggregated layout (rollout nodes and training nodes) on one
machine, where each side idles while the other works unless they overlap. ``shared`` lets the
server and the two ranks share both cores: then training and generation already compete for the
same cores, and the overlap can only fill what each leaves idle.

Left out: several servers, a GPU, learning curves (the convergence benchmark's job), the
correction's effect on learning.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))


def _median(rows, key):
    return statistics.median(float(r[key]) for r in rows)


def run(args) -> dict:
    from megatron_tepo.rollout.sglang.fleet import FleetConfig, SGLangFleet
    from megatron_tepo.rollout.sglang.server import ServerConfig

    work = Path(args.workdir)
    work.mkdir(parents=True, exist_ok=True)
    tiny = work / "tiny"
    if not (tiny / "model").exists():
        subprocess.run([sys.executable, str(REPO / "tools/make_tiny_model.py"), "--out", str(tiny)], check=True,
                       env={**os.environ, "OMP_NUM_THREADS": "1"})
    cores = sorted(os.sched_getaffinity(0))
    if args.layout == "disjoint":
        if len(cores) < 2:
            raise SystemExit("benchmarks/overlap.py: --layout disjoint needs two cores")
        server_cores, actor_cores = {cores[-1]}, {cores[0]}
        os.sched_setaffinity(0, server_cores)  # the server inherits it
    try:
        fleet = SGLangFleet(FleetConfig(num_servers=1, server=ServerConfig(model_path=str(tiny / "model"),
                                                                           log_dir=str(work / "sglang"))))
    finally:
        os.sched_setaffinity(0, set(cores))
    pin = (lambda: os.sched_setaffinity(0, actor_cores)) if args.layout == "disjoint" else None
    results = {}
    try:
        server = fleet.servers[0]
        env = {**os.environ, "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": "", "TEPO_SGLANG_URLS": server.url}
        if server.api_key:
            env["TEPO_SGLANG_API_KEY"] = server.api_key
        for staleness in (0, 1):
            out = work / f"staleness{staleness}"
            cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node=2", "--master-addr=127.0.0.1",
                   f"--master-port={29600 + staleness}", str(REPO / "tools/train.py"),
                   "--config", str(REPO / "examples/tiny_tepo/config.yaml"), f"model.path={tiny / 'model'}",
                   f"data.train_files=[{tiny / 'train.jsonl'}]", "reward.kind=exact_match", "parallel.tp=2",
                   "rollout.engine=sglang", f"rollout.max_staleness={staleness}", f"train.steps={args.steps}",
                   f"rollout.prompts_per_step={args.prompts}", f"rollout.n_samples={args.n_samples}",
                   f"rollout.max_new_tokens={args.max_new_tokens}", f"train.mini_batch_prompts={args.prompts}",
                   f"train.epochs_per_step={args.epochs}", "rollout.dynamic_sampling=false", "train.save_every=0",
                   "train.export_hf=false", "train.resume=false", f"train.output_dir={out}"]
            subprocess.run(["rm", "-rf", str(out)], check=True)
            proc = subprocess.run(cmd, env=env, cwd=REPO, capture_output=True, text=True, preexec_fn=pin)
            if proc.returncode != 0:
                raise SystemExit(f"benchmarks/overlap.py: the staleness-{staleness} run failed:\n"
                                 f"{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}")
            rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()][2:]
            step = _median(rows, "step_s")
            parts = {k: _median(rows, k) for k in ("rollout_s", "train_s", "sync_s")}
            results[f"max_staleness={staleness}"] = {
                "steps_measured": len(rows), "step_s": round(step, 3),
                **{k: round(v, 3) for k, v in parts.items()},
                **{f"{k[:-2]}_share": round(v / step, 3) for k, v in parts.items()},
                "staleness": sorted({r["rollout_staleness"] for r in rows}),
            }
    finally:
        fleet.close()
    results["speedup"] = round(results["max_staleness=0"]["step_s"] / results["max_staleness=1"]["step_s"], 3)
    results["settings"] = vars(args)
    return results


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--prompts", type=int, default=64)
    ap.add_argument("--n-samples", type=int, default=8)
    ap.add_argument("--max-new-tokens", type=int, default=16)
    ap.add_argument("--epochs", type=int, default=2)
    ap.add_argument("--layout", choices=["shared", "disjoint"], default="shared",
                    help="shared: server and actor on all cores; disjoint: server on the last core, both "
                         "actor ranks on the first (the disaggregated layout on one machine)")
    ap.add_argument("--workdir", default="/tmp/mtepo_overlap")
    ap.add_argument("--json", nargs="?", const="-", default=None, help="write the results as JSON (to PATH)")
    args = ap.parse_args(argv)
    if args.steps < 4:
        ap.error("--steps must be >= 4 (the first two are not measured)")
    results = run(args)
    print(f"layout {args.layout}")
    print("| max_staleness | step (s) | rollout wait (s, share) | train (s, share) | sync (s, share) | other |")
    print("|---|---|---|---|---|---|")
    for s in (0, 1):
        r = results[f"max_staleness={s}"]
        print(f"| {s} | {r['step_s']} | {r['rollout_s']} ({r['rollout_share']:.0%}) | {r['train_s']} "
              f"({r['train_share']:.0%}) | {r['sync_s']} ({r['sync_share']:.0%}) | "
              f"{1 - r['rollout_share'] - r['train_share'] - r['sync_share']:.0%} |")
    print(f"speed-up per step: {results['speedup']}x")
    if args.json:
        text = json.dumps(results, indent=2)
        print(text) if args.json == "-" else Path(args.json).write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
