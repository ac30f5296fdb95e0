"""Streaming torch_dist save: a megatron-core ``dist_checkpointing`` checkpoint written tensor by
tensor from data produced on demand, never from a filled model.

``dist_checkpointing.save(model.sharded_state_dict())`` needs every parameter of the rank filled
in memory, and megatron-core 0.16.1's torch_dist strategy then stages the tensors it writes
(``FileSystemWriterAsync.prepare_write_data`` clones every view, e.g. the gate/up halves of
``linear_fc1``, before forked writer processes serialise them): 2.26x the model at TP=1 for the
importer. Here the model is only a skeleton (built without init: its ``torch.empty`` storage is
never touched, so not resident) whose ``sharded_state_dict()`` supplies what a checkpoint is made
of -- every ``ShardedTensor``'s key, global shape, global offset, local shape, replica id (TP
splits, the fused QKV rows, the gate/up halves, stacked layers, experts, all exactly as megatron
shards them) -- and the bytes of each piece are cut from a full (TP=1 layout) Megatron tensor
only when the writer reaches that piece.

* :class:`StreamingTorchDistSave` -- a ``SaveShardedStrategy`` with backend ``torch_dist`` version
  1, handed to ``dist_checkpointing.save`` (which still does its own preprocessing, sharding
  validation, ``common.pt`` and ``metadata.json``). It translates the sharded state dict exactly
  as megatron's ``TorchDistSaveShardedStrategy`` does (main replicas only,
  ``mcore_to_pyt_state_dict``, ``MCoreSavePlanner``) and saves with PyTorch DCP's plain
  ``FileSystemWriter`` (one file per rank, one thread, no copy-ahead): items are resolved one at
  a time, in the order the planner gives them, and released once written. So the result is a
  normal torch_dist checkpoint: same keys, chunks and bytes as megatron's own save of the filled
  model (tests/checkpoint/test_convert_streaming.py compares them), loadable by
  ``dist_checkpointing.load`` at any TP/PP/EP.
* :class:`ShardSource` -- maps every ``ShardedTensor`` of the skeleton to its parameter (by
  storage) and so to the parameter's global Megatron name and the region of the full tensor it
  covers (``global_offset`` minus the prepended layer/expert axes, ``local_shape``; a parameter
  that megatron saves as several checkpoint tensors, sections of its dim 0 with their own global
  shapes -- a Gated DeltaNet's ``in_proj`` and ``conv1d`` -- by each section's place in the full
  tensor); pulls full
  tensors from a ``(global name, full tensor)`` stream (the HF mapping) until the asked one
  arrives, keeps only those this rank still has to write, and drops each as soon as its last
  piece is written. Written in layer order, that is at most about one layer.

Its user is the HF -> Megatron importer (:mod:`megatron_tepo.checkpoint.hf_to_megatron`), which
supplies the stream and saves through :func:`~megatron_tepo.megatron.dist_checkpoint.save`; this
module is megatron-core's side of it and knows nothing of HF files.

Left out: flattened (optimizer-style) ``ShardedTensor``s, async save, the metadata caching of
megatron's strategy (a one-shot conversion does not reuse plans).
"""
from __future__ import annotations

import dataclasses
import re
from collections import Counter
from typing import Callable, Dict, Iterable, Iterator, List, Optional, Tuple

import torch

__all__ = ["ShardSource", "StreamingTorchDistSave", "order_key"]

_LAYER = re.compile(r"^decoder\.layers\.(\d+)\.")
TIED_OUTPUT = "output_layer.weight"
EMBEDDING = "embedding.word_embeddings.weight"


def order_key(name: str) -> Tuple[int, int]:
    """Write order of a global Megatron name: embedding, layers in order, the rest -- the order
    the HF stream (``megatron_tepo.checkpoint.hf_io.streaming_order``) produces them in."""
    if name == EMBEDDING:
        return (0, 0)
    m = _LAYER.match(name)
    if m is not None:
        return (1, int(m.group(1)))
    return (2, 0)


def _held_bytes(t) -> int:
    held = getattr(t, "held_bytes", None)
    return t.numel() * t.element_size() if held is None else held


def _local_row(st, param) -> int:
    """The first row (dim 0) of ``param``'s local data that checkpoint tensor ``st`` views."""
    return (st.data.storage_offset() - param.storage_offset()) // max(param.stride(0), 1)


def _sections_of(entries) -> Dict[str, Tuple[Dict[int, int], int]]:
    """Parameters whose checkpoint tensors are sections of dim 0 with their own global shapes
    (megatron's ``_split_tensor_factory``: a Gated DeltaNet's ``in_proj`` as query, key, value,
    z, beta, alpha; its ``conv1d`` as query, key, value): global name -> ({local first row of a
    section: its first row in the full tensor}, the full tensor's rows). The sections follow each
    other in the full tensor in the order they do in the rank's shard."""
    by_name: Dict[str, list] = {}
    for st, _, name, param in entries:
        by_name.setdefault(name, []).append((st, param))
    out = {}
    for name, sts in by_name.items():
        shapes = {tuple(st.global_shape[st.prepend_axis_num:]) for st, _ in sts}
        if len(shapes) == 1:
            continue
        rows = sorted({(_local_row(st, p), int(st.global_shape[st.prepend_axis_num])) for st, p in sts})
        starts, at = {}, 0
        for local, size in rows:
            starts[local] = at
            at += size
        out[name] = (starts, at)
    return out


class ShardSource:
    """The data of every main-replica ``ShardedTensor`` of one rank, produced on demand.

    ``sharded_tensors``: the rank's ShardedTensors (factories applied) whose ``data`` are views of
    ``named_params`` (``(global name, parameter)``, e.g. ``global_named_parameters(model)``).
    ``tensors``: the ``(global name, full tensor)`` stream. ``dtype``: the dtype written.
    ``tied``: tied embeddings (the last stage's ``output_layer.weight`` is the embedding).
    ``materialize``: applied to a streamed tensor this rank needs before use (turns a deferred
    stand-in into something indexable that reads on ``[index]``, with ``shape``, ``is_meta`` and
    ``held_bytes``); ``on_release``: called after a full tensor is dropped (heap trim)."""

    def __init__(self, sharded_tensors, named_params, tensors: Iterable[Tuple[str, torch.Tensor]],
                 dtype: torch.dtype, tied: bool = False,
                 materialize: Optional[Callable[[torch.Tensor], torch.Tensor]] = None,
                 on_release: Optional[Callable[[], None]] = None):
        from megatron.core.dist_checkpointing.mapping import is_main_replica

        by_storage: Dict[int, Tuple[int, str, torch.Tensor]] = {}
        for pos, (name, param) in enumerate(named_params):
            by_storage[param.untyped_storage().data_ptr()] = (pos, name, param)
        self.regions: Dict[Tuple[str, tuple], Tuple[str, tuple, torch.Size]] = {}
        self.order: Dict[Tuple[str, tuple], tuple] = {}
        self.pending: Counter = Counter()  # global name -> pieces still to write on this rank
        self.expected_shape: Dict[str, tuple] = {}
        mine = []  # (st, pos, name, param) of the main replicas
        for st in sharded_tensors:
            if st.flattened_range is not None:
                raise ValueError(f"{st.key!r}: flattened ShardedTensors are not supported here")
            hit = by_storage.get(st.data.untyped_storage().data_ptr())
            if hit is None:
                raise ValueError(f"checkpoint tensor {st.key!r} (offset {st.global_offset}) is not a "
                                 f"view of any parameter of the model")
            pos, name, param = hit
            if tied and name == TIED_OUTPUT:
                name = EMBEDDING
            if not is_main_replica(st.replica_id):
                continue  # written by the rank holding the main replica
            mine.append((st, pos, name, param))
        sections = _sections_of(mine)
        for st, pos, name, param in mine:
            k = st.prepend_axis_num
            offset = [int(o) for o in st.global_offset[k:]]
            full_shape = tuple(st.global_shape[k:])
            if name in sections:  # one of several checkpoint tensors cut from the parameter's dim 0
                starts, full_rows = sections[name]
                offset[0] += starts[_local_row(st, param)]
                full_shape = (full_rows, *full_shape[1:])
            if self.expected_shape.setdefault(name, full_shape) != full_shape:
                raise ValueError(f"{name!r}: checkpoint tensors disagree on its full shape "
                                 f"({self.expected_shape[name]} vs {full_shape} for {st.key!r})")
            index = tuple(slice(o, o + int(s)) for o, s in zip(offset, st.local_shape))
            key = (st.key, tuple(int(o) for o in st.global_offset))
            if key in self.regions:
                raise ValueError(f"checkpoint tensor {st.key!r} offset {st.global_offset} appears twice")
            self.regions[key] = (name, index, torch.Size((1,) * k + tuple(st.local_shape)))
            self.order[key] = order_key(name) + (pos,) + key[1]
            self.pending[name] += 1
        self.dtype = dtype
        self.materialize = materialize
        self.on_release = on_release
        self._it: Iterator = iter(tensors)
        self._cache: Dict[str, torch.Tensor] = {}
        self._produced: set = set()
        self.bytes_written = 0
        self.peak_cached_bytes = 0

    def sort_key(self, key: str, offset) -> tuple:
        """Position of a write item (checkpoint key, global offset) in the write order."""
        return self.order.get((key, tuple(int(o) for o in offset)), (3, 0, 0))

    def _take(self, name: str) -> None:
        if name in self._produced:
            raise ValueError(f"Megatron tensor {name!r} produced twice")
        self._produced.add(name)

    def _full(self, name: str, ckpt_key: str) -> torch.Tensor:
        while name not in self._cache:
            try:
                got, tensor = next(self._it)
            except StopIteration:
                raise ValueError(f"the HF -> Megatron mapping gave no tensor {name!r} (needed for "
                                 f"checkpoint tensor {ckpt_key!r})") from None
            self._take(got)
            if self.pending.get(got, 0) > 0:
                if self.materialize is not None:
                    tensor = self.materialize(tensor)
                if tensor.is_meta:
                    raise ValueError(f"{got!r} is needed on this rank but its HF tensor(s) were not "
                                     f"read (meta stand-in)")
                if tuple(tensor.shape) != self.expected_shape[got]:
                    raise ValueError(f"{got!r}: full tensor {tuple(tensor.shape)}, the model's "
                                     f"checkpoint tensor needs {self.expected_shape[got]}")
                self._cache[got] = tensor
                cached = sum(_held_bytes(t) for t in self._cache.values())
                self.peak_cached_bytes = max(self.peak_cached_bytes, cached)
        return self._cache[name]

    def get(self, key: str, offset) -> torch.Tensor:
        """The bytes of checkpoint tensor ``key`` at global ``offset`` (shape with the prepended
        axes, ``self.dtype``); the full tensor is released after its last piece."""
        k = (key, tuple(int(o) for o in offset))
        if k not in self.regions:
            raise KeyError(f"no main-replica checkpoint tensor {key!r} at offset {k[1]} on this rank")
        name, index, shape = self.regions[k]
        piece = self._full(name, key)[index].to(self.dtype).reshape(shape)
        self.pending[name] -= 1
        if piece.untyped_storage().nbytes() != piece.numel() * piece.element_size():
            piece = piece.clone()  # compact: torch.save would write a view's whole storage
        if self.pending[name] == 0:
            del self._cache[name]
            if self.on_release is not None:
                self.on_release()
        self.bytes_written += piece.numel() * piece.element_size()
        return piece

    def finish(self) -> List[str]:
        """Drain the stream (its own end-of-stream checks run: every HF tensor used once, ...);
        every piece of this rank must have been written. Returns the names produced."""
        for name, _ in self._it:
            self._take(name)
        left = sorted(n for n, c in self.pending.items() if c > 0)
        if left:
            raise ValueError(f"{len(left)} Megatron parameter(s) of this rank were not written: {left[:8]}")
        return sorted(self._produced)


def _planner_class():
    from megatron.core.dist_checkpointing.strategies.torch import MCoreSavePlanner
    from torch.distributed.checkpoint.planner import WriteItemType

    class _StreamingPlanner(MCoreSavePlanner):
        """megatron's planner; tensor data comes from the :class:`ShardSource` and the rank's
        write items are put in layer order (the writer resolves them in plan order)."""

        def __init__(self, source: ShardSource):
            super().__init__(dedup_replicated_tensors=False, flatten_state_dict=False)
            self.source = source
            self.error: Optional[BaseException] = None

        def finish_plan(self, new_plan):
            def position(item):
                if item.type == WriteItemType.BYTE_IO:
                    return (0, ())
                return (1, self.source.sort_key(item.index.fqn, item.index.offset))

            return super().finish_plan(dataclasses.replace(new_plan, items=sorted(new_plan.items, key=position)))

        def resolve_data(self, write_item):
            if write_item.type == WriteItemType.BYTE_IO:
                return super().resolve_data(write_item)
            try:
                piece = self.source.get(write_item.index.fqn, write_item.index.offset)
                want = tuple(write_item.tensor_data.chunk.sizes)
                if tuple(piece.shape) != want:
                    raise ValueError(f"checkpoint tensor {write_item.index.fqn!r}: piece "
                                     f"{tuple(piece.shape)}, the plan expects {want}")
                return piece
            except BaseException as e:
                if self.error is None:
                    self.error = e
                raise

    return _StreamingPlanner


def _writer_class():
    import inspect
    import os

    from torch.distributed.checkpoint import FileSystemWriter
    from torch.distributed.checkpoint.filesystem import DEFAULT_SUFFIX, _write_item
    from torch.distributed.checkpoint.planner import WriteItemType
    from torch.futures import Future

    class _SerialFileSystemWriter(FileSystemWriter):
        """PyTorch DCP's ``FileSystemWriter``, but ``write_data`` writes the rank's items into one
        file strictly one at a time in plan order and keeps no reference to a written tensor
        (torch 2.13's ``_write_files_from_queue`` keeps every tensor it wrote in a dict by key
        until the file is done -- one per stacked-layer key plus the embedding, 0.2 GiB here).
        Items are serialised by DCP's own ``_write_item`` (as megatron's writer does), so the
        files are the torch_dist format."""

        def write_data(self, plan, planner):
            file_name = f"{plan.storage_data.prefix}0{DEFAULT_SUFFIX}"
            kwargs = {}
            params = inspect.signature(_write_item).parameters
            if "serialization_format" in params:
                kwargs["serialization_format"] = self.serialization_format
            transforms = [self.transforms] if "transforms" in params else []
            items = ([it for it in plan.items if it.type == WriteItemType.BYTE_IO]
                     + [it for it in plan.items if it.type != WriteItemType.BYTE_IO])
            results = []
            with self.fs.create_stream(self.fs.concat_path(self.path, file_name), "wb") as stream:
                for item in items:
                    data = planner.resolve_data(item)
                    if item.type != WriteItemType.BYTE_IO:
                        data = data.detach().cpu()
                        if data.untyped_storage().nbytes() != data.nbytes:
                            data = data.clone()
                    results.append(_write_item(*transforms, stream, data, item, file_name, **kwargs))
                    del data
                if self.sync_files:
                    os.fsync(stream.fileno())
            fut = Future()
            fut.set_result(results)
            return fut

    return _SerialFileSystemWriter


def _strategy_base():
    from megatron_tepo.megatron.compat import save_strategy_base

    return save_strategy_base()


class StreamingTorchDistSave(_strategy_base()):
    """``dist_checkpointing.save(sharded_state_dict, dir, sharded_strategy=StreamingTorchDistSave(
    source))``: writes the torch_dist format (backend ``torch_dist``, version 1) with tensor data
    from ``source`` (:class:`ShardSource`), one piece at a time. ``sync_files``: fsync each file
    (as megatron's writer does)."""

    def __init__(self, source: ShardSource, sync_files: bool = True):
        super().__init__("torch_dist", 1)
        self.source = source
        self.sync_files = sync_files

    @property
    def can_handle_sharded_objects(self):
        return True

    def save(self, sharded_state_dict, checkpoint_dir) -> None:
        from megatron.core.dist_checkpointing.strategies.torch import (
            _replace_state_dict_keys_with_sharded_keys, mcore_to_pyt_state_dict)
        from torch.distributed.checkpoint import CheckpointException
        from torch.distributed.checkpoint import save as dcp_save

        flat, _, _ = _replace_state_dict_keys_with_sharded_keys(sharded_state_dict, keep_only_main_replica=True)
        pyt_state_dict = mcore_to_pyt_state_dict(flat, False)
        writer = _writer_class()(str(checkpoint_dir), single_file_per_rank=True, sync_files=self.sync_files,
                                 thread_count=1, per_thread_copy_ahead=0, overwrite=False)
        planner = _planner_class()(self.source)
        try:
            dcp_save(pyt_state_dict, storage_writer=writer, planner=planner)
        except CheckpointException:
            if planner.error is not None:
                raise planner.error from None  # this rank's own error, naming the tensor
            raise
