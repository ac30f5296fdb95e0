"""The bucketed weight stream between the actor and the rollout engines: tensors back to back in
flat buffers (SGLang's ``flattened_bucket`` layout), the stream type that hands them over, the
hand-over of a reused buffer, and the bucket as a safetensors file.

Pure torch, shared by both sides: the actor's export (:mod:`megatron_tepo.actor.export`) is a
:class:`BucketStream` of :class:`FlatBucket` s, the engines read it (the embedded engine through
:func:`megatron_tepo.rollout.engine.gathered_tensors`, the SGLang weight sync,
:mod:`megatron_tepo.rollout.sglang.weight_sync`, as buckets); any other ``(name, tensor)`` stream
is grouped and flattened here (:func:`iter_buckets`, :func:`to_flat_bucket`).

Left out: how buckets are gathered across ranks (the actor's export) and how they travel (the
weight sync modes); safetensors *reading* (``megatron_tepo/checkpoint/hf_io.py``).
"""
from __future__ import annotations

import abc
import json
import math
import struct
from dataclasses import dataclass, field
from typing import Callable, Dict, Iterable, Iterator, List, Optional, Tuple

import torch

from megatron_tepo.dtypes import SAFETENSORS_NAMES

__all__ = ["FlatBucket", "BucketStream", "BucketHandoff", "ExportBuffers", "BucketTransform", "WireDtype",
           "tensor_bytes", "iter_buckets", "flatten_bucket", "to_flat_bucket", "write_safetensors", "host_bytes"]

NamedTensors = Iterable[Tuple[str, torch.Tensor]]


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
    # asynchronous send): the export calls it before it writes this buffer again, or lets another
    # rank write it, and before it finishes.
    release: Optional[Callable[[], None]] = field(default=None, repr=False, compare=False)

    @property
    def nbytes(self) -> int:
        return self.flat.numel()

    def tensor(self, i: int) -> torch.Tensor:
        n = math.prod(self.shapes[i]) * self.dtypes[i].itemsize
        return self.flat[self.offsets[i]:self.offsets[i] + n].view(self.dtypes[i]).view(self.shapes[i])

    def named_tensors(self) -> List[Tuple[str, torch.Tensor]]:
        """Views into ``flat`` (valid while the buffer is; see ``reuse`` of ``iter_flat_buckets``)."""
        return [(n, self.tensor(i)) for i, n in enumerate(self.names)]


class BucketTransform:
    """A stage between the actor's export and what the engines receive: the place for, e.g., an
    FP8 rollout (quantize each weight of a bucket and add its scales as tensors of the bucket).

    ``cast``: the dtype the floating tensors take before any collective (None: as they are), so
    that the shards travel in it; ``__call__(bucket) -> bucket``: on the sending rank, once a bucket
    is gathered, before it is sent. A transform that returns a new bucket keeps the one it was given
    readable until it returns (the export may reuse that buffer for the next bucket) and copies its
    ``release``. The weight sync applies its transforms in order (``WeightSync(transforms=...)``);
    the wire dtype (``rollout.sync_dtype``) is the first, :class:`WireDtype`."""

    cast: Optional[torch.dtype] = None

    def __call__(self, bucket: "FlatBucket") -> "FlatBucket":
        return bucket


class WireDtype(BucketTransform):
    """Floating tensors sent in ``dtype`` (``rollout.sync_dtype``): cast on every rank before the
    collectives (``cast``), so the gathered bucket passes unchanged."""

    def __init__(self, dtype: torch.dtype):
        self.cast = dtype

    def __repr__(self) -> str:
        return f"WireDtype({self.cast})"


class BucketStream(abc.ABC):
    """A weight stream that comes as flat buckets (the actor's export,
    :class:`~megatron_tepo.actor.export.HFExport`): what a weight update hands the engines when it
    can bucket itself. A consumer that knows the type asks it for buckets -- gathered to the one
    rank that sends, cast to the wire dtype before any collective, in reused buffers -- instead of
    reading ``(name, tensor)`` pairs; iterating it gives the pairs of every bucket. Collective
    where the export is: every rank must read it to the end, the same way."""

    @abc.abstractmethod
    def flat_buckets(self, bucket_bytes: Optional[int] = None, dtype: Optional[torch.dtype] = None,
                     dst: Optional[int] = None, reuse: bool = False,
                     buffers: Optional["ExportBuffers"] = None) -> Iterator[FlatBucket]:
        """Buckets of at most ``bucket_bytes`` (None: the stream's own size), floating tensors cast
        to ``dtype``; ``dst``: gathered to that global rank only (the others yield nothing), None:
        every rank gets its own part (the actor: its pipeline stage); ``reuse``: one buffer rewritten from bucket to bucket (a bucket is valid
        until the next is asked for; see :class:`BucketHandoff`), kept across calls in
        ``buffers``."""

    def __iter__(self) -> Iterator[Tuple[str, torch.Tensor]]:
        for bucket in self.flat_buckets():
            yield from bucket.named_tensors()


class BucketHandoff:
    """The bucket last handed to the consumer of a reused buffer (the actor's export, the weight
    sync's own flattening): :meth:`settle` waits until the consumer let go of it (its
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
    """Scratch memory of the actor's export that outlives one export: pass the same object to every ``iter_flat_buckets(..., reuse=True, buffers=...)`` call (the weight sync keeps one
    per :class:`~megatron_tepo.rollout.sglang.weight_sync.WeightSync`) and the buckets' buffers are
    allocated, and page-faulted, once instead of at every push -- on CPU a fresh 64-256 MiB buffer
    costs about as much to fault in as to fill. Cost: the memory stays held between exports
    (about two buckets per rank); :meth:`close` frees it. Holds the shared-memory buckets of
    co-located TP ranks too (see ``iter_flat_buckets``)."""

    def __init__(self):
        self.held: Dict[object, torch.Tensor] = {}

    @property
    def nbytes(self) -> int:
        return sum(t.numel() for t in self.held.values())

    def close(self) -> None:
        self.held.clear()


# ---------------------------------------------------------------------- any other stream
def tensor_bytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def iter_buckets(named_tensors: NamedTensors, bucket_bytes: int,
                 wire_dtype: Optional[torch.dtype] = None,
                 align: bool = False) -> Iterator[List[Tuple[str, torch.Tensor]]]:
    """Group the stream into lists of at most ``bucket_bytes`` (a bigger tensor goes alone).

    ``wire_dtype`` casts floating tensors; ``align`` closes a bucket early when the next tensor's
    byte offset would not be a multiple of its item size (needed by flattened buckets)."""
    if bucket_bytes <= 0:
        raise ValueError(f"bucket_bytes must be > 0, got {bucket_bytes}")
    bucket: List[Tuple[str, torch.Tensor]] = []
    size = 0
    for name, t in named_tensors:
        t = t.detach()
        if wire_dtype is not None and t.is_floating_point() and t.dtype != wire_dtype:
            t = t.to(wire_dtype)
        t = t.contiguous()
        nb = tensor_bytes(t)
        misaligned = align and size % t.element_size() != 0
        if bucket and (size + nb > bucket_bytes or misaligned):
            yield bucket
            bucket, size = [], 0
        bucket.append((name, t))
        size += nb
    if bucket:
        yield bucket


def flatten_bucket(bucket: List[Tuple[str, torch.Tensor]], out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """The bytes of the bucket's tensors back to back (SGLang's ``flattened_bucket`` layout), in
    ``out[:total]`` when given (a reused uint8 buffer at least that large)."""
    total = sum(tensor_bytes(t) for _, t in bucket)
    flat = torch.empty(total, dtype=torch.uint8, device=bucket[0][1].device) if out is None else out[:total]
    off = 0
    for _, t in bucket:
        nb = tensor_bytes(t)
        flat[off:off + nb].copy_(t.reshape(-1).view(torch.uint8))
        off += nb
    return flat


def to_flat_bucket(bucket: List[Tuple[str, torch.Tensor]], out: Optional[torch.Tensor] = None) -> FlatBucket:
    offsets, off = [], 0
    for _, t in bucket:
        offsets.append(off)
        off += tensor_bytes(t)
    return FlatBucket([n for n, _ in bucket], [t.dtype for _, t in bucket], [tuple(t.shape) for _, t in bucket],
                      offsets, flatten_bucket(bucket, out))


# ---------------------------------------------------------------------- the bucket as a file
def host_bytes(flat: torch.Tensor, staging: Optional[torch.Tensor] = None) -> torch.Tensor:
    """``flat``'s bytes in host memory: ``flat`` itself when it is on the CPU (no copy); else one
    copy into ``staging[:n]`` when that host buffer is large enough, or into a new host buffer,
    pinned where CUDA is available (the device-to-host copy then runs at full speed, with no
    bounce through pageable memory)."""
    if flat.device.type == "cpu":
        return flat
    n = flat.numel()
    if staging is None or staging.numel() < n:
        staging = torch.empty(n, dtype=torch.uint8, pin_memory=torch.cuda.is_available())
    out = staging[:n]
    out.copy_(flat)
    return out


def write_safetensors(bucket: FlatBucket, path: str, staging: Optional[torch.Tensor] = None) -> None:
    """The bucket as one safetensors file: a JSON header, then the flat buffer as it is (the
    format's data section is exactly tensors back to back), so no per-tensor copy is made. A
    buffer on another device (a GPU) is copied once into host memory first (``staging``, see
    :func:`host_bytes`)."""
    header = {n: {"dtype": SAFETENSORS_NAMES[d], "shape": list(s), "data_offsets": [o, o + math.prod(s) * d.itemsize]}
              for n, d, s, o in zip(bucket.names, bucket.dtypes, bucket.shapes, bucket.offsets)}
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(raw)))
        f.write(raw)
        f.write(memoryview(host_bytes(bucket.flat, staging).numpy()))
