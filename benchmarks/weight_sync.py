"""Benchmark of the Megatron -> SGLang weight sync: bytes per second per mode and bucket size.

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/weight_sync.py [--hidden 768 --layers 12
        --intermediate 1536 --vocab 32000] [--modes distributed tensor disk] [--bucket-mib 16 64 256]
        [--repeats 2] [--wire-dtype bf16] [--json [PATH]]

What it measures. A Qwen3-shaped model built locally with random weights (default ~110M
parameters: hidden 768, 12 layers, MLP 1536, 12 heads / 4 KV heads of 64, vocab 32000, untied
embeddings) is loaded into a real ``MegatronActor`` at TP=2 (torchrun, 2 gloo ranks,
``benchmarks/weight_sync_worker.py``), and rank 0 pushes it with ``WeightSync`` to one real SGLang
CPU server (bf16, started here from the SGLang venv of ``tools/install_sglang_cpu.sh``), in each
mode (``distributed``: gloo broadcast of flattened buckets; ``tensor``: shared-memory handles over
HTTP; ``disk``: safetensors files + ``/update_weights_from_disk``) and bucket size. Per push:

* end to end: ``SyncStats.seconds`` of ``WeightSync.push(actor.export_hf_state())``, from before
  the first bucket is gathered (the export is lazy: the bf16 cast, one gather per bucket to rank
  0 and the HF mapping happen inside the sync) to the server's answer to ``/end_weight_update``
  (disk: to ``/update_weights_from_disk``); bytes are the wire bytes (floating tensors cast to
  ``--wire-dtype``, bf16 by default = the server's dtype);
* the part of it rank 0 waited for the export to produce a bucket (``SyncStats.export_seconds``)
  and spent inside the per-bucket push calls (distributed: joining the previous bucket's request
  -- the server loads a bucket while the next is gathered -- + HTTP request + broadcast; tensor:
  copy to shared memory + pickle + HTTP + server load);
* pre-exported push: the same buckets exported beforehand and pushed again -- the transport and
  the server alone, the ceiling for end to end;
* sender only: the bucketed export gathered to rank 0 with no server at all (with the buffers
  kept from the previous pass, as the sync keeps them from push to push; and with cold buffers,
  allocated per pass), and the per-tensor path it replaced (an all-gather per tensor, HF mapping,
  cast, flatten copy), medians of ``--baseline-repeats`` passes;
* the sender's memory: the buffers the sync holds between pushes (``ExportBuffers``, on rank 0:
  target about one bucket, not the model), also as a multiple of the largest bucket; and its
  peak RSS above its RSS just before the push (sampled every 2 ms), for the warm-up push (which
  allocates the kept buffers) and for the timed ones.

Plain copies of the same total bytes in the same bucket sizes, on the same machine:
``memcpy`` = a torch copy between two preallocated in-process buffers (hot memory: a ceiling, not a
transport); ``gloo`` = a gloo broadcast of the bytes from rank 0 to rank 1 (two local processes
over loopback TCP: the transport ``distributed`` uses on CPU), run right before every timed push:
``e2e / gloo`` is the median over the pushes of (that copy's seconds / the push's seconds), and
the gloo MB/s column the median copy. The issue's target is ``distributed`` end to end >= 0.5x the
plain copy; both ratios are printed.

Left out: server start-up, the actor's construction, creating the ``distributed`` update group
(done by one untimed warm-up push per configuration), ``/flush_cache``, generation after the sync
(correctness of the synced weights is the job of tests/rollout/test_sglang_fleet.py), more than one
server, PP > 1, GPU/NCCL/CUDA-IPC. The medians of ``--repeats`` pushes are reported. On the
2-core test machines the sender, rank 1 and the server (1 OMP thread each) share the cores with
whatever else runs: the load average is printed with the table.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
MiB = 1 << 20


def build_model(path: Path, a) -> int:
    import torch
    from transformers import AutoModelForCausalLM, Qwen3Config

    cfg = Qwen3Config(vocab_size=a.vocab, hidden_size=a.hidden, intermediate_size=a.intermediate,
                      num_hidden_layers=a.layers, num_attention_heads=a.heads, num_key_value_heads=a.kv_heads,
                      head_dim=a.head_dim, max_position_embeddings=4096, tie_word_embeddings=False,
                      rms_norm_eps=1e-6, rope_theta=10000.0, bos_token_id=1, eos_token_id=2, pad_token_id=0,
                      torch_dtype="float32")
    cfg.architectures = ["Qwen3ForCausalLM"]
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(1.0 + 0.05 * torch.randn_like(p) if "norm" in name else 0.02 * torch.randn_like(p))
    n = sum(p.numel() for p in model.parameters())
    path.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(str(path), safe_serialization=True, max_shard_size="2GB")
    (path / "generation_config.json").write_text(json.dumps({"bos_token_id": 1, "eos_token_id": 2,
                                                             "pad_token_id": 0}))
    return n


def med(xs):
    return statistics.median(xs)


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--hidden", type=int, default=768)
    p.add_argument("--layers", type=int, default=12)
    p.add_argument("--intermediate", type=int, default=1536)
    p.add_argument("--heads", type=int, default=12)
    p.add_argument("--kv-heads", type=int, default=4)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--vocab", type=int, default=32000)
    p.add_argument("--modes", nargs="+", default=["distributed", "tensor", "disk"])
    p.add_argument("--bucket-mib", type=int, nargs="+", default=[16, 64, 256])
    p.add_argument("--repeats", type=int, default=2, help="timed pushes per mode and bucket (after 1 warm-up)")
    p.add_argument("--baseline-repeats", type=int, default=3)
    p.add_argument("--wire-dtype", choices=["bf16", "fp32"], default="bf16")
    p.add_argument("--workdir", default=None)
    p.add_argument("--sglang-python", default=None)
    p.add_argument("--json", nargs="?", const="-", default=None, help="write the results as JSON (to PATH, or stdout)")
    a = p.parse_args()

    from megatron_tepo.rollout.sglang.fleet import FleetConfig, SGLangFleet
    from megatron_tepo.rollout.sglang.server import ServerConfig, default_sglang_python
    from tests.dist_utils import torchrun

    work = Path(a.workdir or tempfile.mkdtemp(prefix="mtepo-wsync-bench-"))
    model_dir = work / "model"
    t = time.time()
    if (model_dir / "config.json").exists():  # reused: count the parameters of its files
        from safetensors import safe_open

        n = 0
        for f in model_dir.glob("*.safetensors"):
            with safe_open(str(f), "pt") as sf:
                n += sum(math.prod(sf.get_slice(k).get_shape()) for k in sf.keys())
    else:
        n = build_model(model_dir, a)
    print(f"model {model_dir}: {n or '?'} parameters (built in {time.time() - t:.1f} s)", file=sys.stderr)
    shared = work / "shared"
    shared.mkdir(exist_ok=True)
    t = time.time()
    fleet = SGLangFleet(FleetConfig(num_servers=1, request_timeout=600, server=ServerConfig(
        model_path=str(model_dir), python=a.sglang_python or default_sglang_python(), log_dir=str(work / "logs"),
        startup_timeout=600, max_total_tokens=1024)))
    print(f"server ready in {time.time() - t:.1f} s: {fleet.servers[0].url}", file=sys.stderr)
    load0 = os.getloadavg()
    try:
        args = {"model_dir": str(model_dir), "urls": [s.url for s in fleet.servers],
                "keys": [s.api_key for s in fleet.servers], "modes": a.modes, "bucket_mib": a.bucket_mib,
                "repeats": a.repeats, "baseline_repeats": a.baseline_repeats, "wire_dtype": a.wire_dtype,
                "shared_dir": str(shared)}
        t = time.time()
        res = torchrun(REPO / "benchmarks/weight_sync_worker.py", 2, json.dumps(args), tmp_path=work,
                       timeout=3600, env={"PYTHONUNBUFFERED": "1"})[0]
        wall = time.time() - t
    finally:
        fleet.close()
    load1 = os.getloadavg()

    total = res["wire_bytes"]
    base = {int(k): v for k, v in res["baselines"].items()}
    sender = {int(k): v for k, v in res["sender_only"].items()}
    res["sender_only_cold"] = {int(k): v for k, v in res["sender_only_cold"].items()}
    legacy = {int(k): v for k, v in res["sender_only_per_tensor"].items()}
    rows = []
    for mode in a.modes:
        for mib in a.bucket_mib:
            runs = [r for r in res["runs"] if r["mode"] == mode and r["bucket_mib"] == mib]
            if not runs:
                continue
            s = med([r["seconds"] for r in runs])
            pre = [r["seconds"] for r in res["server_only"] if r["mode"] == mode and r["bucket_mib"] == mib]
            row = {"mode": mode, "bucket_mib": mib, "bytes": runs[0]["bytes"], "buckets": runs[0]["buckets"],
                   "e2e_s": s, "e2e_MBps": runs[0]["bytes"] / s / 1e6,
                   "gather_s": med([r["gather_s"] for r in runs]), "push_s": med([r["push_s"] for r in runs]),
                   "sender_only_s": sender[mib]["seconds"],
                   "sender_only_MBps": sender[mib]["bytes"] / sender[mib]["seconds"] / 1e6,
                   "memcpy_MBps": total / base[mib]["memcpy_s"] / 1e6,
                   "gloo_MBps": total / base[mib]["gloo_bcast_s"] / 1e6,
                   "sender_only_per_tensor_s": legacy[mib]["seconds"],
                   "rss_delta_MiB": max(r["rss_delta"] for r in runs) / MiB,
                   "first_push_rss_delta_MiB": runs[0]["first_push_rss_delta"] / MiB,
                   "held_MiB": max(r["held_bytes"] for r in runs) / MiB,
                   "sender_only_cold_s": res["sender_only_cold"][mib]["seconds"],
                   "sender_only_rss_delta_MiB": sender[mib]["rss_delta"] / MiB,
                   "peak_bucket_MiB": runs[0]["peak_bucket_bytes"] / MiB, "e2e_all_s": [r["seconds"] for r in runs]}
            # the gloo copy run right before each push: per-push ratios, their median (the copy's
            # own speed moves by up to 2x between minutes on a shared 2-core machine)
            row["gloo_MBps"] = runs[0]["bytes"] / med([r["gloo_s"] for r in runs]) / 1e6
            row["vs_memcpy"] = row["e2e_MBps"] / row["memcpy_MBps"]
            row["vs_gloo_each"] = [r["gloo_s"] / r["seconds"] for r in runs]
            row["vs_gloo"] = med(row["vs_gloo_each"])
            row["rss_delta_buckets"] = row["rss_delta_MiB"] / row["peak_bucket_MiB"]
            row["held_buckets"] = row["held_MiB"] / row["peak_bucket_MiB"]
            row["server_only_s"] = med(pre)
            row["server_only_vs_gloo"] = (total / row["server_only_s"] / 1e6) / row["gloo_MBps"]
            rows.append(row)

    out = {"params": n, "wire_bytes": total, "tensors": res["tensors"], "wire_dtype": a.wire_dtype,
           "model": {k: getattr(a, k) for k in ("hidden", "layers", "intermediate", "heads", "kv_heads",
                                                "head_dim", "vocab")},
           "loadavg_before": load0, "loadavg_after": load1, "worker_wall_s": wall,
           "build_actor_s": res["build_actor_s"], "baselines": base, "sender_only": sender,
           "sender_only_per_tensor": legacy, "server_only": res["server_only"], "rows": rows,
           "runs": res["runs"]}
    print(f"\nmodel: {n or '?'} parameters, {res['tensors']} HF tensors, {total / 1e6:.1f} MB on the wire "
          f"({a.wire_dtype}); TP=2 actor -> 1 SGLang CPU server; median of {a.repeats} pushes; "
          f"load average {load0[0]:.1f} before / {load1[0]:.1f} after\n")
    print("| mode | bucket | buckets | end to end (s) | MB/s | export wait (s) | push calls (s) | "
          "pre-exported push (s) | sender only (s) | sender only, cold buffers (s) | "
          "sender only, per-tensor path (s) | memcpy MB/s | "
          "gloo bcast MB/s | e2e / memcpy | e2e / gloo | pre-exported / gloo | sender buffers held (MiB) | "
          "largest bucket (MiB) | held / bucket | first push RSS delta (MiB) | later pushes RSS delta (MiB) |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['mode']} | {r['bucket_mib']} MiB | {r['buckets']} | {r['e2e_s']:.2f} | {r['e2e_MBps']:.0f} | "
              f"{r['gather_s']:.2f} | {r['push_s']:.2f} | {r['server_only_s']:.2f} | {r['sender_only_s']:.2f} | "
              f"{r['sender_only_cold_s']:.2f} | {r['sender_only_per_tensor_s']:.2f} | {r['memcpy_MBps']:.0f} | "
              f"{r['gloo_MBps']:.0f} | {r['vs_memcpy']:.3f}x | {r['vs_gloo']:.2f}x | {r['server_only_vs_gloo']:.2f}x | "
              f"{r['held_MiB']:.0f} | {r['peak_bucket_MiB']:.0f} | {r['held_buckets']:.1f}x | "
              f"{r['first_push_rss_delta_MiB']:.0f} | {r['rss_delta_MiB']:.0f} |")
    if a.json:
        text = json.dumps(out, indent=1)
        if a.json == "-":
            print(text)
        else:
            Path(a.json).write_text(text)


if __name__ == "__main__":
    main()
