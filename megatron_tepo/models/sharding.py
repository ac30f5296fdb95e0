"""Generic TP/PP placement of full tensors onto Megatron parameters, and back.

Nothing here knows a parameter by name (the HF layout comes in as a function): the tensor-parallel split of each parameter is read from
its own megatron metadata (``tensor_model_parallel``, ``partition_dim``, ``partition_stride``, as
set by ``ColumnParallelLinear`` / ``RowParallelLinear`` / ``VocabParallelEmbedding``), and the
pipeline placement from each layer's global ``layer_number`` (so ``decoder.layers.{j}`` of a stage
is global layer ``layer_number - 1``).

* :func:`shard_tensor` / :func:`unshard_tensors` -- the stride-aware split used by megatron's
  ``_initialize_affine_weight_cpu`` and its inverse.
* :func:`global_named_parameters` -- a chunk's parameters under *global* Megatron names.
* :func:`load_megatron_state_into` / :func:`gather_full_tensors` -- fill this rank's shards from
  full tensors (every parameter checked filled), and all-gather full tensors (params or grads)
  over the TP group, one collective per tensor, Megatron names (this rank's experts only).
* :func:`iter_flat_buckets` -- the export in HF layout as :class:`FlatBucket` s: one collective
  per bucket (cast to the wire dtype first), the HF tensors copied once from the received shards
  into the bucket's flat buffer; all-gathered, or gathered to one rank (every pipeline stage's
  buckets reach it); MoE experts collected from every expert-parallel rank.

Expert parameters (megatron's ``allreduce=False``) are split over the expert-tensor-parallel
group, and their local expert index is mapped to the global one through the MoE layer's
``local_expert_indices``; a rank only loads the experts it holds.

Left out: virtual pipeline stages beyond plain chunk lists, FSDP/DTensor parameters.
"""
from __future__ import annotations

import math
import os
import re
import socket
from dataclasses import dataclass, field
from typing import Callable, Dict, Iterable, Iterator, List, Optional, Tuple

import torch
import torch.distributed as dist

_LAYER = re.compile(r"^decoder\.layers\.(\d+)\.(.+)$")
_EXPERT = re.compile(r"^mlp\.experts\.local_experts\.(\d+)\.(.+)$")
TIED_OUTPUT = "output_layer.weight"
EMBEDDING = "embedding.word_embeddings.weight"


def tp_partition(param: torch.Tensor) -> Optional[Tuple[int, int]]:
    """``(partition_dim, partition_stride)`` of a TP-split parameter, None for a replicated one."""
    if not getattr(param, "tensor_model_parallel", False):
        return None
    return int(param.partition_dim), int(getattr(param, "partition_stride", 1))


def shard_tensor(full: torch.Tensor, dim: int, stride: int, rank: int, size: int) -> torch.Tensor:
    """This rank's shard: split ``dim`` into ``size*stride`` chunks, take chunks rank, rank+size, ..."""
    if full.shape[dim] % (size * stride):
        raise ValueError(f"dim {dim} of shape {tuple(full.shape)} is not divisible by "
                         f"tp_size*stride={size}*{stride}")
    chunk = full.shape[dim] // (size * stride)
    pieces = torch.split(full, chunk, dim=dim)[rank::size]
    return torch.cat(pieces, dim=dim)


def unshard_tensors(shards: List[torch.Tensor], dim: int, stride: int) -> torch.Tensor:
    """Inverse of :func:`shard_tensor` given every rank's shard in rank order."""
    per_rank = [torch.chunk(s, stride, dim=dim) for s in shards]
    return torch.cat([per_rank[r][s] for s in range(stride) for r in range(len(shards))], dim=dim)


def unwrap_model(model: torch.nn.Module) -> torch.nn.Module:
    """Strip DDP / Float16Module wrappers (anything exposing ``.module``)."""
    while hasattr(model, "module") and isinstance(model.module, torch.nn.Module):
        model = model.module
    return model


def layer_offsets(model: torch.nn.Module) -> Dict[int, int]:
    """Local decoder-layer index -> global layer index, from each layer's ``layer_number``."""
    decoder = getattr(unwrap_model(model), "decoder", None)
    if decoder is None:
        return {}
    return {j: int(layer.layer_number) - 1 for j, layer in enumerate(decoder.layers)}


def expert_indices(model: torch.nn.Module) -> Dict[int, List[int]]:
    """Local decoder-layer index -> global indices of its local experts (MoE layers only)."""
    decoder = getattr(unwrap_model(model), "decoder", None)
    if decoder is None:
        return {}
    return {j: list(layer.mlp.local_expert_indices) for j, layer in enumerate(decoder.layers)
            if hasattr(getattr(layer, "mlp", None), "local_expert_indices")}


def to_global_name(local_name: str, offsets: Dict[int, int],
                   experts: Optional[Dict[int, List[int]]] = None) -> str:
    """Local -> global layer index (pipeline stage offset) and expert index (expert parallelism)."""
    m = _LAYER.match(local_name)
    if m is None:
        return local_name
    j, rest = int(m.group(1)), m.group(2)
    e = _EXPERT.match(rest)
    if e is not None and experts and j in experts:
        rest = f"mlp.experts.local_experts.{experts[j][int(e.group(1))]}.{e.group(2)}"
    return f"decoder.layers.{offsets[j]}.{rest}"


def global_named_parameters(model: torch.nn.Module) -> Iterator[Tuple[str, torch.nn.Parameter]]:
    """``(global megatron name, parameter)`` for one (possibly wrapped) model chunk."""
    inner = unwrap_model(model)
    offsets, experts = layer_offsets(inner), expert_indices(inner)
    for name, param in inner.named_parameters():
        yield to_global_name(name, offsets, experts), param


def is_expert_param(param: torch.Tensor) -> bool:
    """megatron marks expert-parallel parameters with ``allreduce=False``."""
    return not getattr(param, "allreduce", True)


def _groups(tp_group):
    """(dense TP group, expert TP group); the latter is megatron's expert-tensor-parallel group."""
    from megatron.core import parallel_state

    if tp_group is None:
        tp_group = parallel_state.get_tensor_model_parallel_group()
    expert_tp = parallel_state.get_expert_tensor_parallel_group(check_initialized=False)
    return tp_group, (expert_tp if expert_tp is not None else tp_group)


def _group_for(param: torch.Tensor, groups) -> object:
    return groups[1] if is_expert_param(param) else groups[0]


def _local_shard(full: torch.Tensor, param: torch.Tensor, group) -> torch.Tensor:
    part = tp_partition(param)
    size = dist.get_world_size(group)
    if part is None or size == 1:
        return full
    return shard_tensor(full, part[0], part[1], dist.get_rank(group), size)


def load_megatron_state_into(model_chunks: List[torch.nn.Module],
                             megatron_iter: Iterable[Tuple[str, torch.Tensor]],
                             tied_embeddings: bool, tp_group=None) -> List[str]:
    """Copy full tensors (global Megatron names) into this rank's parameter shards.

    Tensors for other pipeline stages are skipped. With tied embeddings the last stage's
    ``output_layer.weight`` copy is filled from ``embedding.word_embeddings.weight``. Raises
    ValueError naming any shape mismatch, any tensor given twice, and any parameter of this rank
    left unfilled. Returns the names filled.
    """
    groups = _groups(tp_group)
    targets: Dict[str, List[Tuple[str, torch.nn.Parameter]]] = {}
    for chunk in model_chunks:
        for gname, param in global_named_parameters(chunk):
            key = EMBEDDING if (tied_embeddings and gname == TIED_OUTPUT) else gname
            targets.setdefault(key, []).append((gname, param))
    filled, given = set(), set()
    for name, full in megatron_iter:
        if name in given:
            raise ValueError(f"Megatron tensor {name!r} produced twice")
        given.add(name)
        for gname, param in targets.get(name, []):
            group = _group_for(param, groups)
            local = _local_shard(full, param, group)
            if local.shape != param.shape:
                raise ValueError(f"{gname!r}: full tensor {tuple(full.shape)} gives shard "
                                 f"{tuple(local.shape)} on TP rank {dist.get_rank(group)}/"
                                 f"{dist.get_world_size(group)}, parameter is {tuple(param.shape)}")
            with torch.no_grad():
                param.copy_(local.to(param.dtype))
            filled.add(gname)
    missing = [g for entries in targets.values() for g, _ in entries if g not in filled]
    if missing:
        raise ValueError(f"{len(missing)} Megatron parameter(s) of this rank were not filled: {missing}")
    return sorted(filled)


def _grad_of(param: torch.Tensor) -> Optional[torch.Tensor]:
    grad = getattr(param, "main_grad", None)
    return grad if grad is not None else param.grad


def gather_full_tensors(model_chunks: List[torch.nn.Module], what: str = "param",
                        tp_group=None) -> Iterator[Tuple[str, torch.Tensor]]:
    """``(global name, full tensor)`` for every parameter of this rank's stage (and, for MoE, its
    own experts), all-gathered over the (expert-)tensor-parallel group.

    ``what``: "param" or "grad" (``main_grad`` under megatron DDP, else ``.grad``). Collective
    over the TP group: every TP rank must iterate it to the end in the same order.
    """
    if what not in ("param", "grad"):
        raise ValueError(f"what must be 'param' or 'grad', got {what!r}")
    groups = _groups(tp_group)
    for chunk in model_chunks:
        for gname, param in global_named_parameters(chunk):
            local = param.detach() if what == "param" else _grad_of(param)
            if local is None:
                raise ValueError(f"{gname!r} has no gradient")
            local = local.detach().reshape(param.shape)
            part = tp_partition(param)
            group = _group_for(param, groups)
            size = dist.get_world_size(group)
            if part is None or size == 1:
                yield gname, local.clone()
                continue
            shards = [torch.empty_like(local) for _ in range(size)]
            dist.all_gather(shards, local.contiguous(), group=group)
            yield gname, unshard_tensors(shards, part[0], part[1])


# ---------------------------------------------------------------------------------------------
# Bucketed export: one collective per bucket, straight into a flat buffer
# ---------------------------------------------------------------------------------------------
@dataclass
class FlatBucket:
    """Tensors back to back in one uint8 buffer (SGLang's ``flattened_bucket`` layout: no padding,
    each tensor at ``offsets[i]``)."""

    names: List[str]
    dtypes: List[torch.dtype]
    shapes: List[Tuple[int, ...]]
    offsets: List[int]
    flat: torch.Tensor
    # Set by a consumer that still reads ``flat`` after asking for the next bucket (e.g. an
    # asynchronous send): :func:`iter_flat_buckets` calls it before it writes this buffer again,
    # or lets another rank write it, and before it finishes.
    release: Optional[Callable[[], None]] = field(default=None, repr=False, compare=False)

    @property
    def nbytes(self) -> int:
        return self.flat.numel()

    def tensor(self, i: int) -> torch.Tensor:
        n = math.prod(self.shapes[i]) * self.dtypes[i].itemsize
        return self.flat[self.offsets[i]:self.offsets[i] + n].view(self.dtypes[i]).view(self.shapes[i])

    def named_tensors(self) -> List[Tuple[str, torch.Tensor]]:
        """Views into ``flat`` (valid while the buffer is; see ``reuse`` of :func:`iter_flat_buckets`)."""
        return [(n, self.tensor(i)) for i, n in enumerate(self.names)]


@dataclass
class _Item:
    lname: str
    chunk: int
    local: torch.Tensor  # this rank's shard (param.shape), source dtype
    wire: torch.dtype
    part: Optional[Tuple[int, int]]  # (dim, stride) when split over a group of size > 1
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


class BucketHandoff:
    """The bucket last handed to the consumer of a reused buffer (:func:`iter_flat_buckets`, the
    weight sync's own flattening): :meth:`settle` waits until the consumer let go of it (its
    ``release``) -- before the buffer is written again, and at the end of the export."""

    def __init__(self):
        self.prev: Optional[FlatBucket] = None

    def give(self, bucket: FlatBucket) -> FlatBucket:
        self.prev = bucket
        return bucket

    def settle(self) -> None:
        b, self.prev = self.prev, None
        if b is not None and b.release is not None:
            release, b.release = b.release, None
            release()


class ExportBuffers:
    """Scratch memory of :func:`iter_flat_buckets` that outlives one export: pass the same object
    to every ``iter_flat_buckets(..., reuse=True, buffers=...)`` call (the weight sync keeps one
    per :class:`~megatron_tepo.rollout.weight_sync.WeightSync`) and the buckets' buffers are
    allocated, and page-faulted, once instead of at every push -- on CPU a fresh 64-256 MiB buffer
    costs about as much to fault in as to fill. Cost: the memory stays held between exports
    (about two buckets per rank); :meth:`close` frees it. Holds the shared-memory buckets of
    co-located TP ranks too (see :func:`iter_flat_buckets`)."""

    def __init__(self):
        self.held: Dict[object, torch.Tensor] = {}

    @property
    def nbytes(self) -> int:
        return sum(t.numel() for t in self.held.values())

    def close(self) -> None:
        self.held.clear()


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
            return torch.empty(nbytes, dtype=torch.uint8, device=self.device)
        key = (role, str(self.device))
        buf = self.held.get(key)
        if buf is None or buf.numel() < nbytes:
            self.held.pop(key, None)
            del buf
            buf = self.held[key] = torch.empty(max(nbytes, self.caps.get(role, 0)), dtype=torch.uint8,
                                               device=self.device)
        return buf[:nbytes]

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
    c = shards[0].shape[dim] // stride
    pieces = [s.narrow(dim, j * c, c) for j in range(stride) for s in shards] if stride > 1 else list(shards)
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

    ``layout_fn(global megatron name, full shape)``: :class:`..common.MegatronToHFLayout`.
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
    from megatron.core import parallel_state

    handoff, reuse, buffers = kw["handoff"], kw["reuse"], kw["keep"]
    pp_group = parallel_state.get_pipeline_model_parallel_group(check_initialized=False)
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
    from megatron.core import parallel_state

    handoff = handoff or BucketHandoff()

    groups = _groups(tp_group)
    ep_group = parallel_state.get_expert_model_parallel_group(check_initialized=False) if all_experts else None
    ep = dist.get_world_size(ep_group) if ep_group is not None else 1
    me = dist.get_rank()
    gather_mode = dst is not None

    items: List[_Item] = []
    chunk_offsets = []
    for ci, chunk in enumerate(model_chunks):
        inner = unwrap_model(chunk)
        offsets, experts = layer_offsets(inner), expert_indices(inner)
        chunk_offsets.append(offsets)
        for lname, param in inner.named_parameters():
            gname = to_global_name(lname, offsets, experts)
            local = param.detach() if what == "param" else _grad_of(param)
            if local is None:
                raise ValueError(f"{gname!r} has no gradient")
            local = local.detach().reshape(param.shape)
            expert = is_expert_param(param)
            group = _group_for(param, groups)
            size = dist.get_world_size(group)
            part = tp_partition(param) if size > 1 else None
            full = list(param.shape)
            if part is not None:
                full[part[0]] *= size
            layout = layout_fn(gname, full)
            if not layout:
                continue
            wire = dtype if (dtype is not None and local.is_floating_point()) else local.dtype
            items.append(_Item(lname, ci, local, wire, part, group, size, tuple(full), layout, expert))

    ep_stage = ep > 1 and any(it.expert for it in items)
    # who takes part, per kind (the same answer on every member of each group involved)
    dense_tp = groups[0]
    if not gather_mode:
        need = {False: True, True: True}
    else:
        dense_n = dist.get_world_size(dense_tp)
        need_dense = dst in _ranks(dense_tp) if dense_n > 1 else me == dst
        if ep_stage:
            # an expert-TP all-gather involves ranks of other EP groups: all of them take part
            need_exp = dist.get_world_size(groups[1]) > 1 or dst in _ranks(ep_group)
        else:
            etp = groups[1]
            need_exp = dst in _ranks(etp) if dist.get_world_size(etp) > 1 else me == dst
        need = {False: need_dense, True: need_exp}
    # every EP rank's expert indices (to name the experts the EP collective brings)
    stage2 = ep_stage and (not gather_mode or dst in _ranks(ep_group))
    ep_maps = None
    if stage2:
        mine = [expert_indices(unwrap_model(c)) for c in model_chunks]
        ep_maps = [None] * ep
        dist.all_gather_object(ep_maps, mine, group=ep_group)

    # buckets: planned over ALL items (same boundaries on every rank of a stage), kinds never mixed
    plan: List[List[_Item]] = []
    cur, size_b = [], 0
    for it in items:
        nb = it.full_bytes * (ep if (it.expert and ep_stage) else 1)
        if cur and (cur[0].expert != it.expert or size_b + nb > bucket_bytes or size_b % it.wire.itemsize):
            plan.append(cur)
            cur, size_b = [], 0
        cur.append(it)
        size_b += nb
    if cur:
        plan.append(cur)

    device = _device_of(model_chunks)
    # co-located CPU ranks: dense buckets assembled in shared memory by every TP rank (see the
    # docstring of iter_flat_buckets); only buckets whose items unshard along dim 0 or need no
    # row ranges (every family here; the fallback is the collective path)
    shm_ok = [not bucket[0].expert and bucket[0].size > 1 and all(
        it.part is None or it.part[0] == 0 or all(r is None for _, r in it.layout) for it in bucket)
        for bucket in plan]
    caps: Dict[str, int] = {}
    shm_cap = max((_out_bytes(b) for b, ok in zip(plan, shm_ok) if ok), default=0)
    use_shm = False
    if gather_mode and reuse and need[False] and shm_cap:
        held = sum(t.numel() for k, t in (keep.held.items() if keep is not None else ())
                   if k[0] == "shared")
        use_shm = _colocated(dense_tp, dst, max(0, 2 * shm_cap - held), device)
    for bucket, ok in zip(plan, shm_ok):
        if ok and use_shm:
            caps["shared"] = max(caps.get("shared", 0), _out_bytes(bucket))
            continue
        if need[bucket[0].expert]:
            send = sum(it.local_bytes for it in bucket if it.part is not None)
            out = _out_bytes(bucket)
            roles = {"send": send, "recv": send * bucket[0].size}
            roles.update({"local_out": out, "out": out * ep} if bucket[0].expert and ep_stage else {"out": out})
            for role, n in roles.items():
                caps[role] = max(caps.get(role, 0), n)
    bufs = _Buffers(reuse, caps, device, keep)
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
