"""The actor's weights as Hugging Face tensors, bucketed: what the rollout weight sync sends and
the end-of-run export writes.

* :func:`export_hf_state` / :class:`HFExport` -- this rank's pipeline stage as HF
  ``(name, full tensor)``, lazily; also readable as flat buckets gathered to one rank.
* :func:`iter_flat_buckets` -- the export as :class:`~megatron_tepo.buckets.FlatBucket` s: one
  collective per bucket (cast to the wire dtype first), the HF tensors copied once from the
  received shards into the bucket's flat buffer; all-gathered, or gathered to one rank (every
  pipeline stage's buckets reach it); MoE experts collected from every expert-parallel rank.

The name mapping and the TP/PP placement come from :mod:`megatron_tepo.models` (one mapping per
family); the bucket format from :mod:`megatron_tepo.buckets`, which the engines read.

With ``actor.lora`` the parameters are exported merged: an adapted linear's weight as
``W + scale * B A`` (:func:`~megatron_tepo.megatron.lora.merged_weight`), the adapters themselves
not at all; a gradient export skips the frozen base.

Left out: virtual pipeline stages beyond plain chunk lists, FSDP/DTensor parameters.
"""
from __future__ import annotations

import math
import os
import socket
from dataclasses import dataclass
from typing import Dict, Iterator, List, Optional, Tuple

import torch
import torch.distributed as dist

from megatron_tepo.buckets import BucketHandoff, BucketStream, ExportBuffers, FlatBucket
from megatron_tepo.cuda_alloc import no_expandable_segments
from megatron_tepo.models import GPTFamilyConfig, layer_mapping
from megatron_tepo.megatron.lora import is_adapter, merged_weight
from megatron_tepo.models.converters import MegatronToHFLayout
from megatron_tepo.megatron.parallel import expert_group, pipeline_group
from megatron_tepo.megatron.sharding import (gated_split, expert_indices, group_for, is_expert_param, layer_offsets,
                                           local_tensor, parallel_groups, shard_pieces, to_global_name, tp_partition,
                                           unwrap_model)

EXPORT_BUCKET_BYTES = 64 << 20





class HFExport(BucketStream):
    """A lazy export of this rank's pipeline stage as HF tensors (nothing moves before iterating);
    the :class:`~megatron_tepo.buckets.BucketStream` a weight update hands the engines.

    * ``for name, tensor in export`` -- every rank gets ``(HF name, full tensor)`` for its stage,
      all-gathered in buckets of ``bucket_bytes`` (one collective per bucket, see
      :func:`iter_flat_buckets`); the tensors are views into their bucket's buffer.
    * :meth:`flat_buckets` -- the same stream as :class:`~megatron_tepo.buckets.FlatBucket` s, optionally
      gathered to one rank only and into reused buffers: what the rollout weight sync consumes.

    ``dtype``: cast floating tensors to it BEFORE the collectives (bit for bit what casting the
    full tensors would give: unsharding and splitting only move elements); None keeps the
    parameters' dtype. Expert parameters (MoE with expert parallelism) are collected from every
    EP rank under their global expert index when ``all_experts`` (default: for params; for grads
    each rank reports its own experts' gradients, as the per-rank equivalence checks read them).
    Collective: every rank of the stage's TP (and EP) groups must consume it to the end.
    """

    def __init__(self, model_chunks: List[torch.nn.Module], family_cfg: GPTFamilyConfig,
                 what: str = "param", tp_group=None, dtype: Optional[torch.dtype] = None,
                 bucket_bytes: int = EXPORT_BUCKET_BYTES, all_experts: Optional[bool] = None):
        if what not in ("param", "grad"):
            raise ValueError(f"what must be 'param' or 'grad', got {what!r}")
        self.model_chunks, self.family_cfg, self.what, self.tp_group = model_chunks, family_cfg, what, tp_group
        self.dtype, self.bucket_bytes = dtype, bucket_bytes
        self.all_experts = (what == "param") if all_experts is None else all_experts

    def flat_buckets(self, bucket_bytes: Optional[int] = None, dtype: Optional[torch.dtype] = None,
                     dst: Optional[int] = None, reuse: bool = False,
                     buffers: Optional[ExportBuffers] = None) -> Iterator[FlatBucket]:
        """Buckets of at most ``bucket_bytes`` (default: the export's); ``dtype`` overrides the
        export's; ``dst`` / ``reuse`` / ``buffers`` as in :func:`iter_flat_buckets`."""
        return iter_flat_buckets(self.model_chunks, MegatronToHFLayout(self.family_cfg, layer_mapping(self.family_cfg)),
                                 bucket_bytes or self.bucket_bytes, dtype=dtype or self.dtype, what=self.what,
                                 dst=dst, tp_group=self.tp_group, all_experts=self.all_experts, reuse=reuse,
                                 buffers=buffers)


def export_hf_state(model_chunks: List[torch.nn.Module], family_cfg: GPTFamilyConfig,
                    what: str = "param", tp_group=None, dtype: Optional[torch.dtype] = None,
                    bucket_bytes: int = EXPORT_BUCKET_BYTES, all_experts: Optional[bool] = None) -> HFExport:
    """This rank's pipeline stage as HF ``(name, full tensor)`` (an iterable :class:`HFExport`);
    collective over the TP (and EP) groups. Bit for bit
    ``megatron_to_hf(gather_full_tensors(...))`` (cast to ``dtype``), plus every EP rank's experts."""
    return HFExport(model_chunks, family_cfg, what=what, tp_group=tp_group, dtype=dtype,
                    bucket_bytes=bucket_bytes, all_experts=all_experts)


@dataclass
class _Item:
    lname: str
    chunk: int
    local: torch.Tensor  # this rank's shard (param.shape), source dtype
    wire: torch.dtype
    part: Optional[Tuple[int, object]]  # (dim, stride or sections: sharding.Split) when split over a group of size > 1
    group: object
    size: int
    full_shape: Tuple[int, ...]
    layout: list  # [(hf name, row ranges | None)] of THIS rank's global name
    expert: bool

    @property
    def local_bytes(self) -> int:
        return self.local.numel() * self.wire.itemsize

    @property
    def full_bytes(self) -> int:
        return math.prod(self.full_shape) * self.wire.itemsize


class _Buffers:
    """uint8 scratch buffers by role; with ``reuse`` one allocation per role, sized up front from
    ``caps`` (the largest use the plan makes of it), so a push touches fresh pages once instead of
    once per bucket and never holds an outgrown buffer next to its replacement; with ``keep`` (an
    :class:`ExportBuffers`) the allocations outlive the export. On ``device`` (the parameters')."""

    def __init__(self, reuse: bool, caps: Optional[Dict[str, int]] = None, device=None,
                 keep: Optional[ExportBuffers] = None):
        self.reuse, self.caps, self.device = reuse, caps or {}, device
        self.held = keep.held if (keep is not None and reuse) else {}

    def get(self, role: str, nbytes: int) -> torch.Tensor:
        if not self.reuse:
            return self._new(nbytes)
        key = (role, str(self.device))
        buf = self.held.get(key)
        if buf is None or buf.numel() < nbytes:
            self.held.pop(key, None)
            del buf
            buf = self.held[key] = self._new(max(nbytes, self.caps.get(role, 0)))
        return buf[:nbytes]

    def _new(self, nbytes: int) -> torch.Tensor:
        # never in an expandable segment, whatever the trainer's allocator setting: the ipc weight
        # sync hands these buffers to the servers by CUDA IPC (megatron_tepo/cuda_alloc.py)
        with no_expandable_segments():
            return torch.empty(nbytes, dtype=torch.uint8, device=self.device)

    def shared(self, role: str, nbytes: int, group, dst: int) -> torch.Tensor:
        """A buffer mapped by every rank of ``group`` (all on this host; collective when it has to
        be created or grown): ``dst`` creates a file in /dev/shm, every rank maps it, then it is
        unlinked (the mappings stay; nothing is left behind if a rank dies later)."""
        key = ("shared", role, tuple(_ranks(group)))
        buf = self.held.get(key)
        if buf is None or buf.numel() < nbytes:
            self.held.pop(key, None)
            del buf
            n = max(nbytes, self.caps.get("shared", 0))
            path = [None]
            if dist.get_rank() == dst:
                import uuid

                path[0] = f"{_SHM_DIR}/mtepo-export-{os.getpid()}-{uuid.uuid4().hex}"
                fd = os.open(path[0], os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
                try:
                    os.ftruncate(fd, n)
                finally:
                    os.close(fd)
            try:
                dist.broadcast_object_list(path, src=dst, group=group)
                buf = self.held[key] = torch.from_file(path[0], shared=True, size=n, dtype=torch.uint8)
                dist.barrier(group=group)
            finally:
                if dist.get_rank() == dst:
                    os.unlink(path[0])
        return buf[:nbytes]


_SHM_DIR = "/dev/shm"


def _colocated(group, dst: int, need: int, device) -> bool:
    """Whether the TP ranks of ``group`` can assemble buckets straight into shared memory: CPU
    tensors, every rank on ``dst``'s host, room for ``need`` bytes in /dev/shm (checked on every
    rank), and not turned off (``MTEPO_EXPORT_SHM=0``). The same answer on every rank (one small
    object all-gather)."""
    ok = (torch.device(device).type == "cpu" and os.environ.get("MTEPO_EXPORT_SHM", "1") != "0"
          and os.path.isdir(_SHM_DIR))
    free = 0
    if ok:
        st = os.statvfs(_SHM_DIR)
        free = st.f_bavail * st.f_frsize
    info = [None] * dist.get_world_size(group)
    dist.all_gather_object(info, (ok, socket.gethostname(), free), group=group)
    return all(o for o, _, _ in info) and len({h for _, h, _ in info}) == 1 and \
        min(f for _, _, f in info) >= need + (64 << 20)


def _ranks(group) -> List[int]:
    return dist.get_process_group_ranks(group)


def _write_item(out: torch.Tensor, it: _Item, shards: List[torch.Tensor], layout: list,
                names: list, dtypes: list, shapes: list, offsets: list, owner: Optional[int] = None) -> None:
    """Unshard ``shards`` (every rank's shard in rank order, or ``[full]``) and write the HF
    tensors of ``layout`` at the end of ``offsets`` in ``out``: each piece copied once, cast on the
    way when the shard is not in the wire dtype. ``owner``: write only the pieces of
    ``shards[owner]`` (the others may be meta tensors of the right shape; -1: none), for ranks
    that fill a shared bucket together; the names and offsets are recorded all the same."""
    dim, stride = it.part if it.part is not None and len(shards) > 1 else (0, 1)
    pieces = shard_pieces(shards, dim, stride) if stride != 1 else list(shards)
    mine = [owner is None or i % len(shards) == owner for i in range(len(pieces))]
    off = offsets[-1] + math.prod(shapes[-1]) * dtypes[-1].itemsize if offsets else 0
    for hf_name, ranges in layout:
        if ranges is None:
            shape = tuple(it.full_shape)
            view = out[off:off + math.prod(shape) * it.wire.itemsize].view(it.wire).view(shape)
            pos = 0
            for p, m in zip(pieces, mine):
                if m:
                    view.narrow(dim, pos, p.shape[dim]).copy_(p)
                pos += p.shape[dim]
        else:
            src, src_mine = pieces, mine
            if dim != 0:  # no family fuses along a TP-split dim 1; correct, not fast
                if owner is not None:
                    raise AssertionError("shared-memory buckets take no row ranges of dim-1 splits")
                src, src_mine = [torch.cat(pieces, dim=dim)], [True]
            starts, pos = [], 0
            for p in src:
                starts.append(pos)
                pos += p.shape[0]
            rows = sum(b - a for a, b in ranges)
            shape = (rows, *it.full_shape[1:])
            view = out[off:off + math.prod(shape) * it.wire.itemsize].view(it.wire).view(shape)
            at = 0
            for a, b in ranges:
                for p, ps, m in zip(src, starts, src_mine):
                    lo, hi = max(a, ps), min(b, ps + p.shape[0])
                    if lo < hi:
                        if m:
                            view[at:at + hi - lo].copy_(p[lo - ps:hi - ps])
                        at += hi - lo
        names.append(hf_name)
        dtypes.append(it.wire)
        shapes.append(shape)
        offsets.append(off)
        off += math.prod(shape) * it.wire.itemsize


def iter_flat_buckets(model_chunks: List[torch.nn.Module], layout_fn, bucket_bytes: int,
                      dtype: Optional[torch.dtype] = None, what: str = "param", dst: Optional[int] = None,
                      tp_group=None, all_experts: bool = True, reuse: bool = False,
                      buffers: Optional[ExportBuffers] = None) -> Iterator[FlatBucket]:
    """This rank's stage as buckets of HF tensors in flat buffers: the bucketed form of
    ``megatron_to_hf(gather_full_tensors(...))``, bit for bit the same tensors (cast to ``dtype``).

    ``layout_fn(global megatron name, full shape)``: :class:`~megatron_tepo.models.converters.MegatronToHFLayout`.
    Per bucket (at most ``bucket_bytes`` of HF tensors; one tensor larger than that goes alone):
    each rank casts its shards to ``dtype`` (floating tensors; None keeps the source dtype) into
    one send buffer (``dst``: straight into its receive row), ONE collective over the
    (expert-)tensor-parallel group moves them (to ``dst``: point-to-point sends), and the
    HF tensors (fused QKV / gate-up split, row-parallel shards interleaved) are copied once from
    the received shards into the bucket's flat buffer. Expert parameters with expert parallelism:
    each EP rank assembles its own experts and one more collective over the EP group collects
    every rank's, so the bucket holds every expert under its global index (``all_experts``;
    False: each rank its own, e.g. for per-rank gradient checks).

    ``dst``: None -- all-gathers, every rank gets every bucket. A global rank -- gathers to it:
    only ``dst`` yields buckets; the other ranks send their shards (and yield nothing), and ranks
    whose groups do not contain ``dst`` (data-parallel replicas, other pipeline stages) do
    nothing. Collective: every rank of the groups involved must iterate it to the end.
    ``reuse``: the yielded bucket's buffer is overwritten by the next one (for consumers done
    with a bucket before asking for the next, or that set its ``release``: it is called before
    the buffer is written again, so a send of bucket k can run while bucket k+1 is built);
    otherwise each bucket owns its buffer.
    ``buffers`` (with ``reuse``): an :class:`ExportBuffers` that keeps the buffers for the next
    export. Buffers live on the parameters' device.

    Co-located CPU ranks (gathering to ``dst``, every rank of the TP group on ``dst``'s host, CPU
    tensors, room in /dev/shm; ``MTEPO_EXPORT_SHM=0`` turns it off): the bucket is a shared-memory
    buffer, two alternating per export, and each TP rank casts its own shards straight into their
    places in the HF tensors -- no point-to-point transfer over loopback TCP and no second copy on
    ``dst``; one barrier per bucket. GPU ranks use the collective path (NCCL moves the shards).

    Pipeline parallelism: with ``dst=None`` each rank gets its own stage's buckets. With a
    ``dst``, every stage's buckets reach ``dst``: each stage builds its buckets on its member of
    ``dst``'s pipeline group, which sends them to ``dst`` one by one (point to point); ``dst``
    yields its own stage's, then the next stages' in order. This needs every rank of the world to
    iterate (one small object all-gather finds the stages' members).
    """
    if what not in ("param", "grad"):
        raise ValueError(f"what must be 'param' or 'grad', got {what!r}")
    if bucket_bytes <= 0:
        raise ValueError(f"bucket_bytes must be > 0, got {bucket_bytes}")
    handoff = BucketHandoff()
    kw = dict(dtype=dtype, what=what, tp_group=tp_group, all_experts=all_experts, reuse=reuse, keep=buffers,
              handoff=handoff)
    try:
        yield from _iter_pipeline_buckets(model_chunks, layout_fn, bucket_bytes, dst, kw)
    finally:
        handoff.settle()


def _iter_pipeline_buckets(model_chunks, layout_fn, bucket_bytes: int, dst: Optional[int], kw: dict
                           ) -> Iterator[FlatBucket]:
    """:func:`iter_flat_buckets` across pipeline stages."""
    handoff, reuse, buffers = kw["handoff"], kw["reuse"], kw["keep"]
    pp_group = pipeline_group()
    if dst is None or pp_group is None or dist.get_world_size(pp_group) == 1:
        yield from _iter_stage_buckets(model_chunks, layout_fn, bucket_bytes, dst=dst, **kw)
        return
    me, stages = dist.get_rank(), _ranks(pp_group)
    infos = [None] * dist.get_world_size()
    dist.all_gather_object(infos, (me, stages.index(me), dst in stages))
    rep = next(r for r, stage, in_dst_pipeline in infos if in_dst_pipeline and stage == stages.index(me))
    if me == dst:
        yield from _iter_stage_buckets(model_chunks, layout_fn, bucket_bytes, dst=dst, **kw)
        bufs = _Buffers(reuse, device=_device_of(model_chunks), keep=buffers)
        for src in stages:
            if src == dst:
                continue
            while True:
                header = [None]
                dist.recv_object_list(header, src=src, group=pp_group)
                if header[0] is None:
                    break
                names, dtypes, shapes, offsets, nbytes = header[0]
                flat = None
                handoff.settle()
                flat = bufs.get("out", nbytes)
                dist.recv(flat, src=src, group=pp_group)
                yield handoff.give(FlatBucket(names, dtypes, shapes, offsets, flat))
    elif me == rep:  # this stage's member of dst's pipeline group: build here, send to dst
        for b in _iter_stage_buckets(model_chunks, layout_fn, bucket_bytes, dst=rep, **kw):
            dist.send_object_list([(b.names, b.dtypes, b.shapes, b.offsets, b.nbytes)], dst=dst, group=pp_group)
            dist.send(b.flat, dst=dst, group=pp_group)
        dist.send_object_list([None], dst=dst, group=pp_group)
    else:
        for _ in _iter_stage_buckets(model_chunks, layout_fn, bucket_bytes, dst=rep, **kw):
            pass


def _iter_stage_buckets(model_chunks: List[torch.nn.Module], layout_fn, bucket_bytes: int,
                        dtype: Optional[torch.dtype], what: str, dst: Optional[int], tp_group,
                        all_experts: bool, reuse: bool, keep: Optional[ExportBuffers] = None,
                        handoff: Optional[BucketHandoff] = None) -> Iterator[FlatBucket]:
    """:func:`iter_flat_buckets` within one pipeline stage (``dst`` in this stage or None)."""
    handoff = handoff or BucketHandoff()

    groups = parallel_groups(tp_group)
    ep_group = expert_group() if all_experts else None
    ep = dist.get_world_size(ep_group) if ep_group is not None else 1
    me = dist.get_rank()
    gather_mode = dst is not None

    items, chunk_offsets = _stage_items(model_chunks, layout_fn, dtype, what, groups)
    ep_stage = ep > 1 and any(it.expert for it in items)
    dense_tp = groups[0]
    need = _participation(dst, groups, ep_group, ep_stage)
    # every EP rank's expert indices (to name the experts the EP collective brings)
    stage2 = ep_stage and (not gather_mode or dst in _ranks(ep_group))
    ep_maps = None
    if stage2:
        mine = [expert_indices(unwrap_model(c)) for c in model_chunks]
        ep_maps = [None] * ep
        dist.all_gather_object(ep_maps, mine, group=ep_group)

    plan = _plan_buckets(items, bucket_bytes, ep if ep_stage else 1)

    device = _device_of(model_chunks)
    # co-located CPU ranks: dense buckets assembled in shared memory by every TP rank (see the
    # docstring of iter_flat_buckets); only buckets whose items unshard along dim 0 or need no
    # row ranges (every family here; the fallback is the collective path)
    shm_ok = [not bucket[0].expert and bucket[0].size > 1 and all(
        it.part is None or it.part[0] == 0 or all(r is None for _, r in it.layout) for it in bucket)
        for bucket in plan]
    shm_cap = max((_out_bytes(b) for b, ok in zip(plan, shm_ok) if ok), default=0)
    use_shm = False
    if gather_mode and reuse and need[False] and shm_cap:
        held = sum(t.numel() for k, t in (keep.held.items() if keep is not None else ())
                   if k[0] == "shared")
        use_shm = _colocated(dense_tp, dst, max(0, 2 * shm_cap - held), device)
    bufs = _Buffers(reuse, _buffer_caps(plan, shm_ok, use_shm, need, ep if ep_stage else 1), device, keep)
    send = recv = rows = out = final = slots = None
    n_shared = 0
    for bucket, ok in zip(plan, shm_ok):
        kind = bucket[0].expert
        if not need[kind]:
            continue
        if ok and use_shm:
            send = recv = rows = out = final = slots = None
            group = bucket[0].group
            idx = _ranks(group).index(me)
            out = bufs.shared(f"out{n_shared % 2}", _out_bytes(bucket), group, dst)
            n_shared += 1
            names, dtypes, shapes, offs = [], [], [], []
            for it in bucket:
                if it.part is None:  # replicated: dst writes it
                    _write_item(out, it, [it.local], it.layout, names, dtypes, shapes, offs,
                                owner=0 if me == dst else -1)
                else:
                    shards = [it.local if r == idx else it.local.to("meta") for r in range(it.size)]
                    _write_item(out, it, shards, it.layout, names, dtypes, shapes, offs, owner=idx)
            # the other ranks write bucket k+2 into bucket k's buffer once past this barrier
            handoff.settle()
            dist.barrier(group=group)  # every rank's part is in place
            if me == dst:
                yield handoff.give(FlatBucket(names, dtypes, shapes, offs, out))
            continue
        send = recv = rows = out = final = slots = None  # (the last bucket's views)
        group, size = bucket[0].group, bucket[0].size
        split = [it for it in bucket if it.part is not None]
        # who builds the bucket's HF tensors: everyone (all-gather), dst, or every EP rank (its own
        # experts, before the EP collective)
        assemble = not gather_mode or me == dst or (kind and ep_stage)
        shards_of = {}
        if split:  # stage 1: the shards of the split tensors, one collective over the (E)TP group
            total = sum(it.local_bytes for it in split)
            to_all = not gather_mode or (kind and ep_stage)  # experts: every EP rank assembles its own
            ranks = _ranks(group)
            if not to_all and me == dst:  # dst casts its own shards straight into its receive row
                recv = bufs.get("recv", total * size)
                rows = recv.view(size, total)
                send = rows[ranks.index(me)]
            else:
                send = bufs.get("send", total)
            o = 0
            for it in split:
                send[o:o + it.local_bytes].view(it.wire).view(it.local.shape).copy_(it.local)
                o += it.local_bytes
            if to_all:
                recv = bufs.get("recv", total * size)
                rows = recv.view(size, total)
                dist.all_gather(list(rows), send, group=group)
            else:
                # point to point rather than gloo's gather, which stages everything in a fresh
                # flat buffer on dst and copies it again
                _gather_into(send, rows if me == dst else None, ranks, dst, group)
            if assemble:
                o = 0
                for it in split:
                    shards_of[id(it)] = [rows[r, o:o + it.local_bytes].view(it.wire).view(it.local.shape)
                                         for r in range(size)]
                    o += it.local_bytes
        if not assemble:
            continue
        per_rank = _out_bytes(bucket)
        names, dtypes, shapes, offs = [], [], [], []
        handoff.settle()  # the consumer is done with the previous bucket's buffer
        if kind and ep_stage and gather_mode and me == dst:  # assemble straight into its slot
            final = bufs.get("out", per_rank * ep)
            slots = final.view(ep, per_rank)
            out = slots[_ranks(ep_group).index(me)]
        elif kind and ep_stage:
            out = bufs.get("local_out", per_rank)
        else:
            out = bufs.get("out", per_rank)
        for it in bucket:
            _write_item(out, it, shards_of.get(id(it), [it.local]), it.layout, names, dtypes, shapes, offs)
        if not (kind and ep_stage):
            yield handoff.give(FlatBucket(names, dtypes, shapes, offs, out))
            continue
        # stage 2: every EP rank's assembled experts, one collective over the EP group
        if not stage2:
            continue
        receive = not gather_mode or me == dst
        if gather_mode:
            _gather_into(out, slots if receive else None, _ranks(ep_group), dst, ep_group)
        else:
            final = bufs.get("out", per_rank * ep)
            dist.all_gather(list(final.view(ep, per_rank)), out, group=ep_group)
        if not receive:
            continue
        all_names, all_dtypes, all_shapes, all_offs = [], [], [], []
        for k in range(ep):
            all_names += _names_for(bucket, ep_maps[k], chunk_offsets, layout_fn)
            all_dtypes += dtypes
            all_shapes += shapes
            all_offs += [k * per_rank + o for o in offs]
        yield handoff.give(FlatBucket(all_names, all_dtypes, all_shapes, all_offs, final))
    handoff.settle()
    if n_shared:  # dst asked past its last bucket: done with the shared buffers, which the next
        dist.barrier(group=dense_tp)  # export on the other ranks may start writing again


def _stage_items(model_chunks: List[torch.nn.Module], layout_fn, dtype: Optional[torch.dtype], what: str,
                 groups) -> Tuple[List[_Item], list]:
    """Every parameter (or gradient: ``what``) of this stage's chunks that the HF model has, as an
    :class:`_Item` (its local tensor, wire dtype, TP split and group, full shape, HF layout), and
    each chunk's layer offsets (to name the experts another EP rank holds)."""
    items: List[_Item] = []
    chunk_offsets = []
    for ci, chunk in enumerate(model_chunks):
        inner = unwrap_model(chunk)
        offsets, experts = layer_offsets(inner), expert_indices(inner)
        chunk_offsets.append(offsets)
        for lname, param in inner.named_parameters():
            if is_adapter(param) or (what == "grad" and not param.requires_grad):
                continue  # (LoRA: the adapters travel merged into their base weight, which has no gradient)
            gname = to_global_name(lname, offsets, experts)
            local = local_tensor(param, what, gname)
            merged = merged_weight(param) if what == "param" else None
            local = local if merged is None else merged  # an adapted linear's W + s*B*A
            expert = is_expert_param(param)
            group = group_for(param, groups)
            size = dist.get_world_size(group)
            part = tp_partition(param, gated_split(getattr(layout_fn, "gated", None), gname)) if size > 1 else None
            full = list(param.shape)
            if part is not None:
                full[part[0]] *= size
            layout = layout_fn(gname, full)
            if not layout:
                continue
            wire = dtype if (dtype is not None and local.is_floating_point()) else local.dtype
            items.append(_Item(lname, ci, local, wire, part, group, size, tuple(full), layout, expert))
    return items, chunk_offsets


def _participation(dst: Optional[int], groups, ep_group, ep_stage: bool) -> Dict[bool, bool]:
    """Whether this rank takes part in the dense (``False``) and the expert (``True``) buckets: the
    same answer on every member of each group involved (every rank without a ``dst``)."""
    if dst is None:
        return {False: True, True: True}
    me = dist.get_rank()
    dense_tp = groups[0]
    dense_n = dist.get_world_size(dense_tp)
    need_dense = dst in _ranks(dense_tp) if dense_n > 1 else me == dst
    if ep_stage:
        # an expert-TP all-gather involves ranks of other EP groups: all of them take part
        need_exp = dist.get_world_size(groups[1]) > 1 or dst in _ranks(ep_group)
    else:
        etp = groups[1]
        need_exp = dst in _ranks(etp) if dist.get_world_size(etp) > 1 else me == dst
    return {False: need_dense, True: need_exp}


def _plan_buckets(items: List[_Item], bucket_bytes: int, ep: int) -> List[List[_Item]]:
    """The buckets, planned over ALL items (the same boundaries on every rank of a stage), kinds never
    mixed; an expert item counts ``ep`` times (every EP rank's experts travel in its bucket)."""
    plan: List[List[_Item]] = []
    cur, size_b = [], 0
    for it in items:
        nb = it.full_bytes * (ep if it.expert else 1)
        if cur and (cur[0].expert != it.expert or size_b + nb > bucket_bytes or size_b % it.wire.itemsize):
            plan.append(cur)
            cur, size_b = [], 0
        cur.append(it)
        size_b += nb
    if cur:
        plan.append(cur)
    return plan


def _buffer_caps(plan: List[List[_Item]], shm_ok: List[bool], use_shm: bool, need: Dict[bool, bool],
                 ep: int) -> Dict[str, int]:
    """The largest bytes each buffer role holds over the buckets this rank takes part in (``shared``:
    the co-located ranks' shared-memory bucket; ``send`` / ``recv``: the shards; ``out``, with EP
    ``local_out``: the assembled bucket)."""
    caps: Dict[str, int] = {}
    for bucket, ok in zip(plan, shm_ok):
        if ok and use_shm:
            caps["shared"] = max(caps.get("shared", 0), _out_bytes(bucket))
            continue
        if need[bucket[0].expert]:
            send = sum(it.local_bytes for it in bucket if it.part is not None)
            out = _out_bytes(bucket)
            roles = {"send": send, "recv": send * bucket[0].size}
            roles.update({"local_out": out, "out": out * ep} if bucket[0].expert and ep > 1 else {"out": out})
            for role, n in roles.items():
                caps[role] = max(caps.get(role, 0), n)
    return caps


def _device_of(model_chunks) -> torch.device:
    for chunk in model_chunks:
        for p in chunk.parameters():
            return p.device
    return torch.device("cpu")


def _gather_into(send: torch.Tensor, rows: Optional[torch.Tensor], ranks: List[int], dst: int, group) -> None:
    """Gather to ``dst``: every other rank sends ``send``; ``dst`` (whose own row is already in
    place) receives each rank's straight into its row of ``rows``."""
    if dist.get_rank() != dst:
        dist.send(send, dst=dst, group=group)
        return
    works = [dist.irecv(rows[i], src=r, group=group) for i, r in enumerate(ranks) if r != dst]
    for w in works:
        w.wait()


def _out_bytes(bucket: List[_Item]) -> int:
    """Bytes of the HF tensors one rank assembles for ``bucket``."""
    return sum(sum(math.prod(_hf_shape(it, r)) for _, r in it.layout) * it.wire.itemsize for it in bucket)


def _hf_shape(it: _Item, ranges) -> Tuple[int, ...]:
    if ranges is None:
        return tuple(it.full_shape)
    return (sum(b - a for a, b in ranges), *it.full_shape[1:])


def _names_for(bucket: List[_Item], maps, chunk_offsets, layout_fn) -> List[str]:
    """The HF names of ``bucket``'s tensors on the EP rank whose expert indices are ``maps``."""
    names = []
    for it in bucket:
        gname = to_global_name(it.lname, chunk_offsets[it.chunk], maps[it.chunk])
        names += [n for n, _ in layout_fn(gname, it.full_shape)]
    return names
