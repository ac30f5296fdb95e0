"""Benchmark of the LM head (``actor.lm_head``): the fused head (``ops/lm_head.py``) against the
materialized one (the logits of the scored tokens, then the vocab op), from final hidden states
``[tokens, hidden]`` and an output weight ``[vocab, hidden]``.

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/lm_head.py --memory [--tokens 8192] [--hidden 64] [--json PATH]
    python benchmarks/lm_head.py --device cuda --tokens 16384 --hidden 1024 5120 --dtype bf16

``--memory`` (any device; what the CPU acceptance measures): each case in a fresh process, the
extra peak of the log-prob pass (forward under ``no_grad``) and of the training pass (forward and
backward of ``sum(log_probs) + sum(entropy)``), beyond the inputs and what the pass returns (the
two ``[tokens]`` outputs and, training, the gradients of the hidden states and the weight), as a
share of today's logits (``tokens x vocab`` of the inputs' dtype). On CPU the peak is the
process's resident set (``VmHWM``, reset through ``/proc/self/clear_refs`` before the pass, then
``VmHWM - VmRSS`` before it), with glibc's mmap threshold fixed at 128 KiB
(``MALLOC_MMAP_THRESHOLD_``): every buffer above it is ``mmap``-ed and goes back to the system when
freed, so it counts what the pass held at once (with the default, dynamic threshold, freed buffers
of up to 32 MB stay in glibc's heap and the figure moved by +-60 MB between runs). On CUDA: ``torch.cuda.max_memory_allocated``.

Timing (``--device cuda``): per hidden size, the median over ``--repeats`` of the fused head's
training pass, of the materialized one's, and of the three GEMMs alone (the forward
``[T, h] x [h, V]`` and the two gradients), with the fused head's extra peak. The bound with the
recompute of each block's logits is four GEMMs, 4/3 of the three.

``--shard V_LOCAL`` (``--device cuda``; what the GPU check runs at the Qwen3-14B shape, TP 4:
``--tokens 16384 --hidden 5120 --shard 37984 --dtype bf16``): the fused head on one tensor-parallel
rank's weight shard, its forward and its backward timed apart (median over ``--repeats``), the
three GEMMs of the shard alone, and the peak memory of a forward and backward counted from before
the hidden states exist (the hidden states, both gradients and the head's buffers; the weight
left out) beside the fit check's figure for the same shape (``launch/memory.py``,
``fused_head_bytes``). On CPU the times only.

Left out: tensor parallelism's all-reduces (each rank runs the same code on its shard: the
per-token all-reduces are ``[tokens]`` vectors), Transformer Engine's and megatron-core main's fused
linear-cross-entropy (not installable here, nor in 0.19.2: see docs/BENCHMARKS.md).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

DTYPES = {"fp32": "float32", "bf16": "bfloat16"}


def _inputs(tokens, hidden, vocab, dtype, device, grad):
    import torch

    g = torch.Generator(device="cpu").manual_seed(0)
    h = (torch.randn(tokens, hidden, generator=g) * 0.5).to(device=device, dtype=dtype)
    w = (torch.randn(vocab, hidden, generator=g) * hidden ** -0.5).to(device=device, dtype=dtype)
    labels = torch.randint(0, vocab, (tokens,), generator=g).to(device)
    if grad:
        h.requires_grad_()
        w.requires_grad_()
    return h, w, labels


def _head(head):
    import torch

    from megatron_tepo.ops import vocab_parallel_log_probs_and_entropy
    from megatron_tepo.ops.lm_head import lm_head_log_probs_and_entropy

    if head == "fused":
        return lm_head_log_probs_and_entropy
    return lambda h, w, labels: vocab_parallel_log_probs_and_entropy(torch.nn.functional.linear(h, w), labels)


def _status(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"/proc/self/status has no {field}")


def child_memory(head, tokens, hidden, vocab, dtype_name, train) -> dict:
    """One pass in this (fresh) process: its extra peak over the inputs and its outputs."""
    import torch

    torch.set_num_threads(1)
    dtype = getattr(torch, DTYPES[dtype_name])
    h, w, labels = _inputs(tokens, hidden, vocab, dtype, "cpu", train)
    fn = _head(head)
    if not train:  # warm the code paths on a sliver (first-call allocations are not the pass's)
        with torch.no_grad():
            fn(h[:2], w, labels[:2])
    before = _status("VmRSS")
    Path("/proc/self/clear_refs").write_text("5")  # reset VmHWM to the current resident set
    start = time.perf_counter()
    if train:
        lp, ent = fn(h, w, labels)
        (lp.sum() + ent.sum()).backward()
    else:
        with torch.no_grad():
            lp, ent = fn(h, w, labels)
    seconds = time.perf_counter() - start
    peak = _status("VmHWM")
    outputs = lp.nbytes + ent.nbytes + ((h.grad.nbytes + w.grad.nbytes) if train else 0)
    logits = tokens * vocab * dtype.itemsize
    extra = peak - before - outputs
    return {"head": head, "pass": "training" if train else "log-prob", "dtype": dtype_name, "tokens": tokens,
            "hidden": hidden, "vocab": vocab, "extra_peak_bytes": extra, "logits_bytes": logits,
            "extra_vs_logits": round(extra / logits, 4), "seconds": round(seconds, 3)}


def memory(tokens, hidden, vocab, dtypes, heads) -> list:
    rows = []
    for dtype in dtypes:
        for head in heads:
            for train in (False, True):
                cmd = [sys.executable, __file__, "--child", head, str(tokens), str(hidden), str(vocab), dtype,
                       str(int(train))]
                # (a fixed mmap threshold: glibc's dynamic one keeps freed buffers of up to 32 MB in its
                # heap, which the resident set would count as held)
                proc = subprocess.run(cmd, capture_output=True, text=True, env={
                    **os.environ, "OMP_NUM_THREADS": "1", "MALLOC_MMAP_THRESHOLD_": "131072"})
                if proc.returncode != 0:
                    raise SystemExit(f"benchmarks/lm_head.py: the {head} {dtype} case failed:\n{proc.stderr[-3000:]}")
                row = json.loads(proc.stdout.strip().splitlines()[-1])
                rows.append(row)
                print(json.dumps(row), flush=True)
    return rows


def measure(device: str, tokens: int, hiddens, vocab: int, dtype_name: str, repeats: int) -> list:
    """Timing and peak memory on ``device`` (CUDA: events and the allocator's peak; CPU: wall time
    and no memory figure): per hidden size, the fused and materialized training passes and the
    three GEMMs."""
    import torch

    dtype = getattr(torch, DTYPES[dtype_name])
    cuda = device.startswith("cuda")
    rows = []

    def timed(fn):
        times = []
        for i in range(repeats + 1):
            if cuda:
                torch.cuda.synchronize()
            t0 = time.perf_counter()
            fn()
            if cuda:
                torch.cuda.synchronize()
            if i:  # the first is a warm-up
                times.append((time.perf_counter() - t0) * 1e3)
        return statistics.median(times)

    for hidden in hiddens:
        h, w, labels = _inputs(tokens, hidden, vocab, dtype, device, True)

        def gemms():  # the forward and the two gradients (the logits stand in for their gradient)
            logits = h.detach() @ w.detach().t()
            logits @ w.detach()
            logits.t() @ h.detach()
        bound = timed(gemms)
        row = {"hidden": hidden, "tokens": tokens, "vocab": vocab, "dtype": dtype_name, "gemms_ms": round(bound, 3)}
        logits_bytes = tokens * vocab * dtype.itemsize
        for head in ("fused", "materialized"):
            fn = _head(head)

            def step():
                h.grad = w.grad = None
                lp, ent = fn(h, w, labels)
                (lp.sum() + ent.sum()).backward()
            try:
                step()
                if cuda:
                    torch.cuda.synchronize()
                    base = torch.cuda.memory_allocated()
                    torch.cuda.reset_peak_memory_stats()
                ms = timed(step)
                extra = None
                if cuda:  # (the grads of the previous step are freed at the next one's start)
                    extra = (torch.cuda.max_memory_allocated() - base) / logits_bytes
                row[head] = {"ms": round(ms, 3), "x_gemms": round(ms / bound, 3),
                             "extra_peak_vs_logits": None if extra is None else round(extra, 4)}
            except torch.OutOfMemoryError as e:  # noqa: PERF203
                row[head] = {"error": f"OOM: {str(e).splitlines()[0]}"}
            h.grad = w.grad = None
            if cuda:
                torch.cuda.empty_cache()
        rows.append(row)
        print(json.dumps(row), flush=True)
    return rows


def shard(device: str, tokens: int, hidden: int, vocab_local: int, dtype_name: str, repeats: int) -> dict:
    """The fused head on a ``[vocab_local, hidden]`` weight shard (module doc, ``--shard``)."""
    import torch

    from megatron_tepo.launch.memory import fused_block_columns, fused_head_bytes
    from megatron_tepo.ops.lm_head import lm_head_log_probs_and_entropy as head

    dtype = getattr(torch, DTYPES[dtype_name])
    cuda = device.startswith("cuda")
    g = torch.Generator(device="cpu").manual_seed(0)
    w = (torch.randn(vocab_local, hidden, generator=g) * hidden ** -0.5).to(device=device, dtype=dtype).requires_grad_()
    labels = torch.randint(0, vocab_local, (tokens,), generator=g).to(device)
    h_cpu = torch.randn(tokens, hidden, generator=g) * 0.5
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        base = torch.cuda.memory_allocated()  # the weight and the labels: not the head's
        torch.cuda.reset_peak_memory_stats()
    h = h_cpu.to(device=device, dtype=dtype).requires_grad_()

    def sync():
        if cuda:
            torch.cuda.synchronize()

    def once():
        h.grad = w.grad = None
        sync()
        t0 = time.perf_counter()
        lp, ent = head(h, w, labels)
        loss = lp.sum() + ent.sum()
        sync()
        t1 = time.perf_counter()
        loss.backward()
        sync()
        return (t1 - t0) * 1e3, (time.perf_counter() - t1) * 1e3

    once()  # warm-up (the kernels' compilation)
    peak = None
    if cuda:
        peak = torch.cuda.max_memory_allocated() - base
    runs = [once() for _ in range(repeats)]

    def gemms():  # the forward and the two gradients of the shard (the logits stand in for their gradient)
        logits = h.detach() @ w.detach().t()
        logits @ w.detach()
        logits.t() @ h.detach()

    gemm_ms = []
    for i in range(repeats + 1):
        sync()
        t0 = time.perf_counter()
        gemms()
        sync()
        if i:
            gemm_ms.append((time.perf_counter() - t0) * 1e3)
    elem = dtype.itemsize
    figure = fused_head_bytes(tokens, hidden, vocab_local, elem)
    fwd, bwd = statistics.median(r[0] for r in runs), statistics.median(r[1] for r in runs)
    bound = statistics.median(gemm_ms)
    row = {"tokens": tokens, "hidden": hidden, "vocab_local": vocab_local, "dtype": dtype_name,
           "block_columns": fused_block_columns(tokens, vocab_local, elem), "forward_ms": round(fwd, 3),
           "backward_ms": round(bwd, 3), "gemms_ms": round(bound, 3), "x_gemms": round((fwd + bwd) / bound, 3),
           "peak_bytes": peak, "fit_check_bytes": int(figure),
           "peak_vs_fit_check": None if peak is None else round(peak / figure, 4)}
    print(json.dumps(row), flush=True)
    return row


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--memory", action="store_true", help="the extra peak per pass, each case in a fresh process")
    ap.add_argument("--child", nargs=6, metavar=("HEAD", "TOKENS", "HIDDEN", "VOCAB", "DTYPE", "TRAIN"),
                    help=argparse.SUPPRESS)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--tokens", type=int, default=8192)
    ap.add_argument("--hidden", type=int, nargs="+", default=[64])
    ap.add_argument("--vocab", type=int, default=151936)
    ap.add_argument("--dtype", nargs="+", default=["fp32", "bf16"], choices=sorted(DTYPES))
    ap.add_argument("--heads", nargs="+", default=["fused", "materialized"], choices=["fused", "materialized"])
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--shard", type=int, default=None, metavar="V_LOCAL",
                    help="the fused head on a weight shard of V_LOCAL rows, fit check's figure beside (module doc)")
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    if args.child:
        head, tokens, hidden, vocab, dtype, train = args.child
        print(json.dumps(child_memory(head, int(tokens), int(hidden), int(vocab), dtype, bool(int(train)))))
        return 0
    if args.memory:
        rows = memory(args.tokens, args.hidden[0], args.vocab, args.dtype, args.heads)
        print("| dtype | head | pass | extra peak (MB) | / logits | time (s) |")
        print("|---|---|---|---:|---:|---:|")
        for r in rows:
            print(f"| {r['dtype']} | {r['head']} | {r['pass']} | {r['extra_peak_bytes'] / 1e6:.1f} | "
                  f"{r['extra_vs_logits']} | {r['seconds']} |")
    elif args.shard:
        rows = [shard(args.device, args.tokens, args.hidden[0], args.shard, args.dtype[0], args.repeats)]
    else:
        rows = measure(args.device, args.tokens, args.hidden, args.vocab, args.dtype[0], args.repeats)
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
