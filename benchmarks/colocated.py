"""Benchmark: a colocated step against a separate (disaggregated) one, on the same CPU cores.

The main job's setup (``examples/tiny_tepo/run.py``: the tiny Qwen3, the Megatron actor in one
gloo process, the embedded rollout engine, a weight sync after every step), run as subprocesses
with ``OMP_NUM_THREADS=1``, the same seed and the same overrides, once with
``rollout.colocated=false`` (the engine and the actor each keep their memory) and once with
``rollout.colocated=true`` (every step: the engine releases its memory after generating, the actor
onloads, trains, offloads its optimizer states and gradients, the engine takes its weights' memory
back for the sync, the actor offloads its parameters, the engine takes its cache back:
``trainer/step.py``'s ``COLOCATED`` mode with ``actor.offload: auto`` = all). ``--repeats`` pairs,
the order alternating from pair to pair. Reported, from each run's ``metrics.jsonl``:

* the mean ``step_s`` over steps 2..N of each run (step 1 is the first of everything, and
  colocated mode's first onload moves less; also the loop's own phases ``rollout_s``, ``train_s``,
  ``sync_s``, to see where a difference lies), each mode's mean over its runs and the ratio
  colocated / separate. The loop takes ``step_s`` (and ``train_s``'s end) at the weight sync,
  so in colocated mode it leaves out the two phases after the sync (the parameters' offload, the
  engine's cache resume); hence also the step *period*: the time between one step's metrics line
  and the next (``time``), everything included, with ``train.save_every=0`` (the checkpoint only
  after the last step's line);
* the colocated runs' mean memory-phase times over steps 2..N (``engine_release_s``,
  ``actor_onload_s``, ``actor_offload_s``, ``engine_resume_s``, their sum) and bytes
  (``actor_offload_gb``, ``actor_onload_gb``);
* whether every run's metrics are equal, step by step, apart from timings (the ``*_s`` keys and
  ``time``) and the colocated-only byte counts, and the held-out accuracy before and after: they
  should be (same seed; the offload is bit-exact).

Left out: an SGLang server (the embedded engine lives in the driver's process: its release drops
its weight tensors, its KV cache lives only inside one ``generate`` call), a GPU (the actor's
"device" memory is host memory, so its offload and onload are plain memcpy with no pinned memory
and no PCIe; ``benchmarks/gpu_check.sh``'s ``actor_step`` step measures the GPU round trip), the
engine's memory (the bytes are the actor's only), the checkpoint (written after ``step_s`` is
taken), and any layout beyond one process. What it shows is the cost of colocated mode's phases
around a step whose compute is the same, not a GPU's time.

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/colocated.py [--steps 20] [--repeats 2] [--json FILE] [override ...]

``--offload LEVEL`` sets the colocated runs' ``actor.offload`` (``none``: the engine still releases
and resumes, the actor keeps its memory), to tell the actor's part from the engine's.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from statistics import mean

REPO = Path(__file__).resolve().parents[1]
MODES = {"separate": "false", "colocated": "true"}
PHASES = ("engine_release_s", "actor_onload_s", "actor_offload_s", "engine_resume_s")
BYTES = ("actor_offload_gb", "actor_onload_gb")
LOOP_PHASES = ("rollout_s", "train_s", "sync_s")  # the loop's own phases, in both modes


def run_once(mode: str, steps: int, seed: int, eval_size: int, overrides: list, workdir: Path) -> dict:
    """One run of the main job in ``mode``; its metrics per step and its summary."""
    out = workdir / mode
    cmd = [sys.executable, str(REPO / "examples/tiny_tepo/run.py"), "--eval-size", str(eval_size),
           f"train.steps={steps}", f"train.seed={seed}", "train.save_every=0", f"rollout.colocated={MODES[mode]}",
           f"train.output_dir={out}", *overrides]
    env = dict(os.environ, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", CUDA_VISIBLE_DEVICES="", PYTHONUNBUFFERED="1")
    log = workdir / f"{mode}.log"
    t0 = time.time()
    with open(log, "w") as f:
        rc = subprocess.run(cmd, cwd=REPO, env=env, stdout=f, stderr=subprocess.STDOUT).returncode
    wall = time.time() - t0
    if rc != 0:
        tail = "".join(log.read_text().splitlines(keepends=True)[-30:])
        raise SystemExit(f"colocated.py: the {mode} run failed (exit {rc}); its log's end:\n{tail}")
    metrics = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines() if x.strip()]
    summary = json.loads((out / "summary.json").read_text())
    return {"mode": mode, "cmd": " ".join(cmd[1:]), "wall_s": round(wall, 1), "metrics": metrics, "summary": summary}


def _later(metrics: list) -> list:
    """Steps 2..N (all of them when there is only one)."""
    later = [m for m in metrics if m["step"] >= 2]
    return later or metrics


def figures(run: dict) -> dict:
    metrics = run["metrics"]
    later = _later(metrics)
    periods = [b["time"] - a["time"] for a, b in zip(metrics, metrics[1:])]  # steps 2..N
    fig = {"mode": run["mode"], "steps": len(metrics), "wall_s": run["wall_s"],
           "step_s": [round(m["step_s"], 4) for m in metrics],
           "mean_step_s": mean(m["step_s"] for m in later),
           "mean_period_s": mean(periods) if periods else None,
           "loop_phases_s": {k: mean(m.get(k, 0.0) for m in later) for k in LOOP_PHASES}}
    if run["mode"] == "colocated":
        fig["phases_s"] = {k: mean(m.get(k, 0.0) for m in later) for k in PHASES}
        fig["phases_s"]["total"] = sum(fig["phases_s"].values())
        fig["gb"] = {k: mean(m.get(k, 0.0) for m in later) for k in BYTES}
    return fig


def comparable(m: dict) -> dict:
    """A step's metrics without its timings and the colocated-only byte counts."""
    return {k: v for k, v in m.items() if not (k == "time" or k.endswith("_s") or k in BYTES)}


def differences(runs: list) -> list:
    """``"run i step s key: a != b"`` for every metric (timings aside) where a run differs from the first."""
    ref = runs[0]
    out = []
    for i, run in enumerate(runs[1:], 1):
        if len(run["metrics"]) != len(ref["metrics"]):
            out.append(f"run {i} ({run['mode']}): {len(run['metrics'])} steps, run 0: {len(ref['metrics'])}")
        for a, b in zip(ref["metrics"], run["metrics"]):
            ca, cb = comparable(a), comparable(b)
            for k in sorted(set(ca) | set(cb)):
                if ca.get(k, "<missing>") != cb.get(k, "<missing>"):
                    out.append(f"run {i} ({run['mode']}) step {a['step']} {k}: {ca.get(k, '<missing>')} != "
                               f"{cb.get(k, '<missing>')}")
        for k in ("accuracy_before", "accuracy_after"):
            if ref["summary"].get(k) != run["summary"].get(k):
                out.append(f"run {i} ({run['mode']}) {k}: {ref['summary'].get(k)} != {run['summary'].get(k)}")
    return out


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=20, help="train.steps of each run (the mean is over steps 2..N)")
    ap.add_argument("--repeats", type=int, default=2, help="pairs of runs (separate + colocated), order alternating")
    ap.add_argument("--seed", type=int, default=1, help="train.seed of every run")
    ap.add_argument("--eval-size", type=int, default=16, help="held-out problems before and after (not timed)")
    ap.add_argument("--json", default=None, help="write the figures to this file")
    ap.add_argument("--keep", default=None, help="keep the runs' outputs and logs in this folder")
    ap.add_argument("--offload", default="auto", choices=["auto", "none", "optimizer", "optimizer_grads", "all"],
                    help="actor.offload of the colocated runs (auto: all)")
    ap.add_argument("overrides", nargs="*", help="more dotted overrides for both modes, e.g. rollout.prompts_per_step=32")
    args = ap.parse_args(argv)
    runs = []
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(args.keep or tmp)
        for r in range(args.repeats):
            order = ["separate", "colocated"] if r % 2 == 0 else ["colocated", "separate"]
            for mode in order:
                work = root / f"pair{r + 1}"
                work.mkdir(parents=True, exist_ok=True)
                print(f"[colocated] pair {r + 1}/{args.repeats}: {mode} ...", flush=True)
                extra = [f"actor.offload={args.offload}"] if mode == "colocated" else []
                run = run_once(mode, args.steps, args.seed, args.eval_size, [*args.overrides, *extra], work)
                run["pair"] = r + 1
                runs.append(run)
    figs = [dict(figures(run), pair=run["pair"]) for run in runs]
    by_mode = {mode: [f for f in figs if f["mode"] == mode] for mode in MODES}
    mean_step = {mode: mean(f["mean_step_s"] for f in fs) for mode, fs in by_mode.items()}
    mean_period = {mode: mean(f["mean_period_s"] for f in fs) for mode, fs in by_mode.items()}
    colo = by_mode["colocated"]
    phases = {k: mean(f["phases_s"][k] for f in colo) for k in (*PHASES, "total")}
    gb = {k: mean(f["gb"][k] for f in colo) for k in BYTES}
    diffs = differences(runs)
    result = {"steps": args.steps, "repeats": args.repeats, "seed": args.seed, "overrides": args.overrides,
              "colocated_offload": args.offload,
              "threads": 1, "commands": {run["mode"]: run["cmd"] for run in runs},
              "runs": figs, "mean_step_s": mean_step, "ratio_colocated_over_separate": mean_step["colocated"] / mean_step["separate"],
              "mean_period_s": mean_period,
              "period_ratio_colocated_over_separate": mean_period["colocated"] / mean_period["separate"],
              "memory_phases_s": phases, "memory_phases_share_of_colocated_step": phases["total"] / mean_step["colocated"],
              "actor_gb": gb, "metrics_equal": not diffs, "differences": diffs[:20],
              "accuracy": {f"{run['mode']} pair {run['pair']}": [run["summary"].get("accuracy_before"),
                                                                 run["summary"].get("accuracy_after")] for run in runs}}

    print(f"\ncolocated (actor.offload={args.offload}) vs separate: tiny TEPO main job, {args.steps} steps, "
          f"seed {args.seed}, 1 thread, means over steps 2..{args.steps}")
    print(f"| {'mode':<9} | pair | {'step_s':>7} | {'period':>7} | {'rollout_s':>9} | {'train_s':>7} | {'sync_s':>7} | "
          f"{'memory phases':>13} | {'run wall (s)':>12} |")
    print(f"| {'-' * 9} | ---- | {'-' * 7} | {'-' * 7} | {'-' * 9} | {'-' * 7} | {'-' * 7} | {'-' * 13} | {'-' * 12} |")
    for f in figs:
        ph = f"{f['phases_s']['total']:.4f}" if "phases_s" in f else "-"
        lp = f["loop_phases_s"]
        print(f"| {f['mode']:<9} | {f['pair']:>4} | {f['mean_step_s']:>7.4f} | {f['mean_period_s']:>7.4f} | "
              f"{lp['rollout_s']:>9.4f} | {lp['train_s']:>7.4f} | {lp['sync_s']:>7.4f} | {ph:>13} | {f['wall_s']:>12.1f} |")
    print(f"\nmean step_s: separate {mean_step['separate']:.4f} s, colocated {mean_step['colocated']:.4f} s; "
          f"ratio colocated / separate {result['ratio_colocated_over_separate']:.3f}")
    print(f"mean step period: separate {mean_period['separate']:.4f} s, colocated {mean_period['colocated']:.4f} s; "
          f"ratio colocated / separate {result['period_ratio_colocated_over_separate']:.3f}")
    print("colocated memory phases, mean per step (s): "
          + ", ".join(f"{k} {phases[k]:.5f}" for k in PHASES)
          + f"; total {phases['total']:.5f} ({100 * result['memory_phases_share_of_colocated_step']:.1f}% of the step)")
    print(f"actor bytes per step (GB): offloaded {gb['actor_offload_gb']:.6f}, onloaded {gb['actor_onload_gb']:.6f}")
    print("metrics equal apart from timings: " + ("yes" if not diffs else f"NO ({len(diffs)} differences):"))
    for d in diffs[:20]:
        print("  " + d)
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1))
    return result


if __name__ == "__main__":
    sys.exit(0 if main()["metrics_equal"] else 1)
