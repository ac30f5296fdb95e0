"""The bucketed weight stream between the actor and the rollout engines: tensors back to back in
flat buffers (SGLang's ``flattened_bucket`` layout), and the hand-over of a reused buffer.

Pure torch, shared by both sides: the actor's export (:mod:`megatron_tepo.actor.export`) produces
:class:`FlatBucket` s, the weight sync (:mod:`megatron_tepo.rollout.weight_sync`) sends them.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Callable, Dict, List, Optional, Tuple

import torch

__all__ = ["FlatBucket", "BucketHandoff", "ExportBuffers"]


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
    per :class:`~megatron_tepo.rollout.weight_sync.WeightSync`) and the buckets' buffers are
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
