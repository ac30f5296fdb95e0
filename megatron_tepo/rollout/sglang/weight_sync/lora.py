"""The ``adapters`` weight sync of a LoRA run (``actor.lora.sync: adapters``): after every update
only the LoRA adapters go to the servers, in PEFT's names and format
(``base_model.model.model.layers.N.self_attn.q_proj.lora_A.weight`` ...,
``megatron_tepo/megatron/lora_peft.py``), through SGLang's ``/load_lora_adapter_from_tensors``; the
servers keep their frozen base weights and apply the adapter to the requests that name it.

Each push loads the adapters as a new version, ``<prefix>-<n>``, then unloads the previous one
from every server process that holds it (a server restarted since holds none; an unload that fails
is a warning: the new adapter is in) (two adapters are loaded for a moment: the servers are started with two per batch,
``options.py:lora_flags``), and names the new one to the fleet (``target.lora_name``), whose
``/generate`` requests then carry it as ``lora_path`` (``dispatch.py``; a request interrupted by
the update and continued takes the new one). The servers are paused around it, and their cache
flushed, as every mode does (``base.py``). The tensors travel as one flat bucket in shared memory
(``load_format="flattened_bucket"``, the ``tensor`` mode's serialisation), so the servers must be
on the sender's host. The push's input is the actor's ``export_adapters()``: the sender holds
every adapter (a list of ``(PEFT name, tensor)`` with the adapter's PEFT ``config``), every other
rank an empty one (the export gathered them to the sender).

Left out: servers on other hosts (``/load_lora_adapter`` from a folder they read would serve them),
SGLang releases without ``/load_lora_adapter_from_tensors`` (a 404 is an error naming the route);
the embedded engine (it takes the merged weights: ``config/validation.py`` refuses ``adapters``
there).
"""
from __future__ import annotations

import logging
import time
from typing import Dict, Iterable, Optional, Tuple

import torch

from megatron_tepo.buckets import FlatBucket, tensor_bytes, to_flat_bucket

from .base import SyncStats, WeightSync
from .tensor import file_system_sharing, serialize_bucket

log = logging.getLogger(__name__)

LOAD_ROUTE, UNLOAD_ROUTE = "/load_lora_adapter_from_tensors", "/unload_lora_adapter"


class LoraAdapterSync(WeightSync):
    """Pushes a LoRA adapter (PEFT names) to every live server as a new served adapter and makes
    the fleet's requests name it. ``prefix``: the served names' (``<prefix>-<version>``)."""

    mode = "adapters"
    session = False  # no base weight changes: no weight-update session

    def __init__(self, target, *, prefix: str = "policy", **options):
        super().__init__(target, **options)
        self.prefix, self.version = prefix, 0
        self.loaded: Optional[str] = None
        self._loaded_on: Dict[Tuple[str, int], str] = {}  # (server URL, incarnation) -> its adapter

    def push(self, named_tensors: Iterable, flush_cache: bool = True) -> SyncStats:
        if not self.is_sender:  # the export gathered everything to the sender already
            for _ in named_tensors:
                pass
            return SyncStats(self.mode)
        return super().push(named_tensors, flush_cache)

    def _push_paused(self, named_tensors, stats: SyncStats, servers, flush_cache: bool) -> None:
        config = getattr(named_tensors, "config", None)
        if not isinstance(config, dict) or config.get("peft_type") != "LORA":
            raise ValueError("weight sync (adapters): the stream is not a PEFT LoRA adapter with its config "
                             "(the actor's export_adapters())")
        t = time.perf_counter()
        named = [(n, x.detach().to(self.wire_dtype) if self.wire_dtype is not None and x.is_floating_point() else
                  x.detach()) for n, x in named_tensors]
        stats.export_seconds += time.perf_counter() - t
        if not named:
            raise ValueError("weight sync (adapters): no adapter tensor to send")
        total = sum(tensor_bytes(x) for _, x in named)
        with file_system_sharing():
            # (one per push: the servers copy the adapter into their LoRA memory pool)
            shm = torch.empty(total, dtype=torch.uint8).share_memory_()
            bucket: FlatBucket = to_flat_bucket(named, shm)
            data = serialize_bucket(shm, bucket)
        name = f"{self.prefix}-{self.version + 1}"
        try:
            posts = [(s, {"lora_name": name, "config_dict": config, "load_format": "flattened_bucket",
                          "serialized_named_tensors": [data] * self._tp_size(s)}) for s in servers]
            self._join(*self._start_each(LOAD_ROUTE, posts), LOAD_ROUTE)
        finally:
            del shm
        self.version += 1
        self.loaded = name
        self.target.lora_name = name  # the fleet's requests name the new adapter from now on
        # the previous version, where this server process holds one (a restarted server holds none)
        unload = []
        for s in servers:
            key = (s.url, getattr(s, "incarnation", 0))
            old, self._loaded_on[key] = self._loaded_on.get(key), name
            if old is not None:
                unload.append((s, {"lora_name": old}))
        threads, errors = self._start_each(UNLOAD_ROUTE, unload)
        for t in threads:
            t.join()
        for url, err in errors.items():  # the new adapter is in; an old one left loaded costs memory only
            log.warning("weight sync (adapters): %s did not unload the previous adapter: %s", url, err)
        stats.bytes += bucket.nbytes
        stats.tensors += len(bucket.names)
        stats.buckets += 1
        stats.peak_bucket_bytes = max(stats.peak_bucket_bytes, bucket.nbytes)
        if flush_cache:
            self._flush(servers)

    def _send(self, bucket: FlatBucket, servers) -> None:  # (push sends the adapter whole)
        raise NotImplementedError
