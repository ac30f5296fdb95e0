"""Megatron -> rollout engine weight sync, bucketed, in three modes.

Input: :meth:`MegatronActor.export_hf_state` (a lazy :class:`~megatron_tepo.actor.export.HFExport`), or
any iterator of ``(HF name, full tensor)``. Only the *sender* (global rank 0 by default,
``sender_rank``) talks to the servers; every rank of the actor calls :meth:`WeightSync.push`, the
others just drain the export, which is collective.

With the actor's export (a :class:`~megatron_tepo.buckets.BucketStream`) the sync asks it for flat
buckets (``HFExport.flat_buckets``): per bucket of at most ``bucket_bytes`` each TP rank casts its shards to ``wire_dtype`` (before anything
moves: half the bytes of an fp32 actor for a bf16 server), the other TP ranks send theirs point
to point into the sender's receive buffer (the sender casts its own in place; MoE with expert
parallelism: each EP rank's experts follow the same way, so every expert is sent under its global
index; PP > 1: each stage's buckets are built on the stage and sent on to the sender), and the
HF tensors -- fused QKV / gate-up split, row-parallel shards interleaved -- are copied once from
the received shards into the bucket's flat buffer, which is what goes on the wire (no flatten
copy). TP ranks on the sender's host, on CPU, skip the transfer: each casts its shards straight
into a shared-memory bucket. The buffers are reused from one bucket to the next and kept from one
push to the next (``keep_buffers``), so the sender's extra memory is about two buckets (received
shards + the flat bucket, or two alternating shared buckets; ``tensor`` mode adds its
shared-memory copy), not the model; bucket boundaries never split a tensor (one larger than
``bucket_bytes`` goes alone). Every rank must call :meth:`WeightSync.push` -- a rank
that iterated the export itself would all-gather while the sender gathers, and hang.
Any other stream is cast and flattened here into one reused buffer.

Modes (SGLang HTTP API, 0.5.6 to 0.5.x; tested with 0.5.23). Where the server has them (recent
versions), every weight load sits inside ``/begin_weight_update`` ... ``/end_weight_update``; each
server is probed once -- its first ``/begin_weight_update`` -- and one that answers 404 is updated
without the two from then on.

``distributed``  a process group between the sender (rank 0) and every TP worker of every server
                 (``/init_weights_update_group``; gloo on CPU, nccl on GPU). SGLang gives worker
                 ``r`` of a server the rank ``rank_offset + r``, so the offsets are cumulative:
                 server i gets ``1 + sum(tp_size of servers < i)`` and the world is
                 ``1 + sum(tp_size)``. A server's TP size is known when the fleet launched it
                 (``FleetConfig.tp``) and asked of it otherwise (``/server_info``: ``tp_size``).
                 Per bucket one ``/update_weights_from_distributed`` with
                 ``load_format="flattened_bucket"`` and one broadcast of the bucket's bytes; the
                 request is answered once the servers have received and loaded the bucket.
                 Ordering: request k+1 goes out only once every server answered request k. The
                 bucket sizes a server receives come from the requests, in the order its update
                 handler takes them; two bucket requests in flight at once may be taken in either
                 order (two HTTP connections), and a server that takes k+1 first posts a receive
                 of the wrong size (a hang, or bytes loaded under the wrong names). The completion
                 of broadcast k does not rule that out: on gloo ``work.wait()`` returns once the
                 servers received bucket k, but on NCCL it only orders CUDA streams and the CPU
                 goes on at once. The answer is the one signal that holds on every backend. What
                 still overlaps: the sender does not wait for request k's answer before building
                 bucket k+1 (the actor's gather), so the servers' load of bucket k runs during
                 the next gather; only the request's round trip is serial.
``tensor``       per bucket ``/update_weights_from_tensor`` with ``load_format="flattened_bucket"``:
                 the bucket copied into one shared-memory buffer, serialised by ``ForkingPickler``
                 with its layout, one entry of ``serialized_named_tensors`` per TP rank of the
                 server (its worker r reads entry r). The engine must be on the same host.
``disk``         per bucket one safetensors file in ``shared_dir`` (a file system the servers
                 see; the flat bucket is written as the file's data section as it is; a bucket on
                 a GPU goes through one reused host buffer, pinned), then one
                 ``/update_weights_from_disk``.

Left out: servers with data or pipeline parallelism (SGLang refuses these updates at dp > 1),
and tensor mode across hosts.
"""
from __future__ import annotations

import base64
import io
import logging
import math
import os
import shutil
import tempfile
import threading
import time
from dataclasses import dataclass
from datetime import timedelta
from typing import Dict, Iterable, Iterator, List, Optional, Tuple

import torch

from megatron_tepo.buckets import (BucketHandoff, BucketStream, ExportBuffers, FlatBucket, dtype_name, iter_buckets,
                                   tensor_bytes, to_flat_bucket, write_safetensors)
from megatron_tepo.rollout.net import free_port

log = logging.getLogger(__name__)

MODES = ("distributed", "tensor", "disk")
# the weight-update session of recent SGLang (0.5.23 has it, 0.5.6 not); older versions load without one
SESSION_ROUTES = ("/begin_weight_update", "/end_weight_update")
NamedTensors = Iterable[Tuple[str, torch.Tensor]]


def init_custom_process_group(backend: str, init_method: str, world_size: int, rank: int,
                              group_name: str, timeout: Optional[timedelta] = None):
    """A process group outside the default one (the trainer's own group is untouched).

    The same construction as ``sglang.srt.utils.init_custom_process_group`` (which the servers use
    on their side, joining ``init_method`` as clients): a TCP store, a ``PrefixStore(group_name)``,
    ``_new_process_group_helper``. Rank 0 (the sender) hosts the TCP store itself: torch's
    ``rendezvous()`` would, under torchrun (``TORCHELASTIC_USE_AGENT_STORE=True``), connect as a
    client to the elastic agent's store instead and wait forever.
    """
    from urllib.parse import urlparse

    from torch.distributed import TCPStore
    from torch.distributed.distributed_c10d import (Backend, PrefixStore, _new_process_group_helper,
                                                    _world, default_pg_timeout)

    timeout = timeout or default_pg_timeout
    u = urlparse(init_method)
    if u.scheme != "tcp":
        raise ValueError(f"init_method must be tcp://host:port, got {init_method}")
    store = TCPStore(u.hostname, u.port, world_size, is_master=rank == 0, timeout=timeout,
                     wait_for_workers=False)
    store = PrefixStore(group_name, store)
    pg, _ = _new_process_group_helper(world_size, rank, [], Backend(backend), store,
                                      group_name=group_name, backend_options=None, timeout=timeout)
    _world.pg_group_ranks[pg] = {i: i for i in range(world_size)}
    return pg


def _dist_rank() -> Optional[int]:
    import torch.distributed as dist

    return dist.get_rank() if dist.is_available() and dist.is_initialized() else None


@dataclass
class SyncStats:
    mode: str
    bytes: int = 0
    tensors: int = 0
    buckets: int = 0
    seconds: float = 0.0
    peak_bucket_bytes: int = 0
    export_seconds: float = 0.0  # of ``seconds``: waiting for the export to produce the buckets
    bucketed_export: bool = False  # True: the export's own flat buckets (gathered to the sender)

    @property
    def bytes_per_s(self) -> float:
        return self.bytes / self.seconds if self.seconds > 0 else float("nan")


class WeightSync:
    """Pushes ``(HF name, tensor)`` streams to every live server of a fleet.

    ``target``: an :class:`~megatron_tepo.rollout.sglang_fleet.SGLangFleet` (or anything with
    ``alive_servers()``). ``wire_dtype``: cast before sending (e.g. ``torch.bfloat16`` for a bf16
    server; halves the bytes of a float32 actor); ``None`` sends as exported. ``sender_rank``:
    the global rank that talks to the servers (``is_sender`` defaults to being it; when
    torch.distributed is up the two must agree, since the bucketed export gathers to that rank).
    ``keep_buffers``: keep the export's bucket buffers from one push to the next (about two buckets
    per rank, held between pushes; on CPU faulting fresh buffers in costs about as much as filling
    them); False frees them after every push.
    """

    def __init__(self, target, mode: str = "distributed", bucket_bytes: int = 256 << 20,
                 wire_dtype: Optional[torch.dtype] = None, backend: Optional[str] = None,
                 master_address: str = "127.0.0.1", master_port: Optional[int] = None,
                 shared_dir: Optional[str] = None, is_sender: Optional[bool] = None,
                 timeout: float = 600.0, group_name: str = "mtepo_weight_sync", sender_rank: int = 0,
                 keep_buffers: bool = True):
        if mode not in MODES:
            raise ValueError(f"unknown weight sync mode {mode!r}; choose one of {MODES}")
        self.target, self.mode, self.bucket_bytes, self.wire_dtype = target, mode, bucket_bytes, wire_dtype
        self.backend = backend or ("nccl" if torch.cuda.is_available() else "gloo")
        self.master_address, self.master_port = master_address, master_port
        self.shared_dir = shared_dir
        rank = _dist_rank()
        self.sender_rank = sender_rank
        self.is_sender = (rank is None or rank == sender_rank) if is_sender is None else bool(is_sender)
        if rank is not None and self.is_sender != (rank == sender_rank):
            raise ValueError(f"weight sync: is_sender={self.is_sender} on global rank {rank} but "
                             f"sender_rank={sender_rank} (pass sender_rank=<the sending rank>)")
        self.timeout = timeout
        self.group_name = group_name
        self._pg = None
        self._pg_servers: Tuple[str, ...] = ()
        self._pending = None  # the last bucket's requests, until every server answered them
        self._bcast = None  # the last bucket's broadcast, until it completes
        self._lacks: Dict[str, set] = {}  # per server URL: the optional routes it answered 404 to
        self._staging: Optional[torch.Tensor] = None  # disk mode: host copy of a device bucket
        self._version = 0
        self.last_stats: Optional[SyncStats] = None
        # the export's bucket buffers, kept from one push to the next (see ExportBuffers)
        self._export_buffers = ExportBuffers() if keep_buffers else None

    # ------------------------------------------------------------------ helpers
    def _servers(self):
        servers = self.target.alive_servers()
        if not servers:
            raise RuntimeError("weight sync: no live server")
        return servers

    def _tp_size(self, s) -> int:
        """A server's TP size: known (a server the fleet launched), or asked of the server once
        (``SGLangServer.resolve_tp_size``: ``/server_info``)."""
        resolve = getattr(s, "resolve_tp_size", None)
        tp = resolve(self.timeout) if callable(resolve) else getattr(s, "tp_size", None)
        if isinstance(tp, bool) or not isinstance(tp, int) or tp < 1:
            raise ValueError(f"weight sync: server {getattr(s, 'url', s)} has tp_size {tp!r}; "
                             "expected an integer >= 1")
        return tp

    def _post_all(self, path: str, payload: Optional[dict] = None, servers=None, optional: bool = False) -> None:
        """POST to every server concurrently; any failure is an error naming the server."""
        threads, errors = self._start_all(path, payload or {}, servers or self._servers(), optional)
        self._join(threads, errors, path)

    def _start_all(self, path: str, payload: dict, servers,
                   optional: bool = False) -> Tuple[List[threading.Thread], Dict]:
        """POST ``path`` to each server in its own thread. ``optional``: a route some SGLang
        versions lack -- a server that answers 404 is remembered without it and skipped from then
        on (a server without ``/begin_weight_update`` gets no ``/end_weight_update`` either)."""
        errors: Dict[str, str] = {}
        if optional:
            servers = [s for s in servers if path not in self._lacks.get(s.url, ())]

        def call(s):
            try:
                out = s.post(path, payload, timeout=self.timeout)
                if isinstance(out, dict) and out.get("success") is False:
                    errors[s.url] = str(out.get("message"))
            except Exception as e:  # noqa: BLE001
                if optional and getattr(e, "status", None) == 404:
                    lacks = SESSION_ROUTES if path in SESSION_ROUTES else (path,)
                    self._lacks.setdefault(s.url, set()).update(lacks)
                    log.info("weight sync: %s has no %s (an older SGLang): updating it without %s",
                             s.url, path, " / ".join(lacks))
                    return
                errors[s.url] = str(e)

        threads = [threading.Thread(target=call, args=(s,), daemon=True) for s in servers]
        for t in threads:
            t.start()
        return threads, errors

    @staticmethod
    def _join(threads, errors, what: str) -> None:
        for t in threads:
            t.join()
        if errors:
            raise RuntimeError(f"weight sync {what} failed: {errors}")

    # ------------------------------------------------------------------ distributed
    def _ensure_group(self, servers) -> None:
        urls = tuple(s.url for s in servers)
        if self._pg is not None and urls == self._pg_servers:
            return
        tp = [self._tp_size(s) for s in servers]  # each TP worker of a server joins the group
        self._destroy_group()
        port = self.master_port or free_port(self.master_address)
        world = 1 + sum(tp)
        offsets = [1 + sum(tp[:i]) for i in range(len(servers))]
        errs: List[Dict[str, str]] = []
        threads = []
        for s, off in zip(servers, offsets):
            payload = {"master_address": self.master_address, "master_port": port, "rank_offset": off,
                       "world_size": world, "group_name": self.group_name, "backend": self.backend}
            th, err = self._start_all("/init_weights_update_group", payload, [s])
            threads += th
            errs.append(err)
        pg = init_custom_process_group(self.backend, f"tcp://{self.master_address}:{port}", world, 0,
                                       self.group_name, timeout=timedelta(seconds=self.timeout))
        for t in threads:
            t.join()
        errors = {k: v for e in errs for k, v in e.items()}
        if errors:
            raise RuntimeError(f"weight sync: /init_weights_update_group failed: {errors}")
        self._pg, self._pg_servers = pg, urls

    def _destroy_group(self) -> None:
        if self._pg is None:
            return
        try:
            servers = [s for s in self.target.alive_servers() if s.url in self._pg_servers]
            self._post_all("/destroy_weights_update_group", {"group_name": self.group_name}, servers or None)
        except Exception as e:  # noqa: BLE001 -- best effort on the way out
            log.warning("weight sync: destroying the update group failed: %s", e)
        try:
            torch.distributed.destroy_process_group(self._pg)
        except Exception:  # noqa: BLE001
            pass
        self._pg, self._pg_servers = None, ()

    def _push_distributed(self, bucket: FlatBucket, servers) -> None:
        """One request + one asynchronous broadcast, sent once every server answered the previous
        bucket's request (see the module docstring: on NCCL nothing else tells the sender that a
        server took request k before request k+1 arrives). The sender does not wait for this
        bucket's answer: it builds the next bucket meanwhile (the bucket's ``release`` makes the
        export wait for the broadcast before it reuses the buffer)."""
        self._wait_pending()  # request k-1 answered: the servers loaded bucket k-1
        self._wait_broadcast()
        payload = {"names": list(bucket.names), "dtypes": [dtype_name(d) for d in bucket.dtypes],
                   "shapes": [list(sh) for sh in bucket.shapes], "group_name": self.group_name,
                   "load_format": "flattened_bucket", "flush_cache": False}
        threads, errors = self._start_all("/update_weights_from_distributed", payload, servers)
        self._bcast = torch.distributed.broadcast(bucket.flat, src=0, group=self._pg, async_op=True)
        bucket.release = self._wait_broadcast
        self._pending = (threads, errors)

    def _wait_broadcast(self) -> None:
        work, self._bcast = self._bcast, None
        if work is not None:
            work.wait()

    def _wait_pending(self) -> None:
        pending, self._pending = self._pending, None
        if pending is not None:
            self._join(*pending, "/update_weights_from_distributed")

    # ------------------------------------------------------------------ tensor
    def _push_tensor(self, bucket: FlatBucket, servers) -> None:
        """The bucket's bytes in one shared-memory buffer and its layout,
        ``load_format="flattened_bucket"``; all servers load it concurrently."""
        from multiprocessing.reduction import ForkingPickler
        from types import SimpleNamespace

        import torch.multiprocessing  # noqa: F401 -- registers the tensor reductions

        # (SimpleNamespace: a type SGLang's restricted unpickler admits, read by attribute)
        meta = [SimpleNamespace(name=n, shape=tuple(sh), dtype=d, start_idx=o, numel=math.prod(sh) * d.itemsize,
                                end_idx=o + math.prod(sh) * d.itemsize)
                for n, d, sh, o in zip(bucket.names, bucket.dtypes, bucket.shapes, bucket.offsets)]
        # file_system: the tensor's shared memory is named, so an unrelated process can map it
        # (both for allocating it and for pickling its handle)
        old = torch.multiprocessing.get_sharing_strategy()
        torch.multiprocessing.set_sharing_strategy("file_system")
        try:
            # (one per bucket: a reused one is unlinked once the server lets go of its mapping)
            shm = torch.empty(bucket.nbytes, dtype=torch.uint8).share_memory_()
            shm.copy_(bucket.flat)
            buf = io.BytesIO()
            ForkingPickler(buf).dump({"flattened_tensor": shm, "metadata": meta})
            data = base64.b64encode(buf.getvalue()).decode()
        finally:
            torch.multiprocessing.set_sharing_strategy(old)
        threads, errs = [], []
        for s in servers:
            # SGLang's TP worker r deserialises entry r (``deserialize_own_rank``): one per rank
            tp = self._tp_size(s)
            th, err = self._start_all("/update_weights_from_tensor",
                                      {"serialized_named_tensors": [data] * tp, "load_format": "flattened_bucket",
                                       "flush_cache": False}, [s])
            threads += th
            errs.append(err)
        for t in threads:
            t.join()
        del shm
        errors = {k: v for e in errs for k, v in e.items()}
        if errors:
            raise RuntimeError(f"weight sync /update_weights_from_tensor failed: {errors}")

    # ------------------------------------------------------------------ disk
    def _disk_dir(self) -> str:
        root = self.shared_dir or os.environ.get("MTEPO_WEIGHT_SYNC_DIR") or tempfile.gettempdir()
        path = os.path.join(root, f"mtepo_weights_v{self._version}_{os.getpid()}")
        shutil.rmtree(path, ignore_errors=True)
        os.makedirs(path)
        return path

    # ------------------------------------------------------------------ public
    def _buckets(self, named_tensors, stats: SyncStats) -> Iterator[FlatBucket]:
        """The stream as flat buckets. A :class:`~megatron_tepo.buckets.BucketStream` (the actor's
        export, :class:`~megatron_tepo.actor.export.HFExport`) is asked for buckets gathered to the sender, cast
        to the wire dtype before its collectives, in reused buffers; any other stream of
        ``(name, tensor)`` is cast and flattened here into one reused buffer. A bucket may still be
        on the wire when the next is asked for: its ``release`` (set by the push) must be called
        before its buffer is written again (both paths do, with a ``BucketHandoff``)."""
        if isinstance(named_tensors, BucketStream):
            stats.bucketed_export = True
            dst = self.sender_rank if _dist_rank() is not None else None
            kw = {"buffers": self._export_buffers} if self._export_buffers is not None else {}
            return named_tensors.flat_buckets(self.bucket_bytes, dtype=self.wire_dtype, dst=dst, reuse=True, **kw)
        if not self.is_sender:  # a plain stream: nothing to send from this rank, just drain it
            return (None for _ in named_tensors)

        def flatten_each():
            out, handoff = None, BucketHandoff()
            for bucket in iter_buckets(named_tensors, self.bucket_bytes, self.wire_dtype,
                                       align=self.mode == "distributed"):
                handoff.settle()  # the previous bucket's send is done with ``out``
                total = sum(tensor_bytes(t) for _, t in bucket)
                if out is None or out.numel() < total:
                    out = None
                    out = torch.empty(max(total, min(self.bucket_bytes, 1 << 30)), dtype=torch.uint8)
                fb = to_flat_bucket(bucket, out)
                del bucket
                yield handoff.give(fb)
        return flatten_each()

    def push(self, named_tensors: NamedTensors, flush_cache: bool = True) -> SyncStats:
        """Send the stream to every live server; on non-sender ranks just drain it (collective).

        Takes ``actor.export_hf_state()`` (bucketed, gathered to the sender only) or any iterable
        of ``(HF name, tensor)``. The servers are paused first with every request they still run
        aborted (``/pause_generation``, mode abort: a request that timed out on our side and was
        retried elsewhere may still be running, and a server refuses to flush its cache then),
        and always continue afterwards; a flush still refused while the aborts settle is retried."""
        stats = SyncStats(self.mode)
        if not self.is_sender:
            for _ in self._buckets(named_tensors, stats):
                pass
            return stats
        t0 = time.perf_counter()
        servers = self._servers()
        self._version += 1
        disk_dir = self._disk_dir() if self.mode == "disk" else None
        files: List[str] = []
        if self.mode == "distributed":
            self._ensure_group(servers)
        # A request may still run on a server (one that timed out on our side and was retried on
        # another): the update's cache flush would be refused. Abort whatever runs and hold new
        # requests until the update is in (continue_generation below, whatever happens).
        self._post_all("/pause_generation", {"mode": "abort"}, servers)
        try:
            self._push_paused(named_tensors, stats, servers, disk_dir, files, flush_cache)
        finally:
            self._post_all("/continue_generation", {}, servers)
        stats.seconds = time.perf_counter() - t0
        self.last_stats = stats
        log.info("weight sync (%s): %d tensors, %.1f MB in %d buckets, %.2f s (%.1f MB/s)", self.mode,
                 stats.tensors, stats.bytes / 1e6, stats.buckets, stats.seconds, stats.bytes_per_s / 1e6)
        return stats

    def _push_paused(self, named_tensors, stats: SyncStats, servers, disk_dir, files: List[str],
                     flush_cache: bool) -> None:
        # the servers begin the update while the first bucket is exported
        begun = (self._start_all("/begin_weight_update", {}, servers, optional=True)
                 if self.mode != "disk" else None)
        try:
            buckets = self._buckets(named_tensors, stats)
            while True:
                t = time.perf_counter()
                bucket = next(buckets, None)
                stats.export_seconds += time.perf_counter() - t
                if begun is not None:
                    begun, pending = None, begun
                    self._join(*pending, "/begin_weight_update")
                if bucket is None:
                    break
                if self.mode == "distributed":
                    self._push_distributed(bucket, servers)
                elif self.mode == "tensor":
                    self._push_tensor(bucket, servers)
                else:
                    path = os.path.join(disk_dir, f"model-{len(files):05d}.safetensors")
                    if bucket.flat.device.type != "cpu" and (self._staging is None
                                                             or self._staging.numel() < bucket.nbytes):
                        self._staging = None
                        self._staging = torch.empty(max(bucket.nbytes, self.bucket_bytes), dtype=torch.uint8,
                                                    pin_memory=torch.cuda.is_available())
                    write_safetensors(bucket, path, self._staging)
                    files.append(path)
                stats.bytes += bucket.nbytes
                stats.tensors += len(bucket.names)
                stats.buckets += 1
                stats.peak_bucket_bytes = max(stats.peak_bucket_bytes, bucket.nbytes)
                del bucket
            if self.mode == "distributed":
                self._wait_broadcast()
                self._wait_pending()
        finally:
            for wait in (lambda: self._join(*begun, "/begin_weight_update") if begun else None,
                         self._wait_broadcast, self._wait_pending):  # after an error
                try:
                    wait()
                except Exception as e:  # noqa: BLE001 -- the first error is the one raised
                    log.warning("weight sync: %s", e)
            if self.mode != "disk":
                self._post_all("/end_weight_update", {}, servers, optional=True)
        if self.mode == "disk":
            try:
                self._post_all("/update_weights_from_disk",
                               {"model_path": disk_dir, "flush_cache": False}, servers)
            finally:
                shutil.rmtree(disk_dir, ignore_errors=True)
        if flush_cache:
            self._flush(servers)

    def _flush(self, servers, poll: float = 0.2) -> None:
        """``/flush_cache`` on every server. An abort takes effect asynchronously, so a server may
        still refuse while aborted requests leave its batch: abort again and retry until the
        request time-out; a cache that still cannot be flushed then is a warning, not a failed
        step (its prefixes were computed with the old weights)."""
        deadline = time.monotonic() + self.timeout
        for s in servers:
            while True:
                try:
                    s.post("/flush_cache", {}, timeout=self.timeout)
                    break
                except Exception as e:  # noqa: BLE001 -- HTTP 400 while requests are still queued
                    if time.monotonic() > deadline:
                        log.warning("weight sync: %s kept refusing /flush_cache (%s); the new weights are in, "
                                    "its prefix cache may hold entries of the old ones", s.url, e)
                        break
                    s.post("/abort_request", {"abort_all": True}, timeout=self.timeout)
                    time.sleep(poll)

    def close(self) -> None:
        if self.mode == "distributed":
            self._destroy_group()
        if self._export_buffers is not None:
            self._export_buffers.close()
        self._staging = None
