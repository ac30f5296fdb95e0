"""The steps of the one-command GPU check (``benchmarks/gpu_check.sh`` runs them; see there).

Each ``step NAME`` runs in its own process, prints what it does (the shell script sends that to
``OUT/NAME.log``) and appends one JSON line to ``OUT/summary.jsonl``: ``{"step", "ok", "seconds",
"smoke", "figures", "targets": [{"name", "value", "target", "pass"}], "error"?}``. ``pass`` is
``null`` where the run cannot judge the target (the smoke run: CPU and tiny shapes).

Steps (GPU sizes; the smoke run's in brackets):

* ``tests``: pytest on ``tests/megatron`` and ``tests/ops`` with CUDA visible, one process on the
  one GPU, ``-m "not distributed"`` [``tests/ops/test_vocab_parallel.py -k gradcheck``]. The
  ``distributed`` tests are left out: they run under torchrun with ``CUDA_VISIBLE_DEVICES=""``
  and gloo (``tests/dist_utils.py``), i.e. the CPU path CI runs already. Their names are listed.
* ``actor_step``: ``benchmarks/actor_step.py --anchor hf`` at the Qwen3-0.6B shape, random init:
  a plain ``transformers`` model on the same batches first (bf16, SDPA, one micro-batch per batch,
  fused AdamW), then the presets ``gpu-fast`` (bf16, SDPA, packed, no recompute, fusions as
  resolved) at 8x2048 and 1x8448, ``gpu-fast-unfused`` (``fusions=off``) at 8x2048 and
  ``gpu-lean`` (full recompute, 32768-token micro-batches) at 8x2048, 1x8448 and 1x32768, each
  as a ratio to the anchor; targets: train step at most 0.66x HF at 8x2048 and 0.8x at 1x8448,
  log-probs + entropy at most 0.5x at 8x2048, 1x32768 with full recompute within 1.6 s
  [the tiny shape on CPU]. Then (``--offload 4``) the ``gpu-fast`` actor's colocated-mode memory
  round trip: its optimizer states, gradients and parameters offloaded to pinned host memory and
  onloaded, 4 rounds (the first allocates the host copies), bit for bit the same afterwards
  (the step fails otherwise); targets: at least 20 GB/s each way [plain memcpy on CPU].
* ``vocab_op``: ``benchmarks/vocab_parallel.py``'s GPU mode at 16384 x 151936 bf16: the op's
  default (``auto``: Triton), its chunked path and ``torch.compile`` of the plain ops
  [512 x 2048 fp32 on CPU, against the plain ops eager: no compile].
* ``lm_head``: ``benchmarks/lm_head.py``'s timing at 16384 tokens x 151936 bf16, hidden 1024 and
  5120: the fused LM head's training pass (forward and backward) and the materialized one's, as a
  ratio to the three GEMMs alone, and the fused head's extra peak as a share of the logits; targets:
  at most 1.3x the GEMMs (its recompute makes four: the bound is 4/3), at most 0.15x the logits
  [256 x 2048 fp32, hidden 32, on CPU]. Then (``lm_head.shard``) the Qwen3-14B shape at TP 4:
  16384 tokens x 5120 on a 37984-row bf16 shard, its forward and backward timed apart and against
  the shard's three GEMMs (target: at most 1.3x), and the peak memory of a forward and backward
  beside the fit check's figure for the same shape (``launch/memory.py``, ``fused_head_bytes``;
  target: at most 1x) [256 x 32, a 512-row fp32 shard, on CPU: no memory figure]. The actor
  step's ``gpu-lean`` also runs one 131072-token sequence (target: it fits) [1x320].
* ``disk_sync``: ``megatron_tepo.buckets.write_safetensors`` of a FlatBucket made by
  ``to_flat_bucket`` from CUDA tensors (~350 MB) [CPU, ~1.4 MB]; the file's data section must
  equal the buffer's bytes and every tensor read back must equal its source, bit for bit.
* ``hf_load``: a random HF Qwen3 (the 0.6B shape with 4 layers) saved in 100 MB safetensors
  shards, built with ``MegatronActor(config, hf_weights=dir)`` (fp32, SDPA) on the GPU; peak GPU
  and host memory of the build, and the actor's log-probs and entropy against the HF model's on
  the same device [a tiny Qwen3 on CPU]. ``benchmarks/actor_startup.py`` measures the TP=2 CPU
  build; it has no GPU mode, and two ranks cannot share one GPU under NCCL, so TP=1 here.
* ``async_save``: one asynchronous save through each writer the stack has (megatron-core's own; NVRx's
  where it imports: ``gpu_wheels.sh`` carries it in ``.gpu/nvrx``) with the trainer's allocator
  (expandable segments on): the staging each took (NVRx: ``host_shm``, what reached its writer), the
  checkpoint published and loaded bit for bit [the same on CPU, the choice made as on a GPU].
* ``routing_replay``: ``tools/train.py`` on a random tiny Qwen3-MoE, 2 steps each with ``r3`` and
  ``r2``, the engine and the actor on the GPU; targets: coverage 1.0 in every pass, r2's mismatch 0.
* ``qwen3_5``: Qwen3.5 (#53, #56) on the device, with flash-linear-attention's Triton kernels where
  ``fla`` imports (``gpu_wheels.sh`` carries fla-core, a pure-Python wheel of ~1.1 MB, and einops): (1)
  its ``chunk_gated_delta_rule`` and ``causal_conv1d``, and the actor's torch stand-in
  (``megatron/gated_delta_rule.py``), each against transformers' torch path on the same packed
  sequences (3 of 1024, 2048 and 96 tokens, 16 heads of 128): outputs and every input's gradient, and
  each one's forward + backward time; (2) a small Qwen3.5 (hidden 1024, 8 layers: 6 Gated DeltaNet + 2
  gated attention, heads 8 of 256, 8 / 16 Gated DeltaNet heads of 128) built by ``MegatronActor`` on
  megatron-core's HybridModel, fp32, packed: its log-probs and entropy against transformers' model on
  the same device, which GDN kernels the actor ran, then every weight's gradient of one GRPO loss
  (the Gated DeltaNet layers' named apart) against transformers' in fp64; (3) bf16 train steps at
  8x2048 of that Qwen3.5 and of the same-size dense Qwen3 (every layer attention), median seconds,
  peak GPU memory and their ratios. Where fla refuses its backward (``megatron_tepo/gdn_kernels.py``:
  Hopper, 3.4.0 <= Triton < 3.7.1, no tilelang) the step says so, compares fla's forward alone and the
  actor's log-probs (its build-time refusal set aside for that forward), and leaves out the weight
  gradients and the Qwen3.5 train step [a tiny Qwen3.5 on CPU: the stand-in against transformers'
  torch path; 2x64; no memory figure].
* ``main_job``: ``examples/tiny_tepo/run.py`` with CUDA visible (``run.sh`` hides CUDA and
  installs a venv: neither fits here), held-out accuracy before and after [``train.steps=2``,
  ``--eval-size 16``, CPU; learning is not judged].

Other commands: ``setup`` (versions; fails without megatron.core), ``record NAME`` (a line for a
step that died), ``missing-wheels DIR`` (the wheels whose distribution is not installed),
``report OUT`` (the table with the targets; exit 1 if a step failed or is missing).

Left out: TP/PP/DP > 1 (one GPU), SGLang (not on the GPU machine), Transformer Engine (ditto:
the actor runs megatron-core's local spec with SDPA), the HF bf16 baseline of
``../shared/gpu/actor_gpu.py`` (carried in ``.gpu/shared`` by ``gpu_wheels.sh`` for a rerun).
"""
from __future__ import annotations

import argparse
import json
import os
import re
import struct
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "benchmarks"))

STEPS = ["tests", "actor_step", "vocab_op", "lm_head", "disk_sync", "ipc_handles", "hf_load", "main_job",
         "async_save", "routing_replay", "qwen3_5"]
OLD_TOKENS_PER_S = 6200  # train_step at 8 x 2048 on the H100 before bf16/SDPA/packing (../shared/notes/gpu.md)
OFFLOAD_GBPS = 20  # the actor's offload and onload, each way, from / to pinned host memory on an H100 (#34)

# GPU sizes, and the smoke run's stand-ins for them
SIZES = {
    False: dict(throughput="8x2048", mid="1x8448", long="1x32768", longest="1x131072", shape="qwen3-0.6b",
                vocab=(16384, 151936, "bf16"), vocab_ref="compiled", lm_head=(16384, (1024, 5120), 151936, "bf16"),
                lm_head_shard=(16384, 5120, 151936 // 4, "bf16"), sync_mb=330, repeats=2, offload_rounds=4),
    True: dict(throughput="2x128", mid="1x192", long="1x256", longest="1x320", shape="tiny",
               vocab=(512, 2048, "fp32"), vocab_ref="plain", lm_head=(256, (32,), 2048, "fp32"),
               lm_head_shard=(256, 32, 2048 // 4, "fp32"), sync_mb=0.3,
               repeats=1, offload_rounds=4),
}


def _target(name, value, target, ok, smoke):
    return {"name": name, "value": value, "target": target, "pass": None if smoke else ok}


def _device(smoke: bool):
    import torch

    if smoke:
        return torch.device("cpu")
    if not torch.cuda.is_available():
        raise RuntimeError("no CUDA device here (GPU_CHECK_SMOKE=1 runs the CPU smoke version)")
    return torch.device("cuda", torch.cuda.current_device())


# ------------------------------------------------------------------------------------ steps
def step_tests(smoke: bool) -> dict:
    import xml.etree.ElementTree as ET

    paths = ["tests/ops/test_vocab_parallel.py", "-k", "gradcheck"] if smoke else ["tests/megatron", "tests/ops"]
    if not smoke:
        _device(smoke)
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    if smoke:
        env["CUDA_VISIBLE_DEVICES"] = ""
    has_timeout = subprocess.run([sys.executable, "-c", "import pytest_timeout"], capture_output=True).returncode == 0
    with tempfile.TemporaryDirectory() as tmp:
        junit = Path(tmp) / "junit.xml"
        cmd = [sys.executable, "-m", "pytest", *paths, "-m", "not distributed", "-q", "-rfEs",
               f"--junitxml={junit}"] + (["--timeout=300"] if has_timeout else [])
        print("$", " ".join(cmd), flush=True)
        rc = subprocess.run(cmd, cwd=REPO, env=env).returncode
        counts = dict(passed=0, failed=0, errors=0, skipped=0)
        failed, skipped = [], []
        if junit.exists():
            for case in ET.parse(junit).getroot().iter("testcase"):
                name = f"{case.get('classname')}::{case.get('name')}"
                kinds = {child.tag for child in case}
                if "failure" in kinds:
                    counts["failed"] += 1
                    failed.append(name)
                elif "error" in kinds:
                    counts["errors"] += 1
                    failed.append(name)
                elif "skipped" in kinds:
                    counts["skipped"] += 1
                    skipped.append(f"{name}: {case.find('skipped').get('message', '')[:160]}")
                else:
                    counts["passed"] += 1
    listing = subprocess.run([sys.executable, "-m", "pytest", *paths, "-m", "distributed", "--collect-only", "-q"],
                             cwd=REPO, env=env, capture_output=True, text=True).stdout
    left_out = [line for line in listing.splitlines() if "::" in line]
    figures = dict(counts, pytest_rc=rc, failed_tests=failed[:30], skipped_tests=skipped[:30],
                   left_out_distributed=left_out,
                   left_out_why="torchrun + gloo with CUDA_VISIBLE_DEVICES='' (tests/dist_utils.py): "
                                "the CPU path, which CI runs")
    ok = rc == 0 and counts["passed"] > 0 and not failed
    return dict(ok=ok, figures=figures, targets=[])


def step_actor_step(smoke: bool) -> dict:
    import actor_step

    s = SIZES[smoke]
    fast = ":".join([s["throughput"], s["mid"]])
    lean = ":".join([s["throughput"], s["mid"], s["long"], s["longest"]])
    argv = ["--device", "cpu" if smoke else "cuda", "--shape", s["shape"], "--repeats", str(s["repeats"]),
            "--anchor", "hf", "--variant", f"gpu-fast@{fast}", "--variant", f"gpu-fast-unfused@{s['throughput']}",
            "--variant", f"gpu-lean@{lean}", "--offload", str(s["offload_rounds"])]
    if not smoke:
        _device(smoke)
    print("$ python benchmarks/actor_step.py", " ".join(argv), flush=True)
    rows = actor_step.main(argv)
    offload = next((r for r in rows if r.get("kind") == "offload"), {"error": "no offload row"})
    rows = [r for r in rows if r.get("kind") != "offload"]
    keys = ("train_tokens_per_s", "train_step_s", "log_probs_s", "train_vs_hf", "log_probs_vs_hf", "train_tflops",
            "peak_gib", "micro_batches")
    table = {f"{r['label']} {r['batch']}": ({k: r[k] for k in keys if k in r} if "error" not in r
                                            else {"error": r["error"]}) for r in rows}

    def get(label, batch, key):
        return table.get(f"{label} {batch}", {}).get(key)

    tput = [r["train_tokens_per_s"] for r in rows if r["batch"] == s["throughput"] and "error" not in r
            and r["label"] != "hf"]
    longest = [r for r in rows if r["batch"] == s["long"] and "error" not in r]
    lean_longest = [r for r in rows if r["batch"] == s["longest"] and r["label"] == "gpu-lean" and "error" not in r]
    best = max(tput) if tput else None
    on, off = get("gpu-fast", s["throughput"], "train_step_s"), get("gpu-fast-unfused", s["throughput"], "train_step_s")
    figures = {"offload": {k: v for k, v in offload.items() if k not in ("kind", "parts")},
               "rows": table, "old_tokens_per_s": OLD_TOKENS_PER_S,
               "fusions_on_vs_off_train": round(on / off, 3) if on and off else None}

    def at_most(name, value, limit):
        return _target(name, value, limit, value is not None and value <= limit, smoke)

    lean_long = get("gpu-lean", s["long"], "train_step_s")
    targets = [
        at_most(f"gpu-fast train_step at {s['throughput']} / plain HF", get("gpu-fast", s["throughput"], "train_vs_hf"), 0.66),
        at_most(f"gpu-fast train_step at {s['mid']} / plain HF", get("gpu-fast", s["mid"], "train_vs_hf"), 0.8),
        at_most(f"gpu-fast log-probs + entropy at {s['throughput']} / plain HF",
                get("gpu-fast", s["throughput"], "log_probs_vs_hf"), 0.5),
        at_most(f"gpu-lean train_step at {s['long']} (s)", lean_long, 1.6),
        _target(f"train_step tokens/s at {s['throughput']} >= 5x the old {OLD_TOKENS_PER_S}",
                best, 5 * OLD_TOKENS_PER_S, best is not None and best >= 5 * OLD_TOKENS_PER_S, smoke),
        _target(f"one {s['long']} sequence fits one 80 GB GPU (peak GiB)",
                min(r["peak_gib"] for r in longest) if longest else "OOM", 80, bool(longest), smoke),
        # the fused LM head (actor.lm_head, #43): full recompute, the longest sequence (65,536 took 51 GiB before)
        _target(f"gpu-lean: one {s['longest']} sequence fits one 80 GB GPU (peak GiB)",
                lean_longest[0]["peak_gib"] if lean_longest else "OOM", 80, bool(lean_longest), smoke),
        # a measurement, not a target of the issue: < 1 means the fusions default (on with CUDA) is the faster one
        at_most(f"fusions on / off, gpu-fast train_step at {s['throughput']} (< 1: keep fusions on)",
                figures["fusions_on_vs_off_train"], 1.0),
    ]
    size = f"{offload['gb']:.3g} GB" if "gb" in offload else "?"
    for way in ("offload", "onload"):  # the gpu-fast actor's optimizer states, gradients and parameters
        gbps = offload.get(f"{way}_gbps")
        targets.append(_target(f"gpu-fast actor {way}, {size}, {'to' if way == 'offload' else 'from'} "
                               "pinned host memory (GB/s)", gbps, OFFLOAD_GBPS,
                               gbps is not None and gbps >= OFFLOAD_GBPS, smoke))
    # every batch needs a figure from some variant; an OOM of one variant is itself a figure
    ok = all(any(r["batch"] == b and "error" not in r and r["label"] != "hf" for r in rows)
             for b in (s["throughput"], s["mid"])) \
        and (bool(longest) or not smoke)  # on the GPU an OOM at the long batch is the target's MISS
    # the offload's host copies: one block per part, registered to the byte, so what is pinned is what
    # moves (torch's pinned allocator rounded each copy up to a power of two: up to 2x; issue #40 row 6)
    pinned = offload.get("pinned_registered_gb")
    over = round(pinned / offload["gb"], 4) if pinned is not None and offload.get("gb") else None  # (CPU: 0)
    targets.append(_target("gpu-fast actor offload: pinned host bytes / bytes moved <= 1.01", over, 1.01,
                           over is not None and over <= 1.01, smoke))
    ok = ok and offload.get("bit_exact") is True and offload.get("moved_every_round") is True  # functional
    return dict(ok=ok, figures=figures, targets=targets)


def step_vocab_op(smoke: bool) -> dict:
    import vocab_parallel

    s = SIZES[smoke]
    dev = _device(smoke)
    tokens, vocab, dtype = s["vocab"]
    ref = s["vocab_ref"]
    variants = ["chunked", "auto", ref]
    repeats = 3 if smoke else 10
    print(f"vocab_parallel.measure({str(dev)!r}, {tokens}, {vocab}, {dtype!r}, {variants}, {repeats})", flush=True)
    rows = vocab_parallel.measure(str(dev), tokens, vocab, dtype, variants, repeats)
    by = {r["variant"]: r for r in rows if r["kind"] == "variant"}
    bound = next(r for r in rows if r["kind"] == "bound")
    figures = {"shape": f"{tokens}x{vocab} {dtype}", "bound_ms": round(bound["bound_ms"], 3),
               "reference": ref}
    for name, r in by.items():
        figures[name] = ({"time_ms": round(r["time_ms"], 3), "fwd_ms": round(r["fwd_ms"], 3),
                          "extra_peak_ratio": None if r["extra_peak_ratio"] is None else round(r["extra_peak_ratio"], 4),
                          "x_bound": round(r["x_bound"], 2), "max_abs_diff_vs_chunked": r["max_abs_diff_vs_chunked"]}
                         if "error" not in r else {"error": r["error"]})
    op, base = by.get("auto", {}), by.get(ref, {})
    ratio = op["time_ms"] / base["time_ms"] if "time_ms" in op and "time_ms" in base else None
    extra = op.get("extra_peak_ratio")
    diff = op.get("max_abs_diff_vs_chunked") or {}
    targets = [
        _target(f"vocab op time / {ref} time <= 1", None if ratio is None else round(ratio, 3), 1.0,
                ratio is not None and ratio <= 1.0, smoke),
        _target("vocab op extra memory / logits <= 0.1", None if extra is None else round(extra, 4), 0.1,
                extra is not None and extra <= 0.1, smoke),
        _target("vocab op time / bandwidth bound <= 1.3", op.get("x_bound"), 1.3,
                op.get("x_bound") is not None and op["x_bound"] <= 1.3, smoke),
    ]
    # the op must agree with its own chunked path (fp32 arithmetic either way; bf16 logits)
    agree = all(v <= (5e-2 if k == "grad" else 1e-3) for k, v in diff.items()) if diff else smoke
    figures["auto_agrees_with_chunked"] = agree
    return dict(ok="time_ms" in op and "time_ms" in base and agree, figures=figures, targets=targets)


def step_lm_head(smoke: bool) -> dict:
    import lm_head

    s = SIZES[smoke]
    dev = _device(smoke)
    tokens, hiddens, vocab, dtype = s["lm_head"]
    repeats = 2 if smoke else 5
    print(f"lm_head.measure({str(dev)!r}, {tokens}, {list(hiddens)}, {vocab}, {dtype!r}, {repeats})", flush=True)
    rows = lm_head.measure(str(dev), tokens, hiddens, vocab, dtype, repeats)
    figures = {f"hidden {r['hidden']}": r for r in rows}
    figures["shape"] = f"{tokens} tokens x {vocab} {dtype}"
    targets = []
    for r in rows:
        fused = r.get("fused", {})
        targets.append(_target(f"fused LM head (train pass) / three GEMMs at hidden {r['hidden']} <= 1.3",
                               fused.get("x_gemms"), 1.3, fused.get("x_gemms") is not None and fused["x_gemms"] <= 1.3,
                               smoke))
        extra = fused.get("extra_peak_vs_logits")
        targets.append(_target(f"fused LM head extra memory / logits at hidden {r['hidden']} <= 0.15", extra, 0.15,
                               extra is not None and extra <= 0.15, smoke))
    # the Qwen3-14B shape at TP 4: one rank's weight shard, the backward timed, its peak beside the fit check's figure
    tokens, hidden, v_local, dtype = s["lm_head_shard"]
    print(f"lm_head.shard({str(dev)!r}, {tokens}, {hidden}, {v_local}, {dtype!r}, {repeats})", flush=True)
    sh = lm_head.shard(str(dev), tokens, hidden, v_local, dtype, repeats)
    figures["14B shard"] = sh
    where = f"{tokens} x {hidden}, a {v_local}-row shard"
    targets.append(_target(f"fused LM head (train pass) / three GEMMs, {where} <= 1.3", sh["x_gemms"], 1.3,
                           sh["x_gemms"] <= 1.3, smoke))
    ratio = sh["peak_vs_fit_check"]
    targets.append(_target(f"fused LM head peak memory / the fit check's figure, {where} <= 1", ratio, 1.0,
                           ratio is not None and ratio <= 1.0, smoke))
    return dict(ok=all("ms" in r.get("fused", {}) for r in rows) and sh["backward_ms"] > 0, figures=figures,
                targets=targets)


def step_disk_sync(smoke: bool) -> dict:
    import torch

    from megatron_tepo.buckets import to_flat_bucket, write_safetensors

    dev = _device(smoke)
    s = SIZES[smoke]
    g = torch.Generator(device=dev).manual_seed(0)
    rows = max(1, int(s["sync_mb"] * 2**20 / (1024 * 2)))  # a bf16 [rows, 1024] matrix of ~sync_mb
    named = [("model.embed_tokens.weight", torch.randn(rows, 1024, generator=g, device=dev).to(torch.bfloat16)),
             ("model.layers.0.self_attn.q_proj.weight", torch.randn(256, 1024, generator=g, device=dev)),
             ("model.layers.0.input_layernorm.weight", torch.randn(1023, generator=g, device=dev).half()),
             ("model.counts", torch.arange(77, device=dev, dtype=torch.int64))]
    bucket = to_flat_bucket(named)
    figures = {"device": str(bucket.flat.device), "bytes": bucket.nbytes, "tensors": len(named)}
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "bucket.safetensors"
        times = []
        for _ in range(2):  # the first includes any pinned-buffer allocation
            if dev.type == "cuda":
                torch.cuda.synchronize()
            t0 = time.perf_counter()
            write_safetensors(bucket, str(path))
            times.append(time.perf_counter() - t0)
        raw = path.read_bytes()
        (n,) = struct.unpack("<Q", raw[:8])
        data = raw[8 + n:]
        bytes_equal = data == bucket.flat.cpu().numpy().tobytes()
        from safetensors.torch import load_file

        back = load_file(str(path))
        tensors_equal = sorted(back) == sorted(n for n, _ in named) and all(
            back[n].dtype == t.dtype and torch.equal(back[n].view(torch.uint8), t.cpu().contiguous().view(torch.uint8))
            for n, t in named)
    figures.update(write_s=[round(t, 4) for t in times], GBps=round(bucket.nbytes / min(times) / 1e9, 3),
                   bytes_equal=bytes_equal, tensors_equal=tensors_equal)
    print(json.dumps(figures), flush=True)
    return dict(ok=bytes_equal and tensors_equal, figures=figures, targets=[])


def _open_in_child(q_in, q_out) -> None:
    """A second process (spawned): opens what arrives by IPC (a CUDA IPC handle; shared memory on
    CPU) and answers with the sum of its bytes, or the error."""
    import torch

    try:
        t = q_in.get(timeout=300)
        q_out.put(("ok", int(t.view(torch.uint8).sum(dtype=torch.int64).item()), str(t.device)))
    except Exception as exc:  # noqa: BLE001 -- the answer is the error
        q_out.put(("error", f"{type(exc).__name__}: {exc}"[:400], ""))


def step_ipc_handles(smoke: bool) -> dict:
    """Issue #40 row 1: with the trainer's allocator setting (expandable segments on), the weight
    export's buffer (``actor/export.py``'s, what the ``ipc`` sync hands to the servers) opens by CUDA
    IPC in a second process with its bytes intact; beside it, a buffer made in an expandable segment
    (what the export's were before the fix): whether it opens depends on the machine allowing
    ``pidfd_getfd`` (containers without ptrace do not), a figure, not a failure."""
    import queue

    import torch
    import torch.multiprocessing as mp

    from megatron_tepo import cuda_alloc
    from megatron_tepo.actor.export import _Buffers

    dev = _device(smoke)
    if dev.type == "cuda":
        os.environ["PYTORCH_CUDA_ALLOC_CONF"] = "expandable_segments:True"  # the trainer's (slurm/lib.sh)
        cuda_alloc._set_settings("expandable_segments:True")
    figures = {"device": str(dev), "trainer_expandable_segments": cuda_alloc.expandable_segments_on()}
    nbytes = (1 << 16) if smoke else (256 << 20)
    ctx = mp.get_context("spawn")

    def share(t, label) -> bool:
        want = int(t.view(torch.uint8).sum(dtype=torch.int64).item())
        q_in, q_out = ctx.Queue(), ctx.Queue()
        child = ctx.Process(target=_open_in_child, args=(q_in, q_out), daemon=True)
        child.start()
        t0 = time.perf_counter()
        q_in.put(t)
        try:
            status, value, where = q_out.get(timeout=300)
        except queue.Empty:
            status, value, where = "error", "no answer within 300 s", ""
        child.join(30)
        ok = status == "ok" and value == want
        figures[label] = {"opened": status == "ok", "bytes_equal": ok, "in": where,
                          "seconds": round(time.perf_counter() - t0, 3)}
        if status != "ok":
            figures[label]["error"] = value
        return ok

    g = torch.Generator(device=dev).manual_seed(0)
    export_buf = _Buffers(True, device=dev).get("flat", nbytes)
    export_buf.copy_(torch.randint(0, 256, (nbytes,), dtype=torch.uint8, device=dev, generator=g))
    ok = share(export_buf, "export_buffer")
    in_segment = torch.randint(0, 256, (nbytes,), dtype=torch.uint8, device=dev, generator=g)
    share(in_segment, "expandable_segment_buffer")
    figures["trainer_expandable_segments_after"] = cuda_alloc.expandable_segments_on()
    print(json.dumps(figures), flush=True)
    if dev.type == "cuda":  # the export's setting off around its buffers, and back on for the rest
        ok = ok and figures["trainer_expandable_segments"] and figures["trainer_expandable_segments_after"]
    return dict(ok=ok, figures=figures, targets=[])


def step_async_save(smoke: bool) -> dict:
    """Issue #50 row 2: one asynchronous save through each writer the stack has (megatron-core's own,
    and NVRx's where it imports: ``.gpu/nvrx`` carried), with the trainer's allocator
    (``PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True``): which staging each took -- NVRx's must not
    be CUDA IPC of expandable segments (``host_shm``: what reached its writer says
    ``use_cpu_shm_for_gpu_tensors``) --, published, and loaded bit for bit by a fresh actor
    (``tests/megatron/workers/async_staging_worker.py``, one process a writer)."""
    import importlib.util

    if not smoke:
        _device(smoke)
    env = dict(os.environ, PYTHONUNBUFFERED="1", PYTORCH_CUDA_ALLOC_CONF="expandable_segments:True",
               PYTHONPATH=os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]))
    if smoke:
        env["CUDA_VISIBLE_DEVICES"] = ""
    writers = ["mcore"] + (["nvrx"] if importlib.util.find_spec("nvidia_resiliency_ext") else [])
    figures, ok = {"writers": writers}, True
    for writer in writers:
        with tempfile.TemporaryDirectory() as tmp:
            cmd = [sys.executable, str(REPO / "tests/megatron/workers/async_staging_worker.py"), tmp, writer]
            print("$", " ".join(cmd), flush=True)
            rc = subprocess.run(cmd, cwd=REPO, env=env).returncode
            out = Path(tmp) / "staging.json"
            r = json.loads(out.read_text()) if out.exists() else {"error": f"exit {rc}, no result"}
        figures[writer] = r
        good = rc == 0 and r.get("published") and r.get("params_equal")
        if writer == "nvrx" and not smoke:  # expandable segments on a GPU: never CUDA IPC
            good = good and r.get("writer", [None, None])[1] == "host_shm" and \
                r.get("writer_kwargs") == [{"use_cpu_shm_for_gpu_tensors": True}]
        ok = ok and bool(good)
    print(json.dumps(figures), flush=True)
    return dict(ok=ok, figures=figures, targets=[])


def step_routing_replay(smoke: bool) -> dict:
    """Issue #50's GPU check of routing replay: the main loop (``tools/train.py``, the embedded engine and
    the actor on the device) on a random tiny Qwen3-MoE (``tools/make_tiny_model.py --moe``), 2 steps
    each of ``r3`` (the engine's routing replayed) and ``r2`` (the actor's own, recorded in the
    old-log-prob pass): routing coverage 1.0 in every pass, and r2's replay equal to its recording
    (mismatch 0)."""
    if not smoke:
        _device(smoke)
    env = dict(os.environ, PYTHONUNBUFFERED="1", PYTHONPATH=os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]))
    if smoke:
        env["CUDA_VISIBLE_DEVICES"] = ""
    figures, targets, ok = {}, [], True
    with tempfile.TemporaryDirectory() as tmp:
        subprocess.run([sys.executable, str(REPO / "tools/make_tiny_model.py"), "--out", tmp, "--train-size", "200",
                        "--eval-size", "20", "--moe"], cwd=REPO, env=env, check=True)
        for mode in ("r3", "r2"):
            out = Path(tmp) / f"run_{mode}"
            cmd = [sys.executable, str(REPO / "tools/train.py"), "--config", str(REPO / "examples/tiny_tepo/config.yaml"),
                   "reward.kind=exact_match", "rollout.prompts_per_step=8", "train.mini_batch_prompts=4",
                   "train.steps=2", "train.export_hf=false", "rollout.dynamic_sampling=false",
                   f"model.path={Path(tmp) / 'moe'}", f"data.train_files=[{Path(tmp) / 'train.jsonl'}]",
                   f"train.output_dir={out}", f"actor.routing_replay={mode}"]
            print("$", " ".join(cmd), flush=True)
            rc = subprocess.run(cmd, cwd=REPO, env=env).returncode
            log = out / "metrics.jsonl"
            rows = [json.loads(x) for x in log.read_text().splitlines()] if log.exists() else []
            keys = ("routing_coverage", "routing_mismatch_max", "old_routing_coverage", "drift_max")
            figures[mode] = [{k: r[k] for k in keys if k in r} for r in rows] or {"error": f"exit {rc}"}
            cover = [r.get("routing_coverage") for r in rows]
            ok = ok and rc == 0 and len(rows) == 2 and all(c == 1.0 for c in cover)
            targets.append(_target(f"{mode}: routing coverage in every pass", min(cover) if cover else None, 1.0,
                                   bool(cover) and min(cover) == 1.0, smoke))
            if mode == "r2":
                worst = max((r.get("routing_mismatch_max", 1.0) for r in rows), default=None)
                targets.append(_target("r2: the replay's routing against its recording (mismatch max)", worst, 0.0,
                                       worst == 0.0, smoke))
    print(json.dumps(figures), flush=True)
    return dict(ok=ok, figures=figures, targets=targets)


def _vm(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    return 0


def step_hf_load(smoke: bool) -> dict:
    import torch
    import transformers
    from actor_step import SHAPES

    from megatron_tepo.actor import MegatronActor, RolloutBatch
    from megatron_tepo.megatron.parallel import single_process_env

    dev = _device(smoke)
    shape = dict(SHAPES["tiny" if smoke else "qwen3-0.6b"], num_hidden_layers=2 if smoke else 4)
    cfg = transformers.Qwen3Config(**shape, rms_norm_eps=1e-6)
    cfg.architectures = ["Qwen3ForCausalLM"]
    torch.manual_seed(0)
    hf = transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    model_bytes = sum(p.numel() * 4 for p in hf.parameters())
    single_process_env()
    with tempfile.TemporaryDirectory() as tmp:
        hf.save_pretrained(tmp, max_shard_size="1MB" if smoke else "100MB")
        shards = len(list(Path(tmp).glob("*.safetensors")))
        if dev.type == "cuda":
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            gpu0 = torch.cuda.memory_allocated()
        try:
            Path("/proc/self/clear_refs").write_text("5")  # VmHWM := VmRSS (Linux)
        except OSError:
            pass
        rss0 = _vm("VmRSS")
        t0 = time.perf_counter()
        actor = MegatronActor(tmp, hf_weights=tmp, precision="fp32", attention="sdpa")
        if dev.type == "cuda":
            torch.cuda.synchronize()
        build_s = time.perf_counter() - t0
        host_peak = _vm("VmHWM") - rss0
        gpu_peak = torch.cuda.max_memory_allocated() - gpu0 if dev.type == "cuda" else None
    b, length, prompt = 2, 64 if smoke else 512, 8 if smoke else 64
    g = torch.Generator().manual_seed(1)
    batch = RolloutBatch(input_ids=torch.randint(0, cfg.vocab_size, (b, length), generator=g),
                         prompt_lens=torch.full((b,), prompt), response_mask=torch.ones(b, length - prompt))
    lp, ent = actor.compute_log_probs(batch)
    hf = hf.to(dev).eval()
    with torch.no_grad():
        logp_all = torch.log_softmax(hf(input_ids=batch.input_ids.to(dev)).logits.float(), -1)
    pos = torch.arange(prompt, length, device=dev)
    rows = logp_all[:, pos - 1]  # [b, R, V]: position t predicts token t
    ref_lp = rows.gather(-1, batch.input_ids.to(dev)[:, pos][..., None]).squeeze(-1)
    ref_ent = -(rows.exp() * rows).sum(-1)
    lp_diff = float((lp.to(dev) - ref_lp).abs().max())
    ent_diff = float((ent.to(dev) - ref_ent).abs().max())
    tol = 2e-3
    figures = {"device": str(actor.device), "params": sum(p.numel() for p in hf.parameters()), "shards": shards,
               "model_fp32_gb": round(model_bytes / 1e9, 3), "build_s": round(build_s, 2),
               "host_peak_x": round(host_peak / model_bytes, 3),
               "gpu_peak_x": None if gpu_peak is None else round(gpu_peak / model_bytes, 3),
               "max_abs_diff_log_probs": lp_diff, "max_abs_diff_entropy": ent_diff, "tolerance": tol}
    print(json.dumps(figures), flush=True)
    ok = lp_diff <= tol and ent_diff <= tol and actor.device.type == dev.type
    return dict(ok=ok, figures=figures, targets=[])


def step_main_job(smoke: bool) -> dict:
    if not smoke:
        _device(smoke)
    with tempfile.TemporaryDirectory() as tmp:
        cmd = [sys.executable, "examples/tiny_tepo/run.py", f"train.output_dir={tmp}"]
        if smoke:
            cmd += ["train.steps=2", "--eval-size", "16"]
        env = dict(os.environ, PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1", MKL_NUM_THREADS="1")
        if smoke:
            env["CUDA_VISIBLE_DEVICES"] = ""
        print("$", " ".join(cmd), flush=True)
        rc = subprocess.run(cmd, cwd=REPO, env=env).returncode
        summary_path = Path(tmp) / "summary.json"
        summary = json.loads(summary_path.read_text()) if summary_path.exists() else {}
    before, after = summary.get("accuracy_before"), summary.get("accuracy_after")
    learns = before is not None and after is not None and after > before
    figures = {"rc": rc, "accuracy_before": before, "accuracy_after": after, "steps": summary.get("steps"),
               "run_seconds": None if "seconds" not in summary else round(summary["seconds"], 1)}
    targets = [_target("main job learns: held-out accuracy after > before",
                       None if after is None else f"{before:.3f} -> {after:.3f}", "after > before", learns, smoke)]
    return dict(ok=rc == 0 and after is not None and (smoke or learns), figures=figures, targets=targets)


def _rel(a, b) -> float:
    """max |a - b| over max |b| (0 when both are 0)."""
    den = float(b.abs().max())
    return float((a.float() - b.float()).abs().max()) / den if den else float((a - b).abs().max())


def _gdn_kernels(dev, smoke: bool) -> dict:
    """Qwen3.5's Gated DeltaNet kernels (the chunked gated delta rule and the causal conv1d) against
    transformers' torch path on packed sequences: flash-linear-attention's (on a GPU where ``fla``
    imports) and the actor's stand-in, outputs and the gradients of every input, and each one's
    forward + backward seconds. Where fla refuses its backward (``megatron_tepo/gdn_kernels.py``: Hopper
    with 3.4.0 <= Triton < 3.7.1, no tilelang; or it raises so), fla's forward alone is compared and
    the refusal recorded."""
    import importlib.util

    import torch
    import torch.nn.functional as F
    from transformers.models.qwen3_5 import modeling_qwen3_5 as hf_mod

    from megatron_tepo.megatron import gated_delta_rule as ours
    from megatron_tepo.megatron.cpu_patches import fla_backward_refusal

    lens = [64, 40, 8] if smoke else [1024, 2048, 96]
    heads, dk, dv = (4, 16, 16) if smoke else (16, 128, 128)
    g = torch.Generator(device="cpu").manual_seed(0)
    total = sum(lens)
    cu = torch.tensor([0] + list(torch.tensor(lens).cumsum(0)), dtype=torch.int32)

    def rnd(*shape):
        return torch.randn(*shape, generator=g).to(dev)

    q, k = ours.l2norm(rnd(1, total, heads, dk)), ours.l2norm(rnd(1, total, heads, dk))
    v = rnd(1, total, heads, dv)
    gate, beta = -F.softplus(rnd(1, total, heads)), torch.sigmoid(rnd(1, total, heads))
    x, w = rnd(1, total, 3 * heads * dk), rnd(3 * heads * dk, 4) * 0.3
    grad_o, grad_y = rnd(1, total, heads, dv), rnd(1, total, 3 * heads * dk)

    def hf_rule(q, k, v, g, beta, cu_seqlens, **_):  # transformers' torch path, one sequence at a time
        outs = []
        for a, b in zip(cu_seqlens[:-1].tolist(), cu_seqlens[1:].tolist()):
            o, _ = hf_mod.torch_chunk_gated_delta_rule(q[:, a:b], k[:, a:b], v[:, a:b], g[:, a:b], beta[:, a:b],
                                                       use_qk_l2norm_in_kernel=False)
            outs.append(o)
        return torch.cat(outs, 1), None

    def hf_conv(x, weight, activation, cu_seqlens, **_):  # its reference causal conv1d (depthwise, SiLU)
        outs = []
        for a, b in zip(cu_seqlens[:-1].tolist(), cu_seqlens[1:].tolist()):
            y = F.conv1d(x[:, a:b].transpose(1, 2), weight.unsqueeze(1), padding=weight.shape[-1] - 1,
                         groups=weight.shape[0])[..., : b - a]
            outs.append(F.silu(y).transpose(1, 2))
        return torch.cat(outs, 1), None

    def run(rule, conv, cu_seqlens, backward=True):
        ins = [t.clone().requires_grad_(backward) for t in (q, k, v, gate, beta, x, w)]
        if dev.type == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        o, _ = rule(*ins[:5], cu_seqlens=cu_seqlens)
        y, _ = conv(ins[5], weight=ins[6], activation="silu", cu_seqlens=cu_seqlens)
        if backward:
            ((o.float() * grad_o).sum() + (y.float() * grad_y).sum()).backward()
        if dev.type == "cuda":
            torch.cuda.synchronize()
        return [o.detach(), y.detach()] + ([t.grad for t in ins] if backward else []), time.perf_counter() - t0

    kernels = {"stand-in": (ours.chunk_gated_delta_rule, ours.causal_conv1d, cu.to(dev))}
    refused = None
    if dev.type == "cuda" and importlib.util.find_spec("fla") is not None:
        from fla.modules.convolution import causal_conv1d as fla_conv
        from fla.ops.gated_delta_rule import chunk_gated_delta_rule as fla_rule

        kernels = {"flash-linear-attention": (fla_rule, fla_conv, cu.to(dev).long()), **kernels}
        refused = fla_backward_refusal(torch.cuda.get_device_capability(dev))
        if refused is None:
            try:
                run(fla_rule, fla_conv, cu.to(dev).long())  # (warm-up: Triton compiles)
            except RuntimeError as exc:  # fla raises in its gated backward where Triton computes it wrong
                if "Triton" not in str(exc):
                    raise
                refused = str(exc).splitlines()[0][:300]
        if refused:
            print(f"[qwen3_5] flash-linear-attention's backward is refused here: {refused}; its forward is "
                  f"compared alone", flush=True)
    names = ["o", "y", "dq", "dk", "dv", "dg", "dbeta", "dx", "dw"]
    ref, ref_s = run(hf_rule, hf_conv, cu.to(dev))
    out = {"reference": "transformers' torch path", "sequences": lens, "heads": heads, "backward_refused": refused,
           "reference_fwd_bwd_s": round(ref_s, 4), "kernels": {}}
    for label, (rule, conv, cu_k) in kernels.items():
        backward = not (refused and label == "flash-linear-attention")
        run(rule, conv, cu_k, backward)  # (warm-up)
        got, secs = run(rule, conv, cu_k, backward)
        fwd_ref = ref if backward else run(hf_rule, hf_conv, cu.to(dev), False)[0]
        out["kernels"][label] = {"rel_err": {n: _rel(a, b) for n, a, b in zip(names, got, fwd_ref)},
                                 "fwd_bwd_s" if backward else "fwd_s": round(secs, 4)}
    return out


def _hf_grad_reference(hf, ids, lens, prompt, old_lp, adv, mask, dev):
    """transformers' gradients (by parameter name, as fp32) of the same GRPO loss the actor takes: its
    log-probs one sequence at a time (no padding inside the model), the loss in fp64."""
    import torch

    from megatron_tepo.algorithms import compute_policy_loss

    hf.zero_grad(set_to_none=True)
    width = mask.shape[1]
    lps, ents = [], []
    for i, n in enumerate(lens):
        logp = torch.log_softmax(hf(input_ids=ids[i:i + 1, :n].to(dev)).logits.double(), -1)[0]
        rows = logp[torch.arange(prompt, n, device=dev) - 1]
        lp = rows.gather(-1, ids[i, prompt:n].to(dev)[:, None]).squeeze(-1)
        ent = -(rows.exp() * rows).sum(-1)
        lps.append(torch.nn.functional.pad(lp, (0, width - lp.numel())))
        ents.append(torch.nn.functional.pad(ent, (0, width - ent.numel())))
    loss, _ = compute_policy_loss("grpo", torch.stack(lps).double(), old_lp.to(dev).double(), adv.to(dev).double(),
                                  mask.to(dev), entropy=torch.stack(ents).double())
    loss.backward()
    return {n: p.grad.detach().float() for n, p in hf.named_parameters() if p.grad is not None}


def step_qwen3_5(smoke: bool) -> dict:
    """Issue #53 / #56's GPU check: Qwen3.5's Gated DeltaNet kernels against transformers, the actor on
    HybridModel against transformers (forward and backward), and its bf16 train step beside the
    same-size dense Qwen3's, time and peak memory (module docstring)."""
    import contextlib
    import copy
    from unittest import mock

    import torch
    import transformers

    from megatron_tepo.actor import MegatronActor, RolloutBatch
    from megatron_tepo.algorithms import PolicyLoss
    from megatron_tepo.megatron import cpu_patches
    from megatron_tepo.megatron.parallel import single_process_env

    dev = _device(smoke)
    if dev.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = False
    figures, targets = {}, []
    # (1) the kernels against transformers' torch path
    kern = _gdn_kernels(dev, smoke)
    figures["kernels"] = kern
    refused = kern["backward_refused"]
    tol_k = 2e-3
    worst_k = 0.0
    for label, r in kern["kernels"].items():
        worst = max(r["rel_err"].values())
        worst_k = max(worst_k, worst)
        what = "outputs" if "fwd_s" in r else "outputs and input gradients"
        targets.append(_target(f"{label} vs {kern['reference']}: {what} (max relative error)", worst, tol_k,
                               worst <= tol_k, smoke))
    size = (dict(hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
                 head_dim=32, vocab_size=256, linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16,
                 linear_value_head_dim=16) if smoke else
            dict(hidden_size=1024, intermediate_size=3072, num_hidden_layers=8, num_attention_heads=8, num_key_value_heads=2,
                 head_dim=256, vocab_size=32768, linear_num_key_heads=8, linear_num_value_heads=16,
                 linear_key_head_dim=128, linear_value_head_dim=128))
    common = dict(max_position_embeddings=4096, rms_norm_eps=1e-6, tie_word_embeddings=False)
    cfg = transformers.Qwen3_5TextConfig(**size, **common, linear_conv_kernel_dim=4,
                                         rope_parameters={"rope_type": "default", "rope_theta": 1e7,
                                                          "partial_rotary_factor": 0.25})
    cfg.architectures = ["Qwen3_5ForCausalLM"]
    dense = transformers.Qwen3Config(**{k: v for k, v in size.items() if not k.startswith("linear_")}, **common,
                                     rope_theta=1e7)
    dense.architectures = ["Qwen3ForCausalLM"]
    single_process_env()
    torch.manual_seed(0)
    hf = transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    with torch.no_grad():  # (zero-centred norms start at 0: move them, so a wrong norm shows)
        for n, p in hf.named_parameters():
            if n.endswith("norm.weight"):
                p.add_(0.1 * torch.randn_like(p))
    # (2) the actor on packed sequences of several lengths against transformers: log-probs and entropy,
    # then the gradients of every weight (the Gated DeltaNet layers' among them) of one GRPO loss
    lens = [40, 64, 17] if smoke else [700, 2048, 300]
    prompt, width = 8, max(lens)
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, cfg.vocab_size, (len(lens), width), generator=g)
    mask = torch.zeros(len(lens), width - prompt)
    for i, n in enumerate(lens):
        mask[i, : n - prompt] = 1
        ids[i, n:] = 0
    batch = RolloutBatch(input_ids=ids, prompt_lens=torch.full((len(lens),), prompt), response_mask=mask)
    # where fla refuses its backward the builder refuses the model; the forward alone is compared here
    forward_only = mock.patch.object(cpu_patches, "fla_backward_refusal", lambda *a, **k: None) if refused else \
        contextlib.nullcontext()
    with forward_only:
        actor = MegatronActor(cfg, hf_weights={n: t.detach().clone() for n, t in hf.state_dict().items()},
                              precision="fp32", attention="sdpa", pack_sequences=True)
    figures["gdn_kernels_in_the_actor"] = ("torch stand-in" if "gdn_kernels" in cpu_patches.applied_patches()
                                           else "flash-linear-attention")
    lp, ent = actor.compute_log_probs(batch)
    hf = hf.to(dev)
    lp_diff = ent_diff = 0.0
    with torch.no_grad():
        for i, n in enumerate(lens):  # one sequence at a time: no padding inside transformers' forward
            logp = torch.log_softmax(hf(input_ids=ids[i:i + 1, :n].to(dev)).logits.float(), -1)[0]
            pos = torch.arange(prompt, n, device=dev)
            rows = logp[pos - 1]
            ref_lp = rows.gather(-1, ids[i, prompt:n].to(dev)[:, None]).squeeze(-1)
            ref_ent = -(rows.exp() * rows).sum(-1)
            lp_diff = max(lp_diff, float((lp[i, : n - prompt].to(dev) - ref_lp).abs().max()))
            ent_diff = max(ent_diff, float((ent[i, : n - prompt].to(dev) - ref_ent).abs().max()))
    tol = 2e-3
    figures.update(lengths=lens, max_abs_diff_log_probs=lp_diff, max_abs_diff_entropy=ent_diff, tolerance=tol)
    targets.append(_target("actor (HybridModel) vs transformers: log-probs and entropy, fp32", max(lp_diff, ent_diff),
                           tol, max(lp_diff, ent_diff) <= tol, smoke))
    grad_ok = True
    if refused:
        figures["weight_grads"] = f"not compared: {refused}"
    else:
        batch.old_log_probs = lp.detach().cpu().float()
        batch.advantages = torch.randn(mask.shape, generator=g)
        actor.forward_backward(batch, PolicyLoss.of("grpo"))
        mine = {n: t.to(dev) for n, t in actor.export_hf_state("grad")}
        # (the reference in fp64: transformers' own fp32 gradients of A_log / dt_bias, sums over every token
        # that nearly cancel, were 1.7e-3 off its fp64 ones on the smoke model; the actor's fp32 ones 2.8e-4)
        hf64 = copy.deepcopy(hf).double()
        ref = _hf_grad_reference(hf64, ids, lens, prompt, batch.old_log_probs, batch.advantages, mask, dev)
        del hf64
        common_names = sorted(set(mine) & set(ref))
        errs = {n: _rel(mine[n], ref[n]) for n in common_names}
        gdn = {n: e for n, e in errs.items() if ".linear_attn." in n}
        worst_gdn, worst_all = max(gdn.values(), default=float("nan")), max(errs.values(), default=float("nan"))
        figures["weight_grads"] = {"reference": "transformers in fp64", "compared": len(errs),
                                   "unmatched": sorted(set(mine) ^ set(ref))[:8],
                                   "gated_deltanet_max_rel_err": worst_gdn, "all_max_rel_err": worst_all,
                                   "worst": {n: errs[n] for n in sorted(errs, key=errs.get)[-4:]}}
        grad_ok = bool(gdn) and worst_all <= tol_k and not (set(mine) ^ set(ref))
        targets.append(_target("actor vs transformers: every weight's gradient (max relative error; Gated DeltaNet "
                               "layers' in the figures)", worst_all, tol_k, grad_ok, smoke))
    del actor, hf
    # (3) bf16 train steps: Qwen3.5 against the same-size dense Qwen3, time and peak memory
    b, length = (2, 64) if smoke else (8, 2048)
    tb = RolloutBatch(input_ids=torch.randint(0, cfg.vocab_size, (b, length), generator=g),
                      prompt_lens=torch.full((b,), length // 8), response_mask=torch.ones(b, length - length // 8))
    tb.old_log_probs = torch.full(tb.response_mask.shape, -3.0)
    tb.advantages = torch.randn(tb.response_mask.shape, generator=g)
    loss = PolicyLoss.of("grpo")
    times, peaks = {}, {}
    for label, model_cfg in (("qwen3_5", cfg), ("qwen3_dense", dense)):
        if label == "qwen3_5" and refused:  # (its backward needs the kernels' backward)
            continue
        if dev.type == "cuda":
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats(dev)
        torch.manual_seed(0)
        a = MegatronActor(model_cfg, precision="bf16", attention="sdpa", pack_sequences=True,
                          max_tokens_per_micro_batch=b * length)
        runs = []
        for i in range(1 + (1 if smoke else 3)):
            if dev.type == "cuda":
                torch.cuda.synchronize()
            t0 = time.perf_counter()
            a.train_step(tb, loss)
            if dev.type == "cuda":
                torch.cuda.synchronize()
            runs.append(time.perf_counter() - t0)
        times[label] = sorted(runs[1:])[len(runs[1:]) // 2]
        peaks[label] = round(torch.cuda.max_memory_allocated(dev) / 2**30, 3) if dev.type == "cuda" else None
        del a
    figures["train_step_s"] = {k: round(v, 4) for k, v in times.items()}
    figures["train_step_peak_gib"] = peaks
    if refused:
        figures["train_step_s"]["qwen3_5"] = f"not measured: {refused}"
    else:
        figures["train_step_ratio_vs_dense"] = round(times["qwen3_5"] / times["qwen3_dense"], 3)
        if dev.type == "cuda":
            figures["train_step_peak_ratio_vs_dense"] = round(peaks["qwen3_5"] / peaks["qwen3_dense"], 3)
    figures["batch"] = f"{b}x{length}"
    print(json.dumps(figures), flush=True)
    ok = worst_k <= tol_k and max(lp_diff, ent_diff) <= tol and grad_ok and not refused
    return dict(ok=ok, figures=figures, targets=targets)


STEP_FNS = {"tests": step_tests, "actor_step": step_actor_step, "vocab_op": step_vocab_op, "lm_head": step_lm_head,
            "disk_sync": step_disk_sync, "ipc_handles": step_ipc_handles, "hf_load": step_hf_load,
            "main_job": step_main_job, "async_save": step_async_save, "routing_replay": step_routing_replay,
            "qwen3_5": step_qwen3_5}


# ---------------------------------------------------------------------------------- records
def append(out: Path, line: dict) -> None:
    out.mkdir(parents=True, exist_ok=True)
    with open(out / "summary.jsonl", "a") as f:
        f.write(json.dumps(line, default=str) + "\n")
    print("SUMMARY " + json.dumps(line, default=str), flush=True)


def run_step(name: str, out: Path, smoke: bool) -> int:
    t0 = time.time()
    line = {"step": name, "smoke": smoke}
    try:
        res = STEP_FNS[name](smoke)
        line.update(ok=bool(res["ok"]), figures=res["figures"], targets=res["targets"])
    except Exception as exc:  # noqa: BLE001 -- recorded, and the check goes on with the next step
        traceback.print_exc()
        line.update(ok=False, figures={}, targets=[], error=f"{type(exc).__name__}: {str(exc)[:500]}")
    line["seconds"] = round(time.time() - t0, 1)
    append(out, line)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0 if line["ok"] else 1)  # no process-group / CUDA teardown after the record is written


def setup_info(out: Path, smoke: bool, note: str) -> int:
    line = {"step": "setup", "smoke": smoke, "note": note, "targets": []}
    figures = {"python": sys.version.split()[0], "pythonpath": os.environ.get("PYTHONPATH", "")}
    try:
        import importlib.metadata as md

        import torch

        figures["torch"] = torch.__version__
        figures["device"] = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
        for dist in ("megatron-core", "transformers", "triton", "pytest", "safetensors"):
            try:
                figures[dist] = md.version(dist)
            except md.PackageNotFoundError:
                figures[dist] = None
        import megatron.core  # noqa: F401

        figures["megatron_core_path"] = str(Path(megatron.core.__file__).parent)
        line["ok"] = smoke or torch.cuda.is_available()
        if not line["ok"]:
            line["error"] = "no CUDA device (GPU_CHECK_SMOKE=1 runs the CPU smoke version)"
    except Exception as exc:  # noqa: BLE001
        line.update(ok=False, error=f"{type(exc).__name__}: {exc}")
    line["figures"] = figures
    append(out, line)
    return 0 if line["ok"] else 1


def missing_wheels(folder: Path) -> list:
    """The wheels in ``folder`` whose distribution is not installed here (any version)."""
    import importlib.metadata as md

    todo = []
    for whl in sorted(folder.glob("*.whl")):
        dist = whl.name.split("-")[0]
        try:
            md.version(dist)
        except md.PackageNotFoundError:
            todo.append(str(whl))
    return todo


def _fmt(v) -> str:
    if isinstance(v, float):
        return f"{v:,.4g}" if abs(v) < 1000 else f"{v:,.0f}"
    if isinstance(v, int) and not isinstance(v, bool):
        return f"{v:,}"
    return str(v)


def report(out: Path, steps: list) -> int:
    path = out / "summary.jsonl"
    lines = [json.loads(x) for x in path.read_text().splitlines() if x.strip()] if path.exists() else []
    seen = {ln["step"]: ln for ln in lines}
    smoke = any(ln.get("smoke") for ln in lines)
    md = [f"# GPU check{' (SMOKE: CPU, tiny shapes; targets not judged)' if smoke else ''}", "",
          "| step | ok | seconds | figures |", "| --- | --- | --- | --- |"]
    failed = []
    for name in ["setup"] + steps:
        ln = seen.get(name)
        if ln is None:
            failed.append(name)
            md.append(f"| {name} | MISSING | - | no record (the step did not run) |")
            continue
        if not ln.get("ok"):
            failed.append(name)
        figs = json.dumps(ln.get("figures", {}), default=str)
        if len(figs) > 600:
            figs = figs[:600] + " ..."
        err = f" ERROR: {ln['error']}" if ln.get("error") else ""
        md.append(f"| {name} | {'yes' if ln.get('ok') else 'NO'} | {ln.get('seconds', '-')} | {figs}{err} |")
    md += ["", "| target | value | wanted | verdict |", "| --- | --- | --- | --- |"]
    n_pass = n_miss = 0
    for name in steps:
        for t in seen.get(name, {}).get("targets", []):
            verdict = "n/a (smoke)" if t["pass"] is None else "PASS" if t["pass"] else "MISS"
            n_pass += verdict == "PASS"
            n_miss += verdict == "MISS"
            md.append(f"| {t['name']} | {_fmt(t['value'])} | {_fmt(t['target'])} | {verdict} |")
    md += ["", f"steps failed: {', '.join(failed) or 'none'}; targets: {n_pass} PASS, {n_miss} MISS"]
    text = "\n".join(md)
    (out / "report.md").write_text(text + "\n")
    print(text)
    return 1 if failed else 0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("step")
    p.add_argument("name", choices=STEPS)
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--smoke", action="store_true")
    p = sub.add_parser("setup")
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--smoke", action="store_true")
    p.add_argument("--note", default="")
    p = sub.add_parser("record")
    p.add_argument("name")
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--smoke", action="store_true")
    p.add_argument("--error", required=True)
    p.add_argument("--seconds", type=float, default=None)
    p = sub.add_parser("missing-wheels")
    p.add_argument("folder", type=Path)
    p = sub.add_parser("report")
    p.add_argument("out", type=Path)
    p.add_argument("--steps", default=",".join(STEPS))
    args = ap.parse_args(argv)
    if args.cmd == "step":
        return run_step(args.name, args.out, args.smoke)
    if args.cmd == "setup":
        return setup_info(args.out, args.smoke, args.note)
    if args.cmd == "record":
        append(args.out, {"step": args.name, "smoke": args.smoke, "ok": False, "figures": {}, "targets": [],
                          "error": args.error, "seconds": args.seconds})
        return 0
    if args.cmd == "missing-wheels":
        for whl in missing_wheels(args.folder):
            print(whl)
        return 0
    return report(args.out, [s for s in re.split(r"[ ,]+", args.steps) if s])


if __name__ == "__main__":
    sys.exit(main())
