"""Benchmark of the rollout schedules on long-tail responses: synchronous, one step off and partial
rollout at staleness 1 and 2, with a real SGLang CPU server, in one run.

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/partial_rollout.py [--steps 10] [--repeats 3] [--json PATH]

The workload. The main job's tiny model (``tools/make_tiny_model.py``: a 2-layer Qwen3 with a
16-token character vocabulary, two-digit sums) with its end-of-sequence token made rare: the EOS
row of the output layer is moved against the mean final hidden state, which lowers its logit by
about ``--eos-shift`` nats, and the position limit is raised to 1024. Its responses then have the
shape of reasoning answers' lengths: most are short and a few run long (at shift 6 on 128 samples:
median 5 tokens, 90th percentile 33, longest 217; the cap is ``--max-new-tokens``). The rewards
hardly matter here (dynamic sampling off: every step trains on all its groups), and the policy
does not learn (``--lr`` 1e-30: the updates run but leave the weights as they are), so every
schedule and run samples from the same length law. (With learning, the lengths drift apart: in a
first measurement at the config's learning rate, one step off's responses grew to 48-65 tokens on
average where the synchronous loop's stayed at 23-25, and its tokens per second rose with them.)

The layout. One SGLang CPU server (bf16) on the last core, the actor (``tools/train.py``, one
process, the launchers' command) on the first: the disaggregated layout on one machine, where each
side idles while the other works unless they overlap. Every run is ``--steps`` steps from the
model's own weights (pushed to the server before it starts). With ``--repeats R`` each schedule runs
R times, the schedules in turn (so a slow spell of the machine spreads over all of them), run r
with ``train.seed=r``. From each run's ``metrics.jsonl``, over the steps after the first two
(start-up) and before the last (one step off generates nothing ahead then), pooled over the runs:

* ``tokens_per_s``: response tokens trained on per second of step time (the throughput);
* ``steps_per_hour``: from the mean step time;
* ``engine_idle_fraction`` (partial rollout only: the share of the time the server had nothing to
  generate) and ``stale_regenerated`` per step (samples dropped for outgrowing the bound).

``--probe`` first measures the server itself (:func:`probe_server`): what a request and a batch
cost it, which bounds what any schedule can gain here.

Left out: several servers, a GPU, learning (the convergence benchmark's chain-task rows), and
response lengths from a real model's reasoning (the tail here is made by hand).
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

SCHEDULES = {  # name: overrides
    "synchronous": ["rollout.max_staleness=0"],
    "one step off": ["rollout.max_staleness=1"],
    "partial, staleness 1": ["rollout.partial_rollout=true", "rollout.max_staleness=1"],
    "partial, staleness 2": ["rollout.partial_rollout=true", "rollout.max_staleness=2"],
}


def long_tail_model(tiny: Path, out: Path, shift: float) -> Path:
    """The tiny model with a rare EOS (see the module docstring), as a Hugging Face directory."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if (out / "model.safetensors").exists():
        return out
    model = AutoModelForCausalLM.from_pretrained(tiny, dtype=torch.float32)
    tok = AutoTokenizer.from_pretrained(tiny)
    with torch.no_grad():
        h = model.model(input_ids=torch.tensor([tok.encode("37+45=")])).last_hidden_state[0].mean(0)
        model.lm_head.weight[tok.eos_token_id] -= shift * h / h.dot(h)
    model.config.max_position_embeddings = 1024
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out, safe_serialization=True)
    for f in tiny.iterdir():
        if f.name.startswith("tokenizer") or f.name == "generation_config.json":
            shutil.copy(f, out / f.name)
    return out


def probe_server(server) -> dict:
    """What one request and one batch cost the server, the two numbers that bound the schedules
    here: decode tokens/s at concurrency 1, 8, 32 and 128 (128 tokens each, EOS ignored), and 128
    samples of 5 and 40 tokens sent as 128 requests (n=1, as partial rollout sends them: each sample
    can be cut and resumed alone) against 16 requests with n=8 (as a step's generate sends them)."""
    import time
    from concurrent.futures import ThreadPoolExecutor

    def post(n, tokens):
        return server.post("/generate", {"input_ids": [3, 4, 5, 6, 7, 8], "return_logprob": True, "sampling_params": {
            "max_new_tokens": tokens, "temperature": 1.0, "ignore_eos": True, "n": n}}, timeout=600)

    def timed(count, n, tokens):
        start = time.perf_counter()
        with ThreadPoolExecutor(count) as pool:
            list(pool.map(lambda _: post(n, tokens), range(count)))
        return time.perf_counter() - start

    post(1, 2)  # warm-up
    out = {"decode_tokens_per_s": {b: round(b * 128 / timed(b, 1, 128), 1) for b in (1, 8, 32, 128)}}
    for tokens in (5, 40):
        single, grouped = timed(128, 1, tokens), timed(16, 8, tokens)
        out[f"128_samples_of_{tokens}_tokens_s"] = {"128 requests x n=1": round(single, 3),
                                                    "16 requests x n=8": round(grouped, 3)}
    print("server probe:", json.dumps(out), flush=True)
    return out


def run(args) -> dict:
    from megatron_tepo.rollout.sglang.fleet import FleetConfig, SGLangFleet
    from megatron_tepo.rollout.sglang.server import ServerConfig

    work = Path(args.workdir)
    tiny = work / "tiny"
    if not (tiny / "model" / "tokenizer.json").exists():
        subprocess.run([sys.executable, str(REPO / "tools/make_tiny_model.py"), "--out", str(tiny)], check=True,
                       env={**os.environ, "OMP_NUM_THREADS": "1"})
    model = long_tail_model(tiny / "model", work / f"long_tail_{args.eos_shift}", args.eos_shift)
    cores = sorted(os.sched_getaffinity(0))
    if len(cores) < 2:
        raise SystemExit("benchmarks/partial_rollout.py needs two cores (one for the server, one for the actor)")
    server_cores, actor_cores = {cores[-1]}, {cores[0]}
    os.sched_setaffinity(0, server_cores)  # the server inherits it
    try:
        fleet = SGLangFleet(FleetConfig(num_servers=1, server=ServerConfig(
            model_path=str(model), log_dir=str(work / "sglang"), startup_timeout=600)))
    finally:
        os.sched_setaffinity(0, set(cores))
    import torch
    from transformers import AutoModelForCausalLM

    start_weights = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32).state_dict()
    runs = {name: [] for name in args.schedules}
    probe = None
    try:
        server = fleet.servers[0]
        if args.probe:
            probe = probe_server(server)
        env = {**os.environ, "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": "", "TEPO_SGLANG_URLS": server.url,
               "TEPO_SGLANG_API_KEY": server.api_key or ""}
        for rep in range(args.repeats):  # round robin: a slow spell of the machine spreads over the schedules
            for name in args.schedules:
                fleet.update_weights(start_weights.items())  # every run starts on the weights it loads
                out = work / name.replace(" ", "_").replace(",", "")
                shutil.rmtree(out, ignore_errors=True)
                cmd = [sys.executable, str(REPO / "tools/train.py"), "--config",
                       str(REPO / "examples/tiny_tepo/config.yaml"), f"model.path={model}",
                       f"data.train_files=[{tiny / 'train.jsonl'}]", "reward.kind=exact_match", "rollout.engine=sglang",
                       f"train.steps={args.steps}", f"rollout.prompts_per_step={args.prompts}",
                       f"rollout.n_samples={args.n_samples}", f"rollout.max_new_tokens={args.max_new_tokens}",
                       "rollout.max_prompt_len=16", f"train.mini_batch_prompts={args.prompts}",
                       f"train.epochs_per_step={args.epochs}", "rollout.dynamic_sampling=false", "train.save_every=0",
                       "train.export_hf=false", "train.resume=false", f"train.seed={rep + 1}", f"train.output_dir={out}",
                       f"optim.lr={args.lr}",
                       *SCHEDULES[name], *([f"rollout.max_inflight_groups={args.max_inflight_groups}"]
                                           if args.max_inflight_groups and name.startswith("partial") else [])]
                proc = subprocess.run(cmd, env=env, cwd=REPO, capture_output=True, text=True,
                                      preexec_fn=lambda: os.sched_setaffinity(0, actor_cores))
                if proc.returncode != 0:
                    raise SystemExit(f"benchmarks/partial_rollout.py: the {name!r} run failed:\n"
                                     f"{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}")
                rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()][2:-1]
                runs[name].append(rows)
                print(name, f"run {rep + 1}:", summarize([rows]), flush=True)
    finally:
        fleet.close()
    results = {}
    for name, rs in runs.items():
        results[name] = summarize(rs)
        per_run = [summarize([r])["tokens_per_s"] for r in rs]
        results[name]["tokens_per_s_runs"] = per_run
    base = results.get("one step off")
    for name, r in results.items():
        if base:
            r["vs_one_step_off"] = round(r["tokens_per_s"] / base["tokens_per_s"], 3)
    if probe is not None:
        results["server_probe"] = probe
    results["settings"] = vars(args)
    return results


def summarize(runs) -> dict:
    """The figures over the measured steps of one schedule's runs, pooled (tokens over wall time)."""
    rows = [r for rs in runs for r in rs]
    wall = sum(r["step_s"] for r in rows)
    tokens = sum(r["tokens_per_s"] * r["step_s"] for r in rows)
    out = {"steps_measured": len(rows), "tokens_per_s": round(tokens / wall, 1),
           "steps_per_hour": round(3600 * len(rows) / wall, 1), "step_s": round(wall / len(rows), 3),
           "response_length_mean": round(statistics.mean(r["response_length_mean"] for r in rows), 1),
           "staleness_max": max(r.get("staleness_max", r.get("rollout_staleness", 0.0)) for r in rows)}
    if "engine_idle_fraction" in rows[0]:
        out.update(engine_idle_fraction=round(statistics.mean(r["engine_idle_fraction"] for r in rows), 3),
                   stale_regenerated_per_step=round(statistics.mean(r["stale_regenerated"] for r in rows), 1),
                   partial_resumed_per_step=round(statistics.mean(r["partial_resumed"] for r in rows), 1))
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--repeats", type=int, default=1, help="runs per schedule, in turn (the figures pool them)")
    ap.add_argument("--prompts", type=int, default=32)
    ap.add_argument("--n-samples", type=int, default=8)
    ap.add_argument("--max-new-tokens", type=int, default=400)
    ap.add_argument("--epochs", type=int, default=1)
    ap.add_argument("--lr", type=float, default=1e-30,
                    help="the actor's learning rate; the default freezes the weights, so every schedule and run "
                         "generates from the same length law (a learning policy drifts: its lengths then differ)")
    ap.add_argument("--eos-shift", type=float, default=6.0, help="nats taken off the EOS logit (the tail's weight)")
    ap.add_argument("--schedules", nargs="*", default=list(SCHEDULES), choices=list(SCHEDULES))
    ap.add_argument("--max-inflight-groups", type=int, default=None,
                    help="partial rollout's rollout.max_inflight_groups (default: the config's, N x prompts)")
    ap.add_argument("--probe", action="store_true",
                    help="first measure the server: decode tokens/s by concurrency, and the cost of one request per "
                         "sample against n samples per request (probe_server)")
    ap.add_argument("--workdir", default="/tmp/mtepo_partial_rollout")
    ap.add_argument("--json", default=None, help="write the results as JSON to PATH")
    args = ap.parse_args(argv)
    if args.steps < 5:
        ap.error("--steps must be >= 5 (the first two and the last are not measured)")
    results = run(args)
    print("| schedule | trained tokens/s | each run | steps/hour | step (s) | vs one step off | mean response | "
          "max staleness | engine idle | regenerated / step |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for name in args.schedules:
        r = results[name]
        each = ", ".join(f"{x:.0f}" for x in r["tokens_per_s_runs"])
        print(f"| {name} | {r['tokens_per_s']} | {each} | {r['steps_per_hour']} | {r['step_s']} | "
              f"{r.get('vs_one_step_off', '')}x | {r['response_length_mean']} | {r['staleness_max']:.0f} | "
              f"{r.get('engine_idle_fraction', '')} | {r.get('stale_regenerated_per_step', '')} |")
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
