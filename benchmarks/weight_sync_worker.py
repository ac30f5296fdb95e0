"""torchrun worker of ``benchmarks/weight_sync.py`` (2 gloo ranks, a MegatronActor at TP=2).

argv[1]: JSON {"model_dir", "urls", "keys", "modes", "bucket_mib", "repeats", "wire_dtype",
"shared_dir", "baseline_repeats"}. Rank 0 writes its measurements with ``write_result``.

Per bucket size, two plain copies of the same total bytes in the same bucket sizes (the gloo one
is also run right before every timed push, for a paired ratio):
  * ``memcpy``: rank 0 copies a bucket-sized uint8 tensor into a preallocated one, until the
    model's wire bytes are copied (in-process, hot memory);
  * ``gloo``: rank 0 broadcasts bucket-sized uint8 tensors to rank 1 over a gloo group of the two
    local processes (loopback TCP, the transport of ``distributed`` on CPU), timed on rank 0 from
    a barrier to a barrier after the last broadcast.
Per mode and bucket size: one warm-up push (it creates the ``distributed`` update group), then
``repeats`` timed pushes of ``actor.export_hf_state("param")`` (the bucketed export: bf16 cast
before one gather per bucket to rank 0). For each: end to end (``SyncStats.seconds``: from before
the first bucket is gathered to the servers' answer to ``/end_weight_update``, or to
``/update_weights_from_disk`` in disk mode; no ``/flush_cache``), the time rank 0 waited for the
export to produce buckets (``SyncStats.export_seconds``), the time inside the per-bucket push
calls, and the sender's peak RSS above its RSS just before the push (sampled every 2 ms by a
thread; after the warm-up push it is ~0, since the sync keeps its buffers: the buffers it holds
are reported, and the warm-up push's RSS delta). ``sender-only`` passes per bucket size (median of
``baseline_repeats``), no server: the bucketed export gathered to rank 0 as the sync consumes it
(buffers kept from the previous pass, as the sync keeps them; and ``cold``, allocated per pass),
and the per-tensor path it replaced (``megatron_to_hf(gather_full_tensors(...))``: an all-gather per tensor, then the cast
and the flatten copy), for comparison. And per mode and bucket size, ``repeats`` pushes of the
same buckets exported beforehand (``server_only``): the transport and the server by themselves,
the ceiling of the end-to-end figure.
"""
import gc
import json
import os
import sys
import threading
import time

os.environ.setdefault("OMP_NUM_THREADS", "1")

import torch
import torch.distributed as dist

from megatron_tepo.buckets import BucketStream
from tests.dist_utils import write_result

MiB = 1 << 20
_PAGE = os.sysconf("SC_PAGE_SIZE")


def rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * _PAGE


class RssPeak:
    """Peak RSS above the RSS at entry, sampled by a thread."""

    def __init__(self, every: float = 0.002):
        self.every, self.peak, self._stop = every, 0, threading.Event()

    def _run(self):
        while not self._stop.is_set():
            self.peak = max(self.peak, rss())
            time.sleep(self.every)

    def __enter__(self):
        gc.collect()
        self.base = self.peak = rss()
        self._t = threading.Thread(target=self._run, daemon=True)
        self._t.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._t.join()
        self.peak = max(self.peak, rss())
        self.delta = self.peak - self.base


class Precomputed(BucketStream):
    """Buckets exported beforehand, handed to ``WeightSync.push`` as if they were the export."""

    def __init__(self, buckets):
        self.buckets = buckets

    def flat_buckets(self, bucket_bytes=None, dtype=None, dst=None, reuse=False, buffers=None):
        return iter(self.buckets)


def chunks(total: int, bucket: int):
    n, rem = divmod(total, bucket)
    return [bucket] * n + ([rem] if rem else [])


def main():
    args = json.loads(sys.argv[1])
    from megatron_tepo.actor.actor import MegatronActor
    from megatron_tepo.layout import ParallelLayout
    from megatron_tepo.rollout.sglang.fleet import FleetConfig, SGLangFleet
    from megatron_tepo.models import megatron_to_hf
    from megatron_tepo.buckets import ExportBuffers, flatten_bucket, iter_buckets, tensor_bytes
    from megatron_tepo.megatron.sharding import gather_full_tensors
    from megatron_tepo.rollout.sglang.weight_sync import SYNC_MODES

    class Timed:
        """A mode's sync that adds up the seconds its bucket sends take (``push_s``)."""
        push_s = 0.0

        def _send(self, bucket, servers):
            t = time.perf_counter()
            super()._send(bucket, servers)
            self.push_s += time.perf_counter() - t

    # (disk's file writes are not counted as push calls: docs/BENCHMARKS.md)
    timed = {mode: cls if mode == "disk" else type(f"Timed{cls.__name__}", (Timed, cls), {})
             for mode, cls in SYNC_MODES.items()}

    wire = {"bf16": torch.bfloat16, "fp32": torch.float32}[args["wire_dtype"]]
    t0 = time.perf_counter()
    actor = MegatronActor(args["model_dir"], hf_weights=args["model_dir"], layout=ParallelLayout(tp=2, pp=1),
                          precision="fp32")
    rank = dist.get_rank()
    build_s = time.perf_counter() - t0
    fleet = SGLangFleet(FleetConfig(urls=args["urls"], api_keys=args["keys"], request_timeout=600)) \
        if rank == 0 else None
    res = {"build_actor_s": build_s, "baselines": {}, "sender_only": {}, "runs": [], "server_only": [],
           "rss_after_build": rss()}

    # the model's wire bytes and tensor count (one export pass, also a warm-up of the gather)
    total, ntensors = 0, 0
    for b in actor.export_hf_state("param").flat_buckets(64 * MiB, dtype=wire, dst=0, reuse=True):
        total += b.nbytes
        ntensors += len(b.names)
    if rank == 0:
        with torch.no_grad():  # the count travels to rank 1 (the copies below need it)
            tot = torch.tensor([total, ntensors])
    else:
        tot = torch.zeros(2, dtype=torch.int64)
    dist.broadcast(tot, src=0)
    total, ntensors = int(tot[0]), int(tot[1])
    res["wire_bytes"], res["tensors"] = total, ntensors
    gloo = dist.new_group(backend="gloo")
    gloo_buf = torch.ones(total, dtype=torch.uint8)  # (every bucket size's copies: distinct memory)
    dist.broadcast(gloo_buf[:1024], src=0, group=gloo)

    def gloo_copy(sizes):
        """Seconds of a gloo broadcast of ``sizes`` bytes, rank 0 -> rank 1, barrier to barrier."""
        dist.barrier(group=gloo)
        t = time.perf_counter()
        o = 0
        for n in sizes:
            dist.broadcast(gloo_buf[o:o + n], src=0, group=gloo)
            o += n
        dist.barrier(group=gloo)
        return time.perf_counter() - t

    for mib in args["bucket_mib"]:
        bb = mib * MiB
        sizes = chunks(total, bb)
        # ---- plain copy 1: memcpy on rank 0
        dist.barrier()
        if rank == 0:
            src = torch.ones(min(bb, total), dtype=torch.uint8)
            dst = torch.empty_like(src)
            dst.copy_(src)
            best = []
            for _ in range(args["baseline_repeats"]):
                t = time.perf_counter()
                for n in sizes:
                    dst[:n].copy_(src[:n])
                best.append(time.perf_counter() - t)
            res["baselines"].setdefault(mib, {})["memcpy_s"] = sorted(best)[len(best) // 2]
            del src, dst
        # ---- plain copy 2: gloo broadcast rank 0 -> rank 1 (two local processes)
        times = [gloo_copy(sizes) for _ in range(args["baseline_repeats"])]
        if rank == 0:
            res["baselines"][mib]["gloo_bcast_s"] = sorted(times)[len(times) // 2]
        # ---- the sender alone, no server: (a) the bucketed export gathered to rank 0 (what the
        # sync runs); (b) the per-tensor path it replaced: all-gather per tensor, HF mapping, cast,
        # bucket, flatten copy
        keep = ExportBuffers()  # kept across the passes, as WeightSync keeps them across pushes

        def bucketed(buffers=keep):
            nb = 0
            for b in actor.export_hf_state("param").flat_buckets(bb, dtype=wire, dst=0, reuse=True,
                                                                 buffers=buffers):
                nb += b.nbytes
            return nb

        def bucketed_cold():
            return bucketed(None)

        def per_tensor():
            nb = 0
            for bucket in iter_buckets(megatron_to_hf(gather_full_tensors(actor.model), actor.family_cfg),
                                       bb, wire, align=True):
                flat = flatten_bucket(bucket) if rank == 0 else None
                nb += sum(tensor_bytes(x) for _, x in bucket)
                del bucket, flat
            return nb

        bucketed()  # fills ``keep``
        for key, fn in (("sender_only", bucketed), ("sender_only_cold", bucketed_cold),
                        ("sender_only_per_tensor", per_tensor)):
            secs, deltas = [], []
            for _ in range(args["baseline_repeats"]):
                dist.barrier()
                with RssPeak() as mem:
                    t = time.perf_counter()
                    nb = fn()
                    secs.append(time.perf_counter() - t)
                deltas.append(mem.delta)
            if rank == 0:
                res.setdefault(key, {})[mib] = {"seconds": sorted(secs)[len(secs) // 2], "all_s": secs,
                                                "bytes": nb, "rss_delta": max(deltas)}
        keep.close()

    for mode in args["modes"]:
        for mib in args["bucket_mib"]:
            dist.barrier()
            own = {"shared_dir": args["shared_dir"]} if mode == "disk" else {}
            ws = timed[mode](fleet, bucket_bytes=mib * MiB, wire_dtype=wire, is_sender=rank == 0, timeout=600, **own)
            try:
                for rep in range(1 + args["repeats"]):
                    # the plain copy right before each push, so the two see the same machine
                    gloo_s = gloo_copy(chunks(total, mib * MiB))
                    dist.barrier()
                    ws.push_s = 0.0
                    with RssPeak() as mem:
                        stats = ws.push(actor.export_hf_state("param"), flush_cache=False)
                    if rep == 0:
                        first_delta = mem.delta
                    if rank == 0 and rep > 0:
                        assert stats.bucketed_export
                        res["runs"].append({"mode": mode, "bucket_mib": mib, "rep": rep, "seconds": stats.seconds,
                                            "bytes": stats.bytes, "buckets": stats.buckets,
                                            "tensors": stats.tensors, "gather_s": stats.export_seconds,
                                            "push_s": ws.push_s, "rss_delta": mem.delta, "gloo_s": gloo_s,
                                            "first_push_rss_delta": first_delta,
                                            "held_bytes": ws._export_buffers.nbytes,
                                            "peak_bucket_bytes": stats.peak_bucket_bytes})
                        print(f"[rank0] {mode} {mib} MiB rep {rep}: {stats.seconds:.2f} s "
                              f"{stats.bytes / stats.seconds / 1e6:.0f} MB/s gather {stats.export_seconds:.2f} s "
                              f"rss +{mem.delta / MiB:.0f} MiB", flush=True)
                # the same buckets, exported once beforehand: the transport and the server alone
                dist.barrier()
                ready = list(actor.export_hf_state("param").flat_buckets(mib * MiB, dtype=wire, dst=0))
                if rank == 0:
                    for rep in range(args["repeats"]):
                        stats = ws.push(Precomputed(ready), flush_cache=False)
                        res["server_only"].append({"mode": mode, "bucket_mib": mib, "seconds": stats.seconds,
                                                   "bytes": stats.bytes})
                del ready
            finally:
                ws.close()
    dist.barrier()
    if rank == 0:
        write_result(res)


if __name__ == "__main__":
    main()
