"""The ``tensor`` weight sync: per bucket one ``/update_weights_from_tensor`` with
``load_format="flattened_bucket"``: the bucket copied into one shared-memory buffer, serialised by
``ForkingPickler`` with its layout, one entry of ``serialized_named_tensors`` per TP rank of the
server (its worker r reads entry r). The servers map the buffer, so they must be on the sender's
host. It is what a fleet uses when the trainer set no other up. The serialisation and the request
are shared with the ``ipc`` mode (``ipc.py``), which sends each TP rank a handle of an actor
rank's own bucket instead of a copy.

Left out: what every mode shares (``base.py``); servers on other hosts (use ``distributed`` or
``disk``).
"""
from __future__ import annotations

import base64
import io
import math
from contextlib import contextmanager
from typing import List

import torch

from megatron_tepo.buckets import FlatBucket

from .base import WeightSync

UPDATE_ROUTE = "/update_weights_from_tensor"


@contextmanager
def file_system_sharing():
    """torch's ``file_system`` sharing strategy while it lasts: a CPU tensor's shared memory is a
    named file, which an unrelated process (the server) can map from its pickled handle (both for
    allocating the memory and for pickling its handle). CUDA tensors are shared by CUDA IPC either way."""
    import torch.multiprocessing  # noqa: F401 -- registers the tensor reductions

    old = torch.multiprocessing.get_sharing_strategy()
    torch.multiprocessing.set_sharing_strategy("file_system")
    try:
        yield
    finally:
        torch.multiprocessing.set_sharing_strategy(old)


def serialize_bucket(flat: torch.Tensor, bucket: FlatBucket, pickler=None) -> str:
    """One entry of ``serialized_named_tensors`` for SGLang's ``flattened_bucket`` load: ``flat``
    (the bucket's bytes: a shared-memory tensor on CPU, a CUDA tensor for IPC) as a handle, not its
    bytes, with the bucket's layout; pickled by ``pickler`` (default ``ForkingPickler``), base64.
    Call it inside :func:`file_system_sharing`."""
    from multiprocessing.reduction import ForkingPickler
    from types import SimpleNamespace

    # (SimpleNamespace: a type SGLang's restricted unpickler admits, read by attribute)
    meta = [SimpleNamespace(name=n, shape=tuple(sh), dtype=d, start_idx=o, numel=math.prod(sh) * d.itemsize,
                            end_idx=o + math.prod(sh) * d.itemsize)
            for n, d, sh, o in zip(bucket.names, bucket.dtypes, bucket.shapes, bucket.offsets)]
    buf = io.BytesIO()
    (pickler or ForkingPickler)(buf).dump({"flattened_tensor": flat, "metadata": meta})
    return base64.b64encode(buf.getvalue()).decode()


def tensor_request(entries: List[str]) -> dict:
    """The ``/update_weights_from_tensor`` payload of one bucket: ``entries[r]`` for TP worker r
    (SGLang's ``deserialize_own_rank``), loaded as a flattened bucket, no cache flush per bucket."""
    return {"serialized_named_tensors": list(entries), "load_format": "flattened_bucket", "flush_cache": False}


class TensorSync(WeightSync):
    mode = "tensor"

    def _send(self, bucket: FlatBucket, servers) -> None:
        """The bucket's bytes in one shared-memory buffer and its layout,
        ``load_format="flattened_bucket"``; all servers load it concurrently."""
        with file_system_sharing():
            # (one per bucket: a reused one is unlinked once the server lets go of its mapping)
            shm = torch.empty(bucket.nbytes, dtype=torch.uint8).share_memory_()
            shm.copy_(bucket.flat)
            data = serialize_bucket(shm, bucket)
        # SGLang's TP worker r deserialises entry r (``deserialize_own_rank``): one per rank
        loading = self._start_each(UPDATE_ROUTE, [(s, tensor_request([data] * self._tp_size(s))) for s in servers])
        try:
            self._join(*loading, UPDATE_ROUTE)
        finally:
            del shm
