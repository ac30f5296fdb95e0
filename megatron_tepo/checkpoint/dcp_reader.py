"""Reading megatron ``ShardedTensor`` regions straight from a torch_dist (PyTorch DCP) checkpoint,
parameter by parameter: what the Megatron -> HF exporter streams from
(:mod:`.megatron_to_hf`).

* :class:`DistCheckpointReader` -- reads chosen ``ShardedTensor`` regions into their ``.data``
  views with PyTorch DCP's ``FileSystemReader`` and ``create_read_items_for_chunk_list``, which
  reshards from whatever TP/PP/EP the checkpoint was saved at (megatron saves global tensors), and
  checks each region fully covered.
* :func:`params_streamed` -- ``(global name, full tensor)`` of every parameter of a TP=PP=EP=1 model
  built without init, each read when asked for and released once the consumer moves on. Peak:
  one parameter plus what the consumer keeps. The model's ``ShardedTensor`` s come from
  :func:`megatron_tepo.megatron.dist_checkpoint.sharded_tensors`.

Why not ``dist_checkpointing.load``: it loads the whole model at once, and cannot do it per
layer -- megatron-core 0.16.1's torch_dist loader rejects a partial load of its stacked
``decoder.layers.*`` tensors in a 1-process world (it places the other layers' fragments on rank
``(rank+1) % world_size`` = itself and then counts them as missing local shards).

Left out: flattened (optimizer-style) ``ShardedTensor``s (refused), bytes items (``common.pt``
state), reading with more than one process.
"""
from __future__ import annotations

from collections import Counter
from pathlib import Path

import torch

from .common import trim_heap

__all__ = ["DistCheckpointReader", "params_streamed"]


class _ReadInto:
    """The planner side of ``FileSystemReader.read_data``: each read item lands in its
    destination view (one per requested chunk); counts the elements read per destination."""

    def __init__(self, dests: dict):
        self.dests, self.filled = dests, Counter()

    def resolve_tensor(self, item):
        key = (item.dest_index.fqn, tuple(item.dest_index.offset))
        view = self.dests[key]
        for dim, (start, length) in enumerate(zip(item.dest_offsets, item.lengths)):
            view = view.narrow(dim, int(start), int(length))
        self.filled[key] += view.numel()
        return view

    def commit_tensor(self, item, tensor) -> None:
        pass

    def load_bytes(self, item, value) -> None:
        raise ValueError(f"unexpected bytes item {item.dest_index.fqn!r} requested")


class DistCheckpointReader:
    """Reads chosen megatron ``ShardedTensor`` regions straight from a torch_dist (PyTorch DCP)
    checkpoint into their ``.data`` views, one parameter at a time: the streaming alternative to
    ``dist_checkpointing.load`` of the whole model (see the module docstring). A saved tensor's
    global layout is the TP=1 layout whatever TP/PP/EP it was saved at (megatron-core's
    sharded_state_dict contract), so reading the TP=1 model's regions reshards for free."""

    def __init__(self, path):
        from torch.distributed.checkpoint import FileSystemReader

        self.path = Path(path)
        self.reader = FileSystemReader(str(path))
        self.metadata = self.reader.read_metadata()
        self.reader.set_up_storage_reader(self.metadata, is_coordinator=True)

    def read(self, sharded_tensors) -> None:
        from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, TensorStorageMetadata
        from torch.distributed.checkpoint.planner import LoadPlan
        from torch.distributed.checkpoint.planner_helpers import create_read_items_for_chunk_list

        items, dests = [], {}
        for st in sharded_tensors:
            if st.flattened_range is not None:
                raise ValueError(f"{st.key!r}: flattened (optimizer-style) tensors are not read here")
            shape = torch.Size((1,) * st.prepend_axis_num + tuple(st.data.shape))
            offsets = torch.Size(st.global_offset)
            meta = self.metadata.state_dict_metadata.get(st.key)
            if not isinstance(meta, TensorStorageMetadata):
                raise ValueError(f"Megatron checkpoint {self.path} has no tensor {st.key!r}")
            if tuple(meta.size) != tuple(st.global_shape):
                raise ValueError(f"Megatron checkpoint tensor {st.key!r} has global shape "
                                 f"{tuple(meta.size)}, the model expects {tuple(st.global_shape)}")
            dests[(st.key, tuple(offsets))] = st.data.detach().view(shape)
            items += create_read_items_for_chunk_list(
                st.key, meta, [ChunkStorageMetadata(offsets=offsets, sizes=shape)])
        into = _ReadInto(dests)
        plan = self.reader.prepare_local_plan(LoadPlan(items))
        (plan,) = self.reader.prepare_global_plan([plan])
        with torch.no_grad():
            self.reader.read_data(plan, into).wait()
        short = [k for k, d in dests.items() if into.filled[k] != d.numel()]
        if short:
            raise ValueError(f"Megatron checkpoint {self.path} does not cover region(s) "
                             f"{short[:4]} (key, offset) of the model")


def params_streamed(model, src):
    """``(global name, full tensor)`` of every parameter of the TP=PP=EP=1 ``model`` (built with
    ``initialize=False``: its ``torch.empty`` storage is never touched before this), each read
    from the checkpoint only when asked for and released from the model once the consumer asks
    for the next (the writer's shard buffer keeps what it still needs). Peak: one parameter
    plus the writer's shard -- the model's untouched storage is not resident."""
    from megatron_tepo.megatron.dist_checkpoint import sharded_tensors
    from megatron_tepo.megatron.sharding import global_named_parameters

    reader = DistCheckpointReader(src)
    sharded, sts = sharded_tensors(model)
    by_storage: dict = {}
    for st in sts:
        by_storage.setdefault(st.data.untyped_storage().data_ptr(), []).append(st)
    del sharded, sts  # their ShardedTensors view every parameter: they must not outlive their release
    for name, param in list(global_named_parameters(model)):
        sts = by_storage.pop(param.untyped_storage().data_ptr(), [])
        if sum(st.data.numel() for st in sts) != param.numel():
            raise ValueError(f"parameter {name!r} is not fully covered by the model's "
                             f"sharded_state_dict ({len(sts)} piece(s))")
        reader.read(sts)
        del sts
        yield name, param.detach()
        param.data = torch.empty(0, dtype=param.dtype)
        trim_heap()
