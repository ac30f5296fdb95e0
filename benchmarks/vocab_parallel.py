"""Benchmark: vocab-parallel log-probs + entropy (the fused op) vs the plain torch composition.

What it measures, per variant, on CPU with one thread per process, for ``--tokens`` x ``--vocab``
fp32 logits (default 4096 x 32768): forward + backward of
``(log_probs * g1 + entropy * g2).sum()`` with fixed random ``g1, g2``.

* ``time``: wall time of one forward+backward, median of ``--repeats`` runs after one warm-up.
  Every run starts with ``logits.grad = None``, so each pays for allocating (and first-touching)
  the gradient, as a training step does. ``fwd`` is the forward part of the same runs.
* ``extra peak (profiler)``: peak of live CPU bytes allocated through torch during one run,
  computed from torch.profiler's memory events (``profile_memory=True``: cumulative sum of
  allocation/free sizes in time order), minus the bytes of the logits' gradient. Tensors that
  existed before the run (the logits) are not in it. Reported as a ratio of one logits shard.
* ``extra peak (RSS)``: the process's peak resident set (``ru_maxrss``, each variant in its own
  process) minus a baseline taken after allocating and touching the logits and a gradient-sized
  tensor (then freed). Includes allocator slack and anything not allocated through torch.

Variants: ``fused`` = megatron_tepo.ops.vocab_parallel_log_probs_and_entropy (default chunk size
unless ``--chunk-size``); ``plain`` = ``lp = logits.log_softmax(-1); logp = lp.gather(-1, labels);
ent = -(lp.exp() * lp).sum(-1)``. TP=2 runs two gloo processes at once (each one thread, one
16384-vocab shard at the default size) and reports per rank: extra peak as a ratio of the shard,
time (the slower rank) vs the plain composition on the full vocabulary at TP=1 and on one shard
(the latter run alone, one process).

What it leaves out: GPUs (see the GPU mode below); bf16 logits; the model (logits are random
normal * 2); the cost of producing the logits; gloo collective latency beyond the two per call
(included in the TP=2 time); run-to-run noise from the shared machine (the median of a few
repeats only). Timings depend strongly on page-fault cost of fresh memory on this VM; ``--thp``
sets ``THP_MEM_ALLOC_ENABLE=1`` (torch's transparent-huge-page allocation) for every variant.

Usage::

    OMP_NUM_THREADS=1 python benchmarks/vocab_parallel.py [--tokens 4096] [--vocab 32768]
        [--repeats 5] [--chunk-size N] [--tp 1,2] [--thp] [--json out.json]

GPU mode (``--device cuda``)
----------------------------
One process on the current GPU, TP=1, for each shape of ``--shapes`` (default
``16384x151936,8192x151936``) in ``--dtype`` (default bf16; logits ``randn * 2``), each variant of
``--variants`` (default ``chunked,triton,compiled``):

* ``chunked``: the op with ``impl="chunked"`` (default chunk size), ``triton``: ``impl="triton"``,
  ``auto``: the op's default (what the actor runs: Triton on CUDA when it imports);
* ``compiled``: ``torch.compile`` of the plain composition in fp32
  (``lp = logits.float().log_softmax(-1)``, gather, ``-(lp.exp() * lp).sum(-1)``), ``plain``: the
  same eager (not in the default list: it keeps several fp32 ``[N, V]`` tensors).

It prints one JSON line per shape (``"kind": "bound"``: the bandwidth bound, i.e. the minimal
traffic, the logits read by forward and by backward plus the gradient written, 3x the logits'
bytes, at the copy bandwidth measured by a device-to-device ``copy_`` of a logits-sized tensor)
and one per variant (``"kind": "variant"``): ``time_ms`` (median over ``--repeats`` after two
warm-ups, which include the compilation, of forward+backward of
``(log_probs * g1 + entropy * g2).sum()``, timed with CUDA events, ``logits.grad = None`` before
each run), ``fwd_ms``, ``extra_peak_ratio`` (``torch.cuda.max_memory_allocated`` during one run,
minus what was allocated before it and minus the gradient, in units of the logits' bytes),
``x_bound`` (time over the bound) and the largest difference from the chunked variant's
log-probs, entropy and gradient (first 256 rows). A variant that runs out of memory prints its
error instead. What it leaves out: TP>1 (the collectives are the same for every variant), the
model, temperature != 1.

    python benchmarks/vocab_parallel.py --device cuda [--shapes 16384x151936,8192x151936]
        [--dtype bf16] [--variants chunked,triton,compiled] [--repeats 10] [--json out.json]
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


# --------------------------------------------------------------------------------------- worker
def _maxrss_bytes() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024   # Linux: KiB


def _profiled_peak_bytes(fn) -> int:
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    events = [e for e in prof.profiler.kineto_results.events() if e.name() == "[memory]"
              and str(e.device_type()).endswith("CPU")]
    events.sort(key=lambda e: e.start_ns())
    live = peak = 0
    for e in events:
        live += e.nbytes()
        peak = max(peak, live)
    return peak


def worker(args) -> dict:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    tp, rank = args.tp_size, args.rank
    group = None
    if tp > 1:
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{args.port}",
                                rank=rank, world_size=tp)
        group = dist.group.WORLD
    n, v_local = args.tokens, args.vocab // tp
    gen = torch.Generator().manual_seed(0)
    labels = torch.randint(0, args.vocab, (n,), generator=gen)
    g1 = torch.randn(n, generator=gen)
    g2 = torch.randn(n, generator=gen)
    gen.manual_seed(1 + rank)
    logits = (torch.randn(n, v_local, generator=gen) * 2).requires_grad_()
    shard_bytes = logits.numel() * logits.element_size()
    import torch.profiler  # noqa: F401  (imported before the RSS baseline)

    sys.path.insert(0, str(REPO))
    from megatron_tepo.ops import vocab_parallel_log_probs_and_entropy

    dummy = torch.ones_like(logits)          # touch gradient-sized memory for the RSS baseline
    base_rss = _maxrss_bytes()
    del dummy

    if args.worker == "fused":
        def forward():
            return vocab_parallel_log_probs_and_entropy(logits, labels, tp_group=group,
                                                        chunk_size=args.chunk_size)
    else:
        def forward():
            lp = logits.log_softmax(-1)
            logp = lp.gather(-1, labels[..., None]).squeeze(-1)
            ent = -(lp.exp() * lp).sum(-1)
            return logp, ent

    fwd_times = []

    def step():
        logits.grad = None
        t0 = time.perf_counter()
        logp, ent = forward()
        fwd_times.append(time.perf_counter() - t0)
        (logp * g1 + ent * g2).sum().backward()

    times = []
    for _ in range(1 + args.repeats):
        if group is not None:
            dist.barrier()
        t0 = time.perf_counter()
        step()
        times.append(time.perf_counter() - t0)
    times, fwd_times = times[1:], fwd_times[1:]
    extra_rss = _maxrss_bytes() - base_rss
    logits.grad = None
    peak = _profiled_peak_bytes(step)
    extra_prof = peak - shard_bytes           # minus the gradient, allocated inside the run
    out = {
        "variant": args.worker, "tp": tp, "rank": rank, "tokens": n, "vocab_local": v_local,
        "shard_bytes": shard_bytes, "time_s": statistics.median(times), "times_s": times,
        "fwd_s": statistics.median(fwd_times),
        "extra_peak_profiler_bytes": extra_prof, "extra_peak_rss_bytes": extra_rss,
        "extra_peak_profiler_ratio": extra_prof / shard_bytes,
        "extra_peak_rss_ratio": extra_rss / shard_bytes,
        "chunk_size": args.chunk_size,
    }
    if args.worker == "fused":
        from megatron_tepo.ops import default_chunk_size
        out["chunk_size"] = args.chunk_size or default_chunk_size(n, v_local, logits.device)
    if group is not None:
        dist.barrier()
        dist.destroy_process_group()
    return out


# --------------------------------------------------------------------------------------- driver
def _launch(args, variant: str, vocab: int, tp: int) -> list[dict]:
    env = dict(os.environ, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", CUDA_VISIBLE_DEVICES="",
               PYTHONPATH=os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]))
    if args.thp:
        env["THP_MEM_ALLOC_ENABLE"] = "1"
    sys.path.insert(0, str(REPO))
    from megatron_tepo.net import free_port

    port = free_port()
    procs = []
    for rank in range(tp):
        cmd = [sys.executable, __file__, "--worker", variant, "--tokens", str(args.tokens),
               "--vocab", str(vocab), "--repeats", str(args.repeats), "--tp-size", str(tp),
               "--rank", str(rank), "--port", str(port)]
        if args.chunk_size:
            cmd += ["--chunk-size", str(args.chunk_size)]
        procs.append(subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, text=True))
    results = []
    for p in procs:
        stdout, _ = p.communicate()
        if p.returncode != 0:
            raise SystemExit(f"worker {variant} tp={tp} failed (rc={p.returncode})")
        results.append(json.loads(stdout.strip().splitlines()[-1]))
    return results


# ----------------------------------------------------------------------------------- GPU mode
_DTYPES = {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32"}


def _plain(logits, labels):
    lp = logits.float().log_softmax(-1)
    logp = lp.gather(-1, labels[..., None]).squeeze(-1)
    ent = -(lp.exp() * lp).sum(-1)
    return logp, ent


def _variant_fn(name):
    import torch

    sys.path.insert(0, str(REPO))
    from megatron_tepo.ops import vocab_parallel_log_probs_and_entropy as op

    if name in ("chunked", "triton", "auto"):
        return lambda logits, labels: op(logits, labels, impl=name)
    if name == "plain":
        return _plain
    if name == "compiled":
        return torch.compile(_plain)
    raise SystemExit(f"unknown variant {name!r} (chunked, triton, auto, compiled, plain)")


class _Timer:
    """CUDA events on a GPU, perf_counter elsewhere (the latter only for smoke tests)."""

    def __init__(self, device):
        import torch

        self.cuda = device.type == "cuda"
        self.torch = torch

    def mark(self):
        if self.cuda:
            ev = self.torch.cuda.Event(enable_timing=True)
            ev.record()
            return ev
        return time.perf_counter()

    def ms(self, a, b):
        if self.cuda:
            self.torch.cuda.synchronize()
            return a.elapsed_time(b)
        return (b - a) * 1e3


def _copy_bandwidth(logits, timer, repeats=5) -> float:
    """Bytes/s of a device-to-device copy_ of a logits-sized tensor (read + write)."""
    dst = logits.detach().clone()
    times = []
    for _ in range(1 + repeats):
        a = timer.mark()
        dst.copy_(logits.detach())
        b = timer.mark()
        times.append(timer.ms(a, b))
    del dst
    return 2 * logits.numel() * logits.element_size() / (statistics.median(times[1:]) / 1e3)


def measure(device: str, tokens: int, vocab: int, dtype: str, variants, repeats: int,
            emit=print) -> list[dict]:
    """The GPU mode's figures for one shape (any device works; memory figures need CUDA)."""
    import torch

    dev = torch.device(device)
    timer = _Timer(dev)
    gen = torch.Generator(device=dev).manual_seed(0)
    tdt = getattr(torch, _DTYPES[dtype])
    labels = torch.randint(0, vocab, (tokens,), generator=gen, device=dev)
    g1 = torch.randn(tokens, generator=gen, device=dev)
    g2 = torch.randn(tokens, generator=gen, device=dev)
    logits = (torch.randn(tokens, vocab, generator=gen, device=dev) * 2).to(tdt).requires_grad_()
    logits_bytes = logits.numel() * logits.element_size()
    bw = _copy_bandwidth(logits, timer)
    bound_ms = 3 * logits_bytes / bw * 1e3
    head = {"tokens": tokens, "vocab": vocab, "dtype": dtype, "device": str(dev),
            "gpu": torch.cuda.get_device_name(dev) if dev.type == "cuda" else None}
    rows = [dict(head, kind="bound", logits_bytes=logits_bytes, min_traffic_bytes=3 * logits_bytes,
                 copy_bandwidth_GBps=bw / 1e9, bound_ms=bound_ms)]
    emit(json.dumps(rows[-1]))
    ref = None
    check_rows = min(tokens, 256)
    for name in variants:
        fn = _variant_fn(name)
        fwd_ms, times, peak = [], [], None
        try:
            for i in range(2 + repeats):
                logits.grad = None
                measure_mem = dev.type == "cuda" and i == 1
                if measure_mem:
                    torch.cuda.synchronize()
                    torch.cuda.reset_peak_memory_stats(dev)
                    base = torch.cuda.memory_allocated(dev)
                a = timer.mark()
                logp, ent = fn(logits, labels)
                b = timer.mark()
                (logp * g1 + ent * g2).sum().backward()
                c = timer.mark()
                if measure_mem:
                    torch.cuda.synchronize()
                    peak = torch.cuda.max_memory_allocated(dev) - base - logits_bytes
                if i >= 2:
                    fwd_ms.append(timer.ms(a, b))
                    times.append(timer.ms(a, c))
            out = {"logp": logp.detach().float(), "ent": ent.detach().float(),
                   "grad": logits.grad[:check_rows].to(torch.float32, copy=True)}
        except torch.cuda.OutOfMemoryError as e:
            rows.append(dict(head, kind="variant", variant=name, error=f"OOM: {e}".splitlines()[0]))
            emit(json.dumps(rows[-1]))
            logits.grad = None
            torch.cuda.empty_cache()
            continue
        finally:
            logits.grad = None
        if ref is None and name == "chunked":
            ref = out
        diff = ({k: (out[k] - ref[k]).abs().max().item() for k in out}
                if ref is not None and name != "chunked" else None)
        t = statistics.median(times)
        rows.append(dict(head, kind="variant", variant=name, time_ms=t,
                         fwd_ms=statistics.median(fwd_ms), times_ms=times,
                         extra_peak_bytes=peak,
                         extra_peak_ratio=None if peak is None else peak / logits_bytes,
                         x_bound=t / bound_ms, max_abs_diff_vs_chunked=diff))
        emit(json.dumps(rows[-1]))
        del out, logp, ent, fn
        if dev.type == "cuda":
            torch.cuda.empty_cache()
    return rows


def gpu_main(args) -> list[dict]:
    import torch

    if args.device.startswith("cuda") and not torch.cuda.is_available():
        raise SystemExit("--device cuda: no CUDA device is available")
    variants = [v for v in args.variants.split(",") if v]
    rows = []
    for shape in args.shapes.split(","):
        tokens, vocab = (int(s) for s in shape.lower().split("x"))
        rows += measure(args.device, tokens, vocab, args.dtype, variants, args.repeats)
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))
    return rows


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("--vocab", type=int, default=32768, help="full vocabulary size")
    ap.add_argument("--repeats", type=int, default=None, help="default 5 (CPU), 10 (GPU mode)")
    ap.add_argument("--chunk-size", type=int, default=None)
    ap.add_argument("--tp", default="1,2", help="comma-separated TP sizes to run")
    ap.add_argument("--thp", action="store_true", help="set THP_MEM_ALLOC_ENABLE=1")
    ap.add_argument("--json", default=None, help="write all figures here")
    ap.add_argument("--device", default="cpu",
                    help="cpu (default: the multi-process CPU benchmark above) or cuda (GPU mode)")
    ap.add_argument("--shapes", default="16384x151936,8192x151936",
                    help="GPU mode: comma-separated TOKENSxVOCAB")
    ap.add_argument("--dtype", default="bf16", choices=sorted(_DTYPES),
                    help="GPU mode: the logits' dtype")
    ap.add_argument("--variants", default="chunked,triton,compiled",
                    help="GPU mode: comma-separated of chunked, triton, auto, compiled, plain")
    ap.add_argument("--worker", choices=["fused", "plain"], help=argparse.SUPPRESS)
    ap.add_argument("--tp-size", type=int, default=1, help=argparse.SUPPRESS)
    ap.add_argument("--rank", type=int, default=0, help=argparse.SUPPRESS)
    ap.add_argument("--port", type=int, default=0, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.repeats is None:
        args.repeats = 5 if args.device == "cpu" else 10
    if args.device != "cpu" and not args.worker:
        return {"rows": gpu_main(args)}
    if args.worker:
        print(json.dumps(worker(args)))
        return {}
    tps = [int(t) for t in args.tp.split(",") if t]
    for t in tps:
        if args.vocab % t:
            raise SystemExit(f"--vocab {args.vocab} is not divisible by TP={t}")

    plain_full = _launch(args, "plain", args.vocab, 1)[0]
    rows = [("plain", 1, plain_full, None)]
    fig = {"command": " ".join(["OMP_NUM_THREADS=1", "python", "benchmarks/vocab_parallel.py",
                                *sys.argv[1:]]),
           "tokens": args.tokens, "vocab": args.vocab, "repeats": args.repeats, "thp": args.thp,
           "plain_tp1": plain_full, "fused": {}, "plain_shard": {}}
    for t in tps:
        fused = _launch(args, "fused", args.vocab, t)
        fig["fused"][t] = fused
        if t > 1:
            shard = _launch(args, "plain", args.vocab // t, 1)[0]
            fig["plain_shard"][t] = shard
            rows.append((f"plain (one {args.vocab // t}-vocab shard, alone)", 1, shard, shard))
        for r in fused:
            rows.append(("fused", t, r, fig["plain_shard"].get(t)))

    head = (f"{args.tokens} tokens x {args.vocab} vocab, fp32, 1 thread/process, fwd+bwd of "
            f"(log_probs*g1 + entropy*g2).sum(), median of {args.repeats}"
            + (", THP_MEM_ALLOC_ENABLE=1" if args.thp else ""))
    lines = [head, "",
             "| variant | TP | rank | chunk | time (s) | fwd (s) | time / plain TP=1 | "
             "time / plain on shard | extra peak / shard (profiler) | extra peak / shard (RSS) |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for name, t, r, shard_ref in rows:
        slowest = max(x["time_s"] for x in fig["fused"][t]) if name == "fused" else r["time_s"]
        vs_shard = f"{slowest / shard_ref['time_s']:.2f}x" if shard_ref is not None else "-"
        lines.append(
            f"| {name} | {t} | {r['rank']} | {r['chunk_size'] or '-'} | {r['time_s']:.3f} | "
            f"{r['fwd_s']:.3f} | {slowest / plain_full['time_s']:.2f}x | {vs_shard} | "
            f"{r['extra_peak_profiler_ratio']:.3f}x | {r['extra_peak_rss_ratio']:.3f}x |")
    lines.append("")
    lines.append("time / plain uses the slower rank's time for TP>1. Extra peak is beyond the "
                 "logits and their gradient, as a ratio of one logits shard (the full logits "
                 "at TP=1).")
    table = "\n".join(lines)
    print(table)
    fig["table"] = table
    if args.json:
        Path(args.json).write_text(json.dumps(fig, indent=1))
    return fig


if __name__ == "__main__":
    main()
