"""The ``disk`` weight sync: per bucket one safetensors file in ``shared_dir`` (a file system the
servers see; the flat bucket is written as the file's data section as it is, by
:func:`megatron_tepo.buckets.write_safetensors`; a bucket on a GPU goes through one reused host
buffer, pinned), then one ``/update_weights_from_disk`` of the folder, which is removed after.
It needs no process group and no shared memory: the mode for servers the sender can only reach
through a shared file system. No weight-update session (SGLang loads from disk in one request).

Left out: what every mode shares (``base.py``); keeping the files (each push writes a fresh
folder, ``mtepo_weights_v<push>_<pid>``, and removes it once the servers loaded it).
"""
from __future__ import annotations

import os
import shutil
import tempfile
from typing import Optional

import torch

from megatron_tepo.buckets import FlatBucket, write_safetensors

from .base import WeightSync


class DiskSync(WeightSync):
    """``shared_dir``: where the files go (default ``$MTEPO_WEIGHT_SYNC_DIR``, else the temporary
    directory: fine for servers on this host)."""

    mode = "disk"
    session = False

    def __init__(self, target, shared_dir: Optional[str] = None, **common):
        super().__init__(target, **common)
        self.shared_dir = shared_dir
        self._staging: Optional[torch.Tensor] = None  # host copy of a device bucket
        self._version = 0
        self._dir: Optional[str] = None  # this push's folder
        self._files = 0

    @classmethod
    def options_from(cls, rollout, urls, fault=None) -> dict:
        return {"shared_dir": rollout.sync_dir}

    def _prepare(self, servers) -> None:
        self._version += 1
        root = self.shared_dir or os.environ.get("MTEPO_WEIGHT_SYNC_DIR") or tempfile.gettempdir()
        self._dir = os.path.join(root, f"mtepo_weights_v{self._version}_{os.getpid()}")
        shutil.rmtree(self._dir, ignore_errors=True)
        os.makedirs(self._dir)
        self._files = 0

    def _send(self, bucket: FlatBucket, servers) -> None:
        path = os.path.join(self._dir, f"model-{self._files:05d}.safetensors")
        if bucket.flat.device.type != "cpu" and (self._staging is None or self._staging.numel() < bucket.nbytes):
            self._staging = None
            self._staging = torch.empty(max(bucket.nbytes, self.bucket_bytes), dtype=torch.uint8,
                                        pin_memory=torch.cuda.is_available())
        write_safetensors(bucket, path, self._staging)
        self._files += 1

    def _commit(self, servers) -> None:
        try:
            self._post_all("/update_weights_from_disk", {"model_path": self._dir, "flush_cache": False}, servers)
        finally:
            shutil.rmtree(self._dir, ignore_errors=True)

    def close(self) -> None:
        super().close()
        self._staging = None
