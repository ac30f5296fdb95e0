"""Megatron -> Hugging Face: a converted or trainer checkpoint, or the live actor, written as an HF
model directory (the library behind ``tools/convert_megatron_to_hf.py`` and the trainer's
end-of-run export).

* :func:`convert_megatron_to_hf` -- one process, streaming: the TP=PP=EP=1 model is built without
  init (its ``torch.empty`` storage stays untouched, so not resident) only to get megatron's own
  ``sharded_state_dict()`` -- the checkpoint key, global offset and shape of every piece of every
  parameter (fused QKV, the gate/up halves of ``linear_fc1``, stacked layers, experts). Parameter
  by parameter, :func:`~.dcp_reader.params_streamed` reads exactly those regions from the
  torch_dist files (resharding from whatever TP/PP/EP they were saved at), the parameter goes
  through ``models.megatron_to_hf``, is checked against the recorded HF names/shapes/dtypes,
  handed to the sharded safetensors writer and its storage released. Peak: about one output
  shard plus the largest parameter. Any checkpoint with the sidecars of :mod:`.sidecars` converts:
  those of :func:`~.hf_to_megatron.convert_hf_to_megatron` and the trainer's
  (``train.output_dir/checkpoints/step_N``: the model part uses the same keys, any precision).
  MoE: the checkpoint's expert tensors are sharded by global expert index, so the export writes
  every expert whatever EP it was saved at.
* :func:`export_actor_to_hf` -- the live actor's policy, gathered bucket by bucket
  (``actor.export_hf_state``), named, shaped and typed as the HF checkpoint it started from.
* :class:`HFDirWriter` -- what both write through: ``(HF name, tensor)`` pairs checked against the
  expected names / shapes / dtypes, sharded safetensors + index + side files, in a temporary
  directory renamed into place when complete.

A source whose checkpoints keep the text model under another name, beside tensors the actor does
not train (a published Qwen3.5 ``*ForConditionalGeneration``: ``model.language_model.*``, the vision
tower ``model.visual.*``, the MTP layer ``mtp.*``; :class:`~megatron_tepo.models.CheckpointNaming`)
is written back as it was: its config, the trained text weights under its names, and the carried
tensors bit for bit -- the live actor's export reads them from the source directory, the
checkpoint converter from the copy each checkpoint holds (``hf_source/carried.safetensors``:
:mod:`.sidecars`). A source that stores its MoE experts stacked (the published Qwen3.5-MoE:
``mlp.experts.gate_up_proj`` / ``down_proj``) gets them back stacked (:class:`HFDirWriter`).

Left out: the Transformer-Engine spec on export (the checkpoint keys are the same for both specs;
export builds the local spec), grouped-GEMM expert layouts, virtual pipeline stages, optimizer
state, exporting with more than one process.
"""
from __future__ import annotations

import shutil
import time
from pathlib import Path
from typing import Optional

import torch
import torch.distributed as dist

from megatron_tepo.dtypes import dtype_from_name
from megatron_tepo.layout import ParallelLayout
from megatron_tepo.megatron.parallel import initialize_parallel, raise_if_any_rank_failed
from megatron_tepo.models import checkpoint_naming, megatron_to_hf

from .common import (build_model, check_out_dir, ensure_process_group, finalize_dir, log_progress, read_config_json,
                     tmp_dir_for)
from .dcp_reader import params_streamed
from .hf_io import LazyHFCheckpoint, ShardedSafetensorsWriter, copy_side_files, hf_layer_index, open_hf_checkpoint
from .sidecars import CARRIED, HF_SOURCE, hf_tensor_table, model_builder_of, read_checkpoint_info, read_family_config

__all__ = ["HFDirWriter", "convert_megatron_to_hf", "export_actor_to_hf"]


class HFDirWriter:
    """Writes ``(HF name, tensor)`` pairs as an HF model directory, atomically: sharded safetensors
    + index in ``<out>.tmp-<pid>``, each tensor checked against ``expected`` (name -> dtype, shape:
    the source checkpoint's) and cast to its dtype, then the side files (config, generation
    config, tokenizer) of ``side_files``; :meth:`close` checks that every expected tensor came and
    renames the directory to ``out``. Used by :func:`convert_megatron_to_hf` and
    :func:`export_actor_to_hf`."""

    def __init__(self, out, expected: dict, side_files, tie_word_embeddings: bool, force: bool,
                 max_shard_bytes: int = 2 * 1024 ** 3, naming=None):
        self.out, self.expected, self.side_files = Path(out).absolute(), expected, Path(side_files)
        self.naming = naming  # the source's CheckpointNaming: the text model's names -> the stored ones
        self.tie, self.force = tie_word_embeddings, force
        check_out_dir(self.out, force)
        self.tmp = tmp_dir_for(self.out)
        self.tmp.mkdir(parents=True)
        self.writer = ShardedSafetensorsWriter(self.tmp, max_shard_bytes)
        self.written: set = set()
        self._stacks: dict = {}  # stacked expert tensor being filled -> (its buffer, the pieces in)

    def add(self, name: str, tensor: torch.Tensor) -> None:
        """``tensor`` (the text model's tensor ``name``) is copied (it may be a view into a reused
        buffer), under the source's name for it -- an expert's tensor into its layer's stacked
        tensor where the source stored the experts so (:meth:`_into_stack`)."""
        stored = self.naming.stored_name(name) if self.naming is not None else name
        if stored in self.expected or not self._into_stack(name, tensor):
            self._add(stored, tensor)
        if name == "model.embed_tokens.weight" and self.tie and "lm_head.weight" in self.expected:
            self.add("lm_head.weight", tensor)  # the source stored the tied copy too

    def _into_stack(self, name: str, tensor: torch.Tensor) -> bool:
        """Per-expert tensor ``name`` copied into the stacked tensor the source stored its layer's
        experts in (``naming.expert_slot``: ``mlp.experts.gate_up_proj`` / ``down_proj``), which is
        written once every expert's pieces are in (one layer's stacked experts held at a time when
        the stream goes layer by layer); False where the source has no such stacked tensor."""
        slot = self.naming.expert_slot(name) if self.naming is not None else None
        stored = self.naming.stored_name(slot[0]) if slot is not None else None
        if stored not in self.expected:
            return False
        _, expert, piece, pieces = slot
        want = self.expected[stored]
        if stored not in self._stacks:
            self._stacks[stored] = (torch.empty(want["shape"], dtype=dtype_from_name(want["dtype"])), set())
        buf, done = self._stacks[stored]
        rows = buf.shape[1] // pieces
        dest = buf[expert, piece * rows:(piece + 1) * rows] if expert < buf.shape[0] else None
        if dest is None or tuple(dest.shape) != tuple(tensor.shape):
            raise ValueError(f"exported HF tensor {name!r} has shape {tuple(tensor.shape)}, but the source stores "
                             f"its layer's experts stacked in {stored!r} of shape {tuple(want['shape'])}")
        if (expert, piece) in done:
            raise ValueError(f"HF tensor {name!r} written twice")
        dest.copy_(tensor)
        done.add((expert, piece))
        if len(done) == buf.shape[0] * pieces:
            del self._stacks[stored]
            self.writer.add(stored, buf)
            self.written.add(stored)
        return True

    def add_carried(self, reader: LazyHFCheckpoint) -> None:
        """The tensors the actor does not train (``reader.carried_names()``: a vision tower, MTP
        layers), as ``reader`` stores them: bit for bit."""
        for name in reader.carried_names():
            self._add(name, reader.get(name))

    def _add(self, name: str, tensor: torch.Tensor) -> None:
        if name not in self.expected:
            raise ValueError(f"exported HF tensor {name!r} is not in the source checkpoint "
                             f"({len(self.expected)} tensors listed)")
        want = self.expected[name]
        if list(tensor.shape) != list(want["shape"]):
            raise ValueError(f"exported HF tensor {name!r} has shape {tuple(tensor.shape)}, "
                             f"the source had {tuple(want['shape'])}")
        self.writer.add(name, tensor.to(dtype_from_name(want["dtype"]), copy=True))
        self.written.add(name)

    def close(self) -> Path:
        missing = [n for n in self.expected if n not in self.written]
        if missing:
            partial = [f"{n} ({len(self._stacks[n][1])} piece(s) given for its {self._stacks[n][0].shape[0]} experts)"
                       for n in missing if n in self._stacks]
            raise ValueError(f"the export did not give HF tensor(s) {missing[:8]}"
                             + (f"; stacked experts incomplete: {partial[:4]}" if partial else ""))
        self.writer.close()
        copy_side_files(self.side_files, self.tmp)
        finalize_dir(self.tmp, self.out, self.force)
        return self.out

    def abort(self) -> None:
        shutil.rmtree(self.tmp, ignore_errors=True)


def convert_megatron_to_hf(megatron_dir, out_dir, force: bool = False,
                           max_shard_bytes: int = 2 * 1024 ** 3, progress: bool = True) -> Path:
    """Write a checkpoint made by :func:`~.hf_to_megatron.convert_hf_to_megatron`, or a trainer
    checkpoint (both carry :func:`~.sidecars.write_conversion_sidecars`' files; any saved TP/PP,
    any precision), back as an HF directory: sharded safetensors + index + config/generation
    config/tokenizer files. Runs in ONE process (a 1-process gloo group is started when none
    exists)."""

    t_start = time.time()
    src = Path(megatron_dir)
    out = Path(out_dir).absolute()
    info = read_checkpoint_info(src)
    family_cfg = read_family_config(src, info)
    params_dtype = dtype_from_name(info["params_dtype"])
    check_out_dir(out, force)
    ensure_process_group()
    if dist.get_world_size() != 1:
        raise ValueError(f"convert_megatron_to_hf runs in one process, world size is {dist.get_world_size()}")
    initialize_parallel(ParallelLayout(), family_cfg, backend="gloo")
    naming = checkpoint_naming(read_config_json(src / HF_SOURCE))
    carried = _carried_reader(src, info, naming)
    writer = HFDirWriter(out, info["hf_tensors"], src / HF_SOURCE, family_cfg.tie_word_embeddings, force,
                         max_shard_bytes, naming=naming)
    try:
        model = build_model(family_cfg, params_dtype, initialize=False, model_builder=model_builder_of(info))
        log_progress(f"streaming {src} (saved at {info['saved_layout']}) at tp=1 pp=1 ep=1", progress)
        current = None
        for name, tensor in megatron_to_hf(params_streamed(model, src), family_cfg):
            layer = hf_layer_index(name)
            if layer is not None and layer != current:
                current = layer
                log_progress(f"layer {layer + 1}/{family_cfg.num_layers} ({time.time() - t_start:.1f}s)", progress)
            writer.add(name, tensor)
        del model
        if carried is not None:
            writer.add_carried(carried)
        writer.close()
    except BaseException:
        writer.abort()
        raise
    finally:
        if carried is not None:
            carried.close()
    log_progress(f"done in {time.time() - t_start:.1f}s: {out}", progress)
    return out


def _carried_reader(src: Path, info: dict, naming) -> Optional[LazyHFCheckpoint]:
    """The checkpoint's copy of its source's carried tensors (``hf_source/carried.safetensors``);
    None when the source had none. Missing: a ValueError naming the file."""
    want = [n for n in info["hf_tensors"] if naming.is_carried(n)]
    if not want:
        return None
    path = src / HF_SOURCE / CARRIED
    if not path.is_file():
        raise ValueError(f"{path} is missing: {src}'s source had {len(want)} tensor(s) the actor does not train "
                         f"(e.g. {want[:2]}), which the export writes back from that file")
    return LazyHFCheckpoint(src / HF_SOURCE, naming=naming)


def export_actor_to_hf(actor, out_dir, hf_source, force: bool = True,
                       max_shard_bytes: int = 2 * 1024 ** 3) -> Optional[Path]:
    """The live actor's policy as an HF model directory (collective over every rank; global rank 0
    writes): the actor's parameters gathered bucket by bucket (``export_hf_state``, every pipeline
    stage and expert), named, shaped and typed as the HF checkpoint ``hf_source`` it started from,
    with its config, generation config and tokenizer files. Written atomically; an existing
    ``out_dir`` is replaced (``force``). Returns the path on rank 0, None elsewhere."""
    rank = dist.get_rank() if dist.is_initialized() else 0
    writer, err = None, None
    if rank == 0:
        try:
            source = open_hf_checkpoint(hf_source)
            expected = hf_tensor_table(source)
            writer = HFDirWriter(out_dir, expected, hf_source, actor.family_cfg.tie_word_embeddings, force,
                                 max_shard_bytes, naming=source.naming)
        except (OSError, ValueError) as exc:
            err = exc
    raise_if_any_rank_failed(err, "export to HF")
    try:
        for bucket in actor.export_hf_state().flat_buckets(dst=0):
            if writer is not None:
                for name, tensor in bucket.named_tensors():
                    writer.add(name, tensor)
        if writer is None:
            return None
        writer.add_carried(source)
        return writer.close()
    except BaseException:
        if writer is not None:
            writer.abort()
        raise
    finally:
        if writer is not None:
            source.close()
