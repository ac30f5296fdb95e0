"""The ``ipc`` weight sync (colocated mode): each actor rank hands its own copy of a bucket to the
server TP rank on its GPU as a handle -- a CUDA IPC handle on a GPU, a shared-memory file on CPU --
with no copy of the bytes and no process group between actor and servers.

Per bucket: every rank of a pipeline stage gets the whole bucket (the actor's export all-gathered
over its TP group, ``gather_to_sender = False``), in the export's reused buffer; the ranks that
feed a server TP rank pickle it (``ForkingPickler``: the tensor goes as a handle; on a GPU its
device named by its UUID, SGLang's convention, so a server that sees only its own GPUs still finds
it); the handles are gathered to the sender (``gather_object``, a few kB), which posts one
``/update_weights_from_tensor`` per server with ``serialized_named_tensors[r]`` from the rank that
feeds its TP worker r (the ``tensor`` mode's request, ``tensor.py``). One bucket is in flight per
server: the next is posted only once every server answered, and no rank writes a buffer again
before then (the bucket's ``release``, which the export calls before it reuses the buffer, waits
for the answers on the sender and passes their outcome to every rank).

Which rank feeds which server TP rank (:func:`ipc_sources`): the colocated placement rule, the
k-th server of a host (in the fleet's order, ``TEPO_SGLANG_URLS``) on that host's GPUs from the sum
of the TP sizes of the servers before it on that host (what the launchers do: server i of a node
on GPUs ``[i*tp, (i+1)*tp)``); its TP rank r on the next one in turn; the actor rank on that GPU
(``torch.cuda.current_device()``; on CPU its ``LOCAL_RANK``) feeds it. Where no actor rank of that
host sits on that GPU (a server beside the actor rather than on its GPUs) a rank of the same host
feeds it across GPUs (logged: the server must see that GPU); a server on a host without an actor
rank is an error (a handle opens on its own host only).

Run on CPU (the tests: shared-memory files, the same code path). Not run here: the CUDA IPC
handle (its device UUID, the server's own device), the placement on real GPUs.

Left out: pipeline parallelism (each stage holds only its own buckets; the config refuses
``sync_mode: ipc`` with ``parallel.pp > 1``); servers on hosts without an actor rank.
"""
from __future__ import annotations

import functools
import logging
import os
import socket
from dataclasses import dataclass
from typing import Dict, List, Optional, Sequence, Tuple
from urllib.parse import urlparse

import torch

from megatron_tepo.buckets import BucketStream, FlatBucket

from .base import SyncStats, WeightSync
from .distributed import _is_loopback
from .tensor import UPDATE_ROUTE, file_system_sharing, serialize_bucket, tensor_request

log = logging.getLogger(__name__)

_REDUCE_DEVICE_ARG = 6  # where torch's reduce_tensor puts a CUDA tensor's device (SGLang patches the same)


@dataclass(frozen=True)
class RankPlace:
    """Where an actor rank's buckets live: its host, and its GPU (None on CPU: ``local``, its
    ``LOCAL_RANK``, stands for it)."""
    rank: int
    host: str
    local: int = 0
    device: Optional[int] = None

    @property
    def slot(self) -> int:
        return self.local if self.device is None else self.device


def this_place(rank: int) -> RankPlace:
    device = torch.cuda.current_device() if torch.cuda.is_available() else None
    return RankPlace(rank, socket.gethostname(), int(os.environ.get("LOCAL_RANK", "0")), device)


@functools.lru_cache(maxsize=256)
def _addresses(host: str) -> frozenset:
    try:
        return frozenset(a[4][0] for a in socket.getaddrinfo(host, None))
    except (OSError, UnicodeError):
        return frozenset()


def same_host(a: str, b: str) -> bool:
    """Two names of one host: equal (case aside, or their first labels), or resolving alike."""
    a, b = a.lower(), b.lower()
    return a == b or a.split(".")[0] == b.split(".")[0] or bool(_addresses(a) & _addresses(b))


def ipc_sources(servers: Sequence[Tuple[str, int]], places: Sequence[RankPlace], here: str
                ) -> Tuple[List[List[int]], List[Tuple[int, int]]]:
    """Per server (``(host, tp_size)`` in the fleet's order; a loopback host is ``here``, the
    sender's), the global rank that feeds each of its TP ranks (see the module docstring), and the
    ``(server, TP rank)`` pairs fed from another GPU than their own."""
    first: Dict[str, int] = {}  # per host: the first GPU of its next server
    plan, across = [], []
    for i, (host, tp) in enumerate(servers):
        host = here if _is_loopback(host) else host
        on_host = sorted((p for p in places if same_host(p.host, host)), key=lambda p: (p.slot, p.rank))
        if not on_host:
            raise ValueError(f"ipc weight sync: server {i} runs on {host}, where no actor rank runs (a handle opens "
                             f"on its own host only): use rollout.sync_mode distributed, tensor or disk")
        key = next((k for k in first if same_host(k, host)), host)
        gpu0 = first.get(key, 0)
        first[key] = gpu0 + tp
        ranks = []
        for r in range(tp):
            on_gpu = [p for p in on_host if p.slot == gpu0 + r]
            p = on_gpu[0] if on_gpu else on_host[(gpu0 + r) % len(on_host)]
            if not on_gpu and p.device is not None:
                across.append((i, r))
            ranks.append(p.rank)
        plan.append(ranks)
    return plan, across


def _reduce_naming_device_uuid(t: torch.Tensor):
    """torch's reduction of a tensor, a CUDA tensor's device named by its UUID rather than its
    index (as ``sglang.srt.utils.patch_torch`` does, whose rebuild SGLang's workers use: the index
    differs between processes that see different GPUs, the UUID does not)."""
    from torch.multiprocessing import reductions

    fn, args = reductions.reduce_tensor(t)
    if t.is_cuda:
        args = (*args[:_REDUCE_DEVICE_ARG], str(torch.cuda.get_device_properties(args[_REDUCE_DEVICE_ARG]).uuid),
                *args[_REDUCE_DEVICE_ARG + 1:])
    return fn, args


def _uuid_pickler(buf):
    from multiprocessing.reduction import ForkingPickler

    import torch.multiprocessing  # noqa: F401 -- registers the tensor reductions

    pickler = ForkingPickler(buf)
    pickler.dispatch_table[torch.Tensor] = _reduce_naming_device_uuid
    return pickler


def control_group(timeout_s: Optional[float] = None):
    """A gloo group of every rank for the sync's per-bucket messages (the handles' gather, the
    answers' broadcast: a few kB each): on the host, so that they are neither host syncs of the GPUs
    nor NCCL kernels spinning where the servers load the weights (the default group of a GPU job is
    NCCL). Collective: made on every rank, at the same point (each builds its sync there). None in
    one process."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return None
    from datetime import timedelta

    return dist.new_group(backend="gloo", timeout=timedelta(seconds=timeout_s) if timeout_s else None)


class IpcSync(WeightSync):
    """``group``: the process group of the handles' gather and the answers' broadcast, every rank of
    the actor in it (default: a gloo group of its own, :func:`control_group`, waiting up to
    ``group_timeout_s`` in one collective)."""

    mode = "ipc"
    gather_to_sender = False

    def __init__(self, target, group=None, group_timeout_s: Optional[float] = None, **common):
        super().__init__(target, **common)
        self.group = group if group is not None else control_group(group_timeout_s)
        self._places: Optional[List[RankPlace]] = None
        self._plan: List[List[int]] = []
        self._mine = 0  # handles this rank makes per bucket
        self._pending = None  # the sender: the last bucket's requests
        self._awaiting = False  # every rank: the last bucket's answers are still to be shared

    @classmethod
    def options_from(cls, rollout, urls: List[str], fault=None) -> dict:
        return {"group_timeout_s": fault.process_group_timeout_s()} if fault is not None else {}

    # ------------------------------------------------------------------ collectives (none in one process)
    def _world(self) -> int:
        import torch.distributed as dist

        return dist.get_world_size(self.group) if dist.is_available() and dist.is_initialized() else 1

    def _rank(self) -> int:
        import torch.distributed as dist

        return dist.get_rank() if self._world() > 1 else 0

    def _share_from_sender(self, obj):
        if self._world() == 1:
            return obj
        import torch.distributed as dist

        box = [obj]
        dist.broadcast_object_list(box, src=self.sender_rank, group=self.group)
        return box[0]

    def _gather_to_sender(self, obj) -> Optional[list]:
        if self._world() == 1:
            return [obj]
        import torch.distributed as dist

        out = [None] * self._world() if self.is_sender else None
        dist.gather_object(obj, out, dst=self.sender_rank, group=self.group)
        return out

    def _all_places(self) -> List[RankPlace]:
        if self._places is None:  # ranks do not move: asked once
            mine = this_place(self._rank())
            if self._world() == 1:
                self._places = [mine]
            else:
                import torch.distributed as dist

                self._places = [None] * self._world()
                dist.all_gather_object(self._places, mine, group=self.group)
        return self._places

    # ------------------------------------------------------------------ the plan, every push
    def _prepare(self, servers) -> None:
        """The sender: which rank feeds which server TP rank, told to every rank (an error too, so
        that no rank waits for buckets that will not be asked for)."""
        places, error = self._all_places(), None
        try:
            plan, across = ipc_sources([(urlparse(s.url).hostname or "", self._tp_size(s)) for s in servers],
                                       places, socket.gethostname())
            for i, r in across:
                log.warning("ipc weight sync: no actor rank on the GPU of TP rank %d of %s; it maps the bucket of "
                            "rank %d across GPUs (the server must see that GPU)", r, servers[i].url, plan[i][r])
            message = ("ok", plan)
        except Exception as exc:  # noqa: BLE001 -- told to every rank, raised here
            error, message = exc, ("error", f"{type(exc).__name__}: {exc}")
        self._share_from_sender(message)
        if error is not None:
            raise error
        self._take(plan)

    def _receive_plan(self) -> None:
        self._all_places()
        status, plan = self._share_from_sender(None)
        if status != "ok":
            raise RuntimeError(f"ipc weight sync: the sender (global rank {self.sender_rank}) failed: {plan}")
        self._take(plan)

    def _take(self, plan: List[List[int]]) -> None:
        me = self._rank()
        self._plan, self._mine = plan, sum(ranks.count(me) for ranks in plan)

    # ------------------------------------------------------------------ per bucket, every rank
    def push(self, named_tensors, flush_cache: bool = True) -> SyncStats:
        if self._world() > 1 and not isinstance(named_tensors, BucketStream):
            raise TypeError("ipc weight sync: with several ranks it takes the actor's export (a BucketStream), "
                            "which gives every rank the buckets")
        if self.is_sender:
            return super().push(named_tensors, flush_cache)
        self._receive_plan()
        stats = SyncStats(self.mode)
        for bucket in self._buckets(named_tensors, stats):
            self._share(bucket, None)
        self._settle()
        return stats

    def _send(self, bucket: FlatBucket, servers) -> None:
        self._share(bucket, servers)

    def _in_flight(self):
        return (self._settle,)

    def _share(self, bucket: FlatBucket, servers) -> None:
        """This rank's handles of ``bucket`` to the sender, which posts each server its entries
        (``servers``: the sender's, None elsewhere). Returns without waiting for the answers: the
        bucket's ``release`` does (before its buffer is written again, or at the next bucket)."""
        self._settle()
        with file_system_sharing():  # one pickle per entry: SGLang's worker releases each CUDA handle once
            mine = [serialize_bucket(bucket.flat, bucket, _uuid_pickler) for _ in range(self._mine)]
        everyone = self._gather_to_sender(mine)
        if servers is not None:
            queues = {rank: list(entries or ()) for rank, entries in enumerate(everyone)}
            posts = [(s, tensor_request([queues[rank].pop(0) for rank in ranks])) for s, ranks in zip(servers, self._plan)]
            self._pending = self._start_each(UPDATE_ROUTE, posts)
        self._awaiting = True
        bucket.release = self._settle

    def _settle(self) -> None:
        """Every rank: wait until every server answered the last bucket (the sender joins the
        requests; every rank then hears how it went and raises on a failure). Nothing to do when
        it was settled already."""
        if not self._awaiting:
            return
        self._awaiting = False
        error = None
        if self.is_sender:
            pending, self._pending = self._pending, None
            try:
                self._join(*pending, UPDATE_ROUTE)
            except RuntimeError as exc:
                error = exc
        failure = self._share_from_sender(str(error) if error is not None else None)
        if error is not None:
            raise error
        if failure is not None:
            raise RuntimeError(f"ipc weight sync: {failure}")
