"""What every weight sync mode does alike: :class:`WeightSync`, the base of the three modes
(``distributed.py``, ``tensor.py``, ``disk.py``), which only say how a bucket travels.

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

A push pauses the servers (aborting what they still run), sends the buckets and continues them
whatever happens. Where the server has them (0.5.23; not 0.5.6 to 0.5.11), the loads sit inside
``/begin_weight_update`` ... ``/end_weight_update``; each server is probed once -- its first
``/begin_weight_update`` -- and one that answers 404 is updated without the two from then on.
One cache flush follows the update.

Left out: how a bucket reaches the servers (the modes' :meth:`WeightSync._send`) and anything of
the servers but their HTTP routes (``target`` is anything with ``alive_servers()``).
"""
from __future__ import annotations

import abc
import logging
import threading
import time
from dataclasses import dataclass
from typing import Callable, Dict, Iterator, List, Optional, Sequence, Tuple

import torch

from megatron_tepo.buckets import (BucketHandoff, BucketStream, BucketTransform, ExportBuffers, FlatBucket, NamedTensors,
                                   WireDtype, iter_buckets, tensor_bytes, to_flat_bucket)

log = logging.getLogger(__name__)

# the weight-update session of recent SGLang (0.5.23 has it; 0.5.6, 0.5.10 and 0.5.11 do not: they answer
# 404 and are updated without one, see _start_all)
SESSION_ROUTES = ("/begin_weight_update", "/end_weight_update")


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


class WeightSync(abc.ABC):
    """Pushes ``(HF name, tensor)`` streams to every live server of a fleet; a mode subclasses it
    with :meth:`_send` (one bucket to the servers) and, where it needs them, the other hooks.

    ``target``: an :class:`~megatron_tepo.rollout.sglang.fleet.SGLangFleet` (or anything with
    ``alive_servers()``). ``wire_dtype``: cast before sending (e.g. ``torch.bfloat16`` for a bf16
    server; halves the bytes of a float32 actor); ``None`` sends as exported. ``transforms``: more
    stages between the export and the servers (:class:`~megatron_tepo.buckets.BucketTransform`,
    e.g. a quantizer), after the wire dtype's. ``sender_rank``:
    the global rank that talks to the servers (``is_sender`` defaults to being it; when
    torch.distributed is up the two must agree, since the bucketed export gathers to that rank).
    ``keep_buffers``: keep the export's bucket buffers from one push to the next (about two buckets
    per rank, held between pushes; on CPU faulting fresh buffers in costs about as much as filling
    them); False frees them after every push. ``timeout``: of every request to a server.
    """

    mode = ""  # the mode's name (``rollout.sync_mode``)
    # the actor's buckets gathered to the sender (False: every rank gets its own copy of every
    # bucket of its stage, all-gathered over its TP group: ``ipc``, where each rank sends its own)
    gather_to_sender = True
    session = True  # the loads sit inside /begin_weight_update ... /end_weight_update
    align_buckets = False  # a plain stream's buckets close early to keep every tensor aligned

    def __init__(self, target, bucket_bytes: int = 256 << 20, wire_dtype: Optional[torch.dtype] = None,
                 is_sender: Optional[bool] = None, timeout: float = 600.0, sender_rank: int = 0,
                 keep_buffers: bool = True, transforms: Sequence[BucketTransform] = ()):
        self.target, self.bucket_bytes = target, bucket_bytes
        # what happens to the buckets between the export and the servers, in order: the wire dtype
        # first (a cast before the collectives), then any other stage (see BucketTransform)
        self.transforms: List[BucketTransform] = ([WireDtype(wire_dtype)] if wire_dtype is not None else []) + \
            list(transforms)
        self.wire_dtype = next((t.cast for t in reversed(self.transforms) if t.cast is not None), None)
        rank = _dist_rank()
        self.sender_rank = sender_rank
        self.is_sender = (rank is None or rank == sender_rank) if is_sender is None else bool(is_sender)
        if rank is not None and self.is_sender != (rank == sender_rank):
            raise ValueError(f"weight sync: is_sender={self.is_sender} on global rank {rank} but "
                             f"sender_rank={sender_rank} (pass sender_rank=<the sending rank>)")
        self.timeout = timeout
        self._lacks: Dict[str, set] = {}  # per server URL: the optional routes it answered 404 to
        self.last_stats: Optional[SyncStats] = None
        # the export's bucket buffers, kept from one push to the next (see ExportBuffers)
        self._export_buffers = ExportBuffers() if keep_buffers else None

    # ------------------------------------------------------------------ what a mode says
    @classmethod
    def options_from(cls, rollout, urls: List[str], fault=None) -> dict:
        """The mode's own options (beyond :class:`WeightSync`'s) from a run config's ``rollout``
        section (:class:`~megatron_tepo.config.RolloutConfig`); ``urls``: the servers';
        ``fault``: the run's :class:`~megatron_tepo.config.FaultConfig`, when there is one."""
        return {}

    def _prepare(self, servers) -> None:
        """Before the servers are paused (``distributed``: the update group)."""

    @abc.abstractmethod
    def _send(self, bucket: FlatBucket, servers) -> None:
        """Send one bucket to every server (it may still be on the wire when this returns: then
        set ``bucket.release`` and return the wait in :meth:`_in_flight`)."""

    def _in_flight(self) -> Sequence[Callable[[], None]]:
        """Waits for what :meth:`_send` left running, called after the last bucket (and after an
        error, where each one's failure is only logged)."""
        return ()

    def _commit(self, servers) -> None:
        """After the last bucket and the session's end, before the cache flush (``disk``: the
        servers load the files)."""

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
        if optional:
            servers = [s for s in servers if path not in self._lacks.get(s.url, ())]
        return self._start_each(path, [(s, payload) for s in servers], optional)

    def _start_each(self, path: str, posts, optional: bool = False) -> Tuple[List[threading.Thread], Dict]:
        """POST ``path`` with its own payload to each server (``posts``: ``(server, payload)``
        pairs), each in its own thread; returns the threads and the errors by server URL, filled
        as they answer (:meth:`_join` waits for them and raises)."""
        errors: Dict[str, str] = {}

        def call(s, payload):
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

        threads = [threading.Thread(target=call, args=(s, payload), daemon=True) for s, payload in posts]
        for t in threads:
            t.start()
        return threads, errors

    @staticmethod
    def _join(threads, errors, what: str) -> None:
        for t in threads:
            t.join()
        if errors:
            raise RuntimeError(f"weight sync {what} failed: {errors}")

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
            dst = self.sender_rank if _dist_rank() is not None and self.gather_to_sender else None
            kw = {"buffers": self._export_buffers} if self._export_buffers is not None else {}
            return self._transformed(named_tensors.flat_buckets(self.bucket_bytes, dtype=self.wire_dtype, dst=dst,
                                                                reuse=True, **kw))
        if not self.is_sender:  # a plain stream: nothing to send from this rank, just drain it
            return (None for _ in named_tensors)

        def flatten_each():
            out, handoff = None, BucketHandoff()
            for bucket in iter_buckets(named_tensors, self.bucket_bytes, self.wire_dtype,
                                       align=self.align_buckets):
                handoff.settle()  # the previous bucket's send is done with ``out``
                total = sum(tensor_bytes(t) for _, t in bucket)
                if out is None or out.numel() < total:
                    out = None
                    out = torch.empty(max(total, min(self.bucket_bytes, 1 << 30)), dtype=torch.uint8)
                fb = to_flat_bucket(bucket, out)
                del bucket
                yield handoff.give(fb)
        return self._transformed(flatten_each())

    def _transformed(self, buckets: Iterator[Optional[FlatBucket]]) -> Iterator[Optional[FlatBucket]]:
        """``buckets`` through :attr:`transforms`, in order (a rank that only drains gets None)."""
        if not any(type(t).__call__ is not BucketTransform.__call__ for t in self.transforms):
            return buckets  # every stage a cast (done before the collectives): nothing to apply here
        return (self._apply(b) if b is not None else None for b in buckets)

    def _apply(self, bucket: FlatBucket) -> FlatBucket:
        for transform in self.transforms:
            bucket = transform(bucket)
        return bucket

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
        self._prepare(servers)
        # A request may still run on a server (one that timed out on our side and was retried on
        # another): the update's cache flush would be refused. Abort whatever runs and hold new
        # requests until the update is in (continue_generation below, whatever happens).
        self._post_all("/pause_generation", {"mode": "abort"}, servers)
        try:
            self._push_paused(named_tensors, stats, servers, flush_cache)
        finally:
            self._post_all("/continue_generation", {}, servers)
        stats.seconds = time.perf_counter() - t0
        self.last_stats = stats
        log.info("weight sync (%s): %d tensors, %.1f MB in %d buckets, %.2f s (%.1f MB/s)", self.mode,
                 stats.tensors, stats.bytes / 1e6, stats.buckets, stats.seconds, stats.bytes_per_s / 1e6)
        return stats

    def _push_paused(self, named_tensors, stats: SyncStats, servers, flush_cache: bool) -> None:
        # the servers begin the update while the first bucket is exported
        begun = self._start_all("/begin_weight_update", {}, servers, optional=True) if self.session else None
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
                self._send(bucket, servers)
                stats.bytes += bucket.nbytes
                stats.tensors += len(bucket.names)
                stats.buckets += 1
                stats.peak_bucket_bytes = max(stats.peak_bucket_bytes, bucket.nbytes)
                del bucket
            for wait in self._in_flight():
                wait()
        finally:
            for wait in (lambda: self._join(*begun, "/begin_weight_update") if begun else None,
                         *self._in_flight()):  # after an error
                try:
                    wait()
                except Exception as e:  # noqa: BLE001 -- the first error is the one raised
                    log.warning("weight sync: %s", e)
            if self.session:
                self._post_all("/end_weight_update", {}, servers, optional=True)
        self._commit(servers)
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
        if self._export_buffers is not None:
            self._export_buffers.close()
