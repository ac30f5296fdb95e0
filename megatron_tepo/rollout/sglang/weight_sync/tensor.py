"""The ``tensor`` weight sync: per bucket one ``/update_weights_from_tensor`` with
``load_format="flattened_bucket"``: the bucket copied into one shared-memory buffer, serialised by
``ForkingPickler`` with its layout, one entry of ``serialized_named_tensors`` per TP rank of the
server (its worker r reads entry r). The servers map the buffer, so they must be on the sender's
host. It is what a fleet uses when the trainer set no other up.

Left out: what every mode shares (``base.py``); servers on other hosts (use ``distributed`` or
``disk``).
"""
from __future__ import annotations

import base64
import io
import math

from megatron_tepo.buckets import FlatBucket

from .base import WeightSync


class TensorSync(WeightSync):
    mode = "tensor"

    def _send(self, bucket: FlatBucket, servers) -> None:
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
        # SGLang's TP worker r deserialises entry r (``deserialize_own_rank``): one per rank
        loading = self._start_each("/update_weights_from_tensor", [
            (s, {"serialized_named_tensors": [data] * self._tp_size(s), "load_format": "flattened_bucket",
                 "flush_cache": False}) for s in servers])
        try:
            self._join(*loading, "/update_weights_from_tensor")
        finally:
            del shm
