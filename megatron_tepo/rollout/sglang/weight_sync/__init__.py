"""The weight sync to SGLang servers: the actor's weights, bucketed, pushed to every live server
of a fleet after each update, in one of four modes, one module each over one shared base.

* ``base.py`` -- what every mode does alike: the sender and the draining ranks, the buckets (the
  actor's :class:`~megatron_tepo.buckets.BucketStream`, or any stream flattened here), the
  servers paused around the update, the weight-update session where a server has it, the
  cache flush, the statistics.
* ``distributed.py`` -- a process group between the sender and every TP worker of every server;
  one broadcast per bucket.
* ``tensor.py`` -- the bucket in shared memory, its handle posted to every server (same host).
* ``disk.py`` -- the bucket as a safetensors file in a directory the servers see.
* ``ipc.py`` -- colocated mode: each actor rank's own bucket handed to the server TP rank on its GPU
  as a CUDA IPC handle (shared memory on CPU); no process group, no copy.
* ``lora.py`` -- a LoRA run's ``actor.lora.sync: adapters``: the adapters alone, in PEFT's names, to
  SGLang's LoRA endpoints as a new served adapter each update (the base stays on the servers); used in
  place of the mode (``attach.py``), not one of ``rollout.sync_mode``.

:func:`make_weight_sync` builds the sync of a mode by its name (``rollout.sync_mode``). SGLang's
HTTP API 0.5.6 to 0.5.x: run against 0.5.23 (the ``sglang`` tests); read, not run, in the 0.5.6, 0.5.10
and 0.5.11 wheels (``entrypoints/http_server.py``, ``managers/io_struct.py``): every route and
payload field posted here is there too (``flattened_bucket`` loads of ``/update_weights_from_distributed``
and ``/update_weights_from_tensor``, ``/pause_generation`` with ``mode``, the update group's ``backend``,
``flush_cache: false``), except ``/begin_weight_update`` and ``/end_weight_update``, which none of the
three has: ``base.py`` probes them and goes on without them on a 404. ``/server_info`` (0.5.23) falls
back to ``/get_server_info`` (``client.py``).

Left out: servers with data or pipeline parallelism (SGLang refuses these updates at dp > 1),
and tensor mode across hosts.
"""
from __future__ import annotations

from .base import SyncStats, WeightSync
from .disk import DiskSync
from .distributed import DistributedSync
from .ipc import IpcSync
from .lora import LoraAdapterSync
from .tensor import TensorSync

__all__ = ["MODES", "SYNC_MODES", "make_weight_sync", "WeightSync", "SyncStats", "DistributedSync",
           "TensorSync", "DiskSync", "IpcSync", "LoraAdapterSync"]

SYNC_MODES = {"distributed": DistributedSync, "tensor": TensorSync, "disk": DiskSync, "ipc": IpcSync}
MODES = tuple(SYNC_MODES)


def make_weight_sync(mode: str, target, **options) -> WeightSync:
    """The weight sync of ``mode`` to ``target`` (a fleet: anything with ``alive_servers()``).
    ``options``: :class:`WeightSync`'s and the mode's own (``distributed``: ``backend``,
    ``master_address``, ``master_port``, ``group_name``; ``disk``: ``shared_dir``); one the mode
    does not take is an error."""
    if mode not in SYNC_MODES:
        raise ValueError(f"unknown weight sync mode {mode!r}; choose one of {MODES}")
    return SYNC_MODES[mode](target, **options)
