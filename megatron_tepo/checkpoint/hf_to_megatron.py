"""Hugging Face safetensors -> megatron-core ``dist_checkpointing`` (torch_dist) checkpoint: the
library behind ``tools/convert_hf_to_megatron.py``.

The name/tensor mapping is NOT here: it is :mod:`megatron_tepo.models` (``hf_to_megatron``) and
the TP/PP placement of :mod:`megatron_tepo.megatron.sharding`. This module only moves tensors from
files into a checkpoint, streaming, and guards the output directory.

:func:`convert_hf_to_megatron` runs on ``tp*pp*ep`` ranks (gloo), streaming:
  1. every rank checks the input before anything is created (:func:`check_hf_input`): family known
     (else the error names the architecture), layout valid (TP dividing heads etc., named), every
     HF tensor present with the shape ``config.json`` implies and none unexpected (named) -- from
     safetensors headers only;
  2. each rank builds its pipeline stage of the model (``HybridModel`` or ``GPTModel``, as the
     actor would: ``model_builder``) as a skeleton (no init: its
     ``torch.empty`` storage is never touched, so not resident) only for megatron's own
     ``sharded_state_dict()``: the key, global shape/offset, local shape and replica id of every
     piece it saves (TP splits, fused QKV rows, the gate/up halves of ``linear_fc1``, stacked
     layers, experts);
  3. ``dist_checkpointing.save`` with
     :class:`~megatron_tepo.megatron.dist_writer.StreamingTorchDistSave` (torch_dist, the same
     format, keys and bytes as megatron's own strategy writes -- tested): the writer walks
     the rank's pieces in layer order and each piece is cut, when it is written, from the full
     Megatron tensor that ``models.hf_to_megatron`` produced from the HF stream; a full tensor is
     dropped once its last piece is written. HF tensors of other stages / experts pass as ``meta``
     stand-ins (shape only, nothing read), so the mapping still sees -- and checks -- every
     tensor exactly once; tensors it only renames (embedding, norms, ``o_proj``, ``down_proj``,
     ``lm_head``) are read (plain positioned file reads, no mmap) only when written, the fused
     q/k/v and gate/up pieces as the layer streams. Peak per rank: the process baseline
     (torch + megatron-core + transformers, ~0.4 GiB) plus about one layer, or the largest single
     tensor (embedding / ``lm_head``) while it is written -- 0.30x of a 1.9 GiB model at TP=1
     (docs/BENCHMARKS.md); every piece of the rank written and every HF tensor consumed is checked
     at the end;
  4. the sidecars of :mod:`.sidecars` (``megatron_tepo_checkpoint.json``: family, the whole family
     config with the MoE sizes, dtype, saved layout, HF tensor names / dtypes / shapes; and
     ``hf_source/``: config, generation config, tokenizer files, and the tensors the model does
     not train, if any), which make the output exportable back (:mod:`.megatron_to_hf`).

A published Qwen3.5 ``*ForConditionalGeneration`` converts its text model (``model.language_model.*``
and ``lm_head.weight``, read in the text model's names: :func:`~.hf_io.open_hf_checkpoint`); its
vision tower and MTP layer are not part of the megatron checkpoint but copied, bit for bit, into
its ``hf_source/carried.safetensors``.
  Output goes to ``<out>.tmp-<pid>`` and is renamed to ``<out>`` only when complete; any error on
  any rank removes it. An existing ``<out>`` is refused unless ``force``. ``streaming=False``
  keeps the whole-model reference path (fill an initialised model through ``models``' TP/PP
  placement, then megatron-core's own ``dist_checkpointing.save``; ~2.2x the model at TP=1):
  the tests compare both outputs item by item.

MoE (sequential experts, one HF tensor per expert as the mapping names them; a Qwen3.5-MoE folder
that stores them stacked, as the published ones do, is read so by :func:`~.hf_io.open_hf_checkpoint`,
each expert's bytes alone): import
runs at ``ep`` > 1 (each rank builds, reads and saves only the experts it holds; the others pass
as meta stand-ins like other stages' tensors) -- on CPU at TP=PP=1 only, see
``models/qwen3_moe/README.md``; the checkpoint's expert tensors are sharded by global expert
index (tests/checkpoint/test_convert_roundtrip.py::test_qwen3_moe_ep2_and_ep1).

Left out: grouped-GEMM expert layouts, virtual pipeline stages, ``pytorch_model*.bin`` input.
A TP rank reads the whole HF tensor of a layer and keeps its slice (no partial reads of row
ranges, except the dim-0 rows of a renamed tensor), and with tied embeddings at PP>1 megatron's
model init all-reduces the embedding between the first and last stage, which makes that tensor
resident on both; a tied checkpoint that also stores ``lm_head.weight`` holds both copies until
the mapping has compared them at the end.
"""
from __future__ import annotations

import re
import shutil
import time
from collections import Counter
from pathlib import Path
from typing import Optional

import torch
import torch.distributed as dist

from megatron_tepo.dtypes import dtype_name
from megatron_tepo.layout import ParallelLayout, validate_layout
from megatron_tepo.megatron import dist_checkpoint
from megatron_tepo.megatron.parallel import initialize_parallel, pipeline_ends
from megatron_tepo.megatron.sharding import expert_indices, layer_offsets, load_megatron_state_into
from megatron_tepo.models import family_config_from_hf, hf_to_megatron, layer_mapping
from megatron_tepo.models.converters import MegatronToHFLayout

from .common import (agree, build_model, check_out_dir, ensure_process_group, finalize_dir, log_progress,
                     read_config_json, tmp_dir_for, trim_heap)
from .hf_io import (LazyHFCheckpoint, check_hf_tensors, hf_layer_index, in_config_file, load_hf_config,
                    open_hf_checkpoint, streaming_order)
from .sidecars import write_conversion_sidecars

__all__ = ["convert_hf_to_megatron", "check_hf_input", "last_import_stats"]


def check_hf_input(hf_dir, tp: int = 1, pp: int = 1, ep: int = 1, world_size: Optional[int] = None,
                   spec: str = "local"):
    """All input checks of HF -> Megatron, from headers only: family, layout, tensor names/shapes.
    Returns ``(family_cfg, hf_config, LazyHFCheckpoint)``; raises naming the culprit."""
    raw = read_config_json(hf_dir)
    try:
        family_cfg = family_config_from_hf(raw, spec=spec)  # unknown architecture -> ValueError naming it
    except ValueError as exc:
        raise in_config_file(exc, Path(hf_dir) / "config.json") from None
    # (sequence parallelism changes nothing of how the weights are stored, and the actor turns it on
    # wherever an MoE layer at TP > 1 needs it: the converter's layouts are checked as with it)
    validate_layout(ParallelLayout(tp=tp, pp=pp, ep=ep), family_cfg.dims(),
                    tp * pp * ep if world_size is None else world_size, sequence_parallel=tp > 1,
                    cpu=not torch.cuda.is_available(), field="--", world="the converter's ranks")
    hf_config = load_hf_config(hf_dir)
    ckpt = open_hf_checkpoint(hf_dir)  # (in the text model's names: a multimodal one's other parts carried)
    check_hf_tensors(ckpt, hf_config)
    return family_cfg, hf_config, ckpt


_HF_EXPERT = re.compile(r"^model\.layers\.\d+\.mlp\.experts\.(\d+)\.")


def _needed_by_stage(family_cfg, layers: set, first: bool, last: bool, tied_alias: bool,
                     experts: Optional[set] = None, tied_output: bool = True):
    """Which HF names this rank must really read (the rest pass as meta stand-ins). ``experts``:
    the global expert indices this rank holds (expert parallelism); None = all. ``tied_output``:
    the last stage fills its tied ``output_layer`` copy from the embedding."""
    tied = family_cfg.tie_word_embeddings and tied_output

    def needed(name: str) -> bool:
        layer = hf_layer_index(name)
        if layer is not None:
            if experts is not None:
                m = _HF_EXPERT.match(name)
                if m is not None and int(m.group(1)) not in experts:
                    return False
            return layer in layers
        if name == "model.embed_tokens.weight":
            return first or (last and tied) or tied_alias
        if name == "lm_head.weight":
            return last or tied_alias
        return last  # model.norm.weight and any other top-level tensor
    return needed


def _hf_stream(ckpt: LazyHFCheckpoint, needed, num_layers: int, progress: bool, stats: dict,
               deferred: Optional["_DeferredReads"] = None):
    """HF ``(name, tensor)`` in streaming order: read when ``needed``, else a meta stand-in. With
    ``deferred``, a needed tensor that the mapping only renames is handed on as a registered
    stand-in and read when the writer reaches it (:class:`_DeferredReads`)."""
    current, t0 = None, time.time()
    for name in streaming_order(ckpt.names()):
        layer = hf_layer_index(name)
        if layer is not None and layer != current:
            current = layer
            log_progress(f"layer {layer + 1}/{num_layers} ({time.time() - t0:.1f}s)", progress)
        if needed(name):
            stats["read"] += 1
            if deferred is not None and name in deferred.names:
                yield name, deferred.stand_in(name)
            else:
                yield name, ckpt.get(name)
        else:
            yield name, ckpt.meta_tensor(name)


class _DeferredReads:
    """HF tensors the mapping hands on unchanged (pure renames: embedding, norms, ``o_proj``,
    ``down_proj``, ``lm_head``, ...), found by a dry run of the mapping over meta stand-ins
    (which also runs its name checks before anything is written). In the real pass they travel
    through the mapping as registered meta stand-ins and :meth:`materialize` reads them when the
    writer needs them -- so the mapping, which keeps a reference to the embedding for its
    tied-alias check, holds no data, and such a tensor lives only while its pieces are written.
    Fused pieces (q/k/v, gate/up) are read as they stream, since the mapping concatenates them.
    With a stored tied ``lm_head`` both it and the embedding are read up front: the mapping
    compares them at the end."""

    def __init__(self, ckpt: LazyHFCheckpoint, family_cfg):
        self.ckpt = ckpt
        stand_ins = {n: ckpt.meta_tensor(n) for n in ckpt.names()}
        tied_alias = family_cfg.tie_word_embeddings and "lm_head.weight" in ckpt
        order = [n for n in streaming_order(ckpt.names()) if not (tied_alias and n == "lm_head.weight")]
        by_id = {id(t): n for n, t in stand_ins.items()}
        self.names: set = set()
        for _, out in hf_to_megatron(((n, stand_ins[n]) for n in order), family_cfg):
            n = by_id.get(id(out))
            if n is not None and stand_ins[n] is out:
                self.names.add(n)
        if tied_alias:
            self.names -= {"model.embed_tokens.weight", "lm_head.weight"}
        self._pending: dict = {}

    def stand_in(self, name: str) -> torch.Tensor:
        t = self.ckpt.meta_tensor(name)
        self._pending[id(t)] = (t, name)  # kept alive: its id stays unique until materialised
        return t

    def materialize(self, tensor: torch.Tensor):
        """A registered stand-in -> :class:`_DeferredTensor` (read when indexed); else ``tensor``."""
        hit = self._pending.get(id(tensor))
        if hit is None or hit[0] is not tensor:
            return tensor
        del self._pending[id(tensor)]
        return _DeferredTensor(self.ckpt, hit[1])


class _DeferredTensor:
    """An HF tensor read only when a piece of it is asked for (``t[index]``): a dim-0 range with
    the other dims whole -- a TP rank's rows of the embedding / ``lm_head`` / a column-parallel
    weight -- is read alone (a contiguous byte range); any other region reads the whole tensor
    and slices it."""

    is_meta = False
    held_bytes = 0  # holds no data

    def __init__(self, ckpt: LazyHFCheckpoint, name: str):
        self.ckpt, self.name = ckpt, name
        self.shape = torch.Size(ckpt.shape(name))
        self.dtype = ckpt.dtype(name)

    def __getitem__(self, index) -> torch.Tensor:
        index = tuple(index)
        rest_whole = all(sl.start in (0, None) and sl.stop in (d, None) and sl.step in (1, None)
                         for sl, d in zip(index[1:], self.shape[1:]))
        if self.shape and index and rest_whole and index[0].step in (1, None):
            first = index[0]
            return self.ckpt.get(self.name, rows=(first.start or 0,
                                                  self.shape[0] if first.stop is None else first.stop))
        return self.ckpt.get(self.name)[index]


def _params_dtype(ckpt: LazyHFCheckpoint) -> torch.dtype:
    counts = Counter(ckpt.dtype(n) for n in ckpt.names() if ckpt.dtype(n).is_floating_point)
    return counts.most_common(1)[0][0] if counts else torch.float32


def convert_hf_to_megatron(hf_dir, out_dir, tp: int = 1, pp: int = 1, ep: int = 1, force: bool = False,
                           progress: bool = True, streaming: bool = True, model_builder: str = "auto") -> Path:
    """Write ``hf_dir`` (safetensors) as a megatron-core torch_dist checkpoint at ``out_dir``.

    Collective over the default process group, whose size must be ``tp*pp*ep`` (a 1-process gloo
    group is started when none exists). See the module docstring. ``streaming=False`` is the
    whole-model reference path (fill an initialised model, megatron's own
    ``dist_checkpointing.save``): same checkpoint, ~2.3x the rank's share of the model in
    memory; the tests compare the two. ``model_builder`` (as ``actor.model_builder``; ``auto``:
    what the actor builds on this megatron-core) lays out the checkpoint's keys; the sidecar
    records it."""
    from megatron_tepo.megatron.resolve import resolve_model_builder

    ensure_process_group()
    rank, world = dist.get_rank(), dist.get_world_size()
    out = Path(out_dir).absolute()
    t_start = time.time()

    def validate():
        if world != tp * pp * ep:
            raise ValueError(f"world size {world} != tp*pp*ep = {tp}*{pp}*{ep}")
        check_out_dir(out, force)
        return check_hf_input(hf_dir, tp=tp, pp=pp, ep=ep, world_size=world)

    family_cfg, _, ckpt = agree(validate)
    builder = agree(resolve_model_builder, model_builder)
    tmp_holder = [str(tmp_dir_for(out)) if rank == 0 else None]
    if world > 1:
        dist.broadcast_object_list(tmp_holder, src=0)
    tmp = Path(tmp_holder[0])
    if rank == 0:
        tmp.mkdir(parents=True)
    try:
        if world > 1:
            dist.barrier()
        agree(initialize_parallel, ParallelLayout(tp=tp, pp=pp, ep=ep), family_cfg, backend="gloo",
              sequence_parallel=tp > 1)  # (as check_hf_input: the stored weights do not depend on it)
        params_dtype = _params_dtype(ckpt)
        log_progress(f"{family_cfg.family}: {family_cfg.num_layers} layers, {len(ckpt.names())} HF tensors, "
                     f"tp={tp} pp={pp} ep={ep}, dtype {dtype_name(params_dtype)}"
                     f"{'' if streaming else ', whole-model reference path'} -> {out}", progress)
        save = _save_streaming if streaming else _save_from_filled_model
        save(tmp, family_cfg, ckpt, params_dtype, progress, builder)
        ckpt.close()
        if rank == 0:
            agree(write_conversion_sidecars, tmp, hf_dir, family_cfg, params_dtype,
                  ParallelLayout(tp=tp, pp=pp, ep=ep), ckpt, model_builder=builder)
        else:
            agree(lambda: None)
        if world > 1:
            dist.barrier()
        if rank == 0:
            finalize_dir(tmp, out, force)
        if world > 1:
            dist.barrier()
        log_progress(f"done in {time.time() - t_start:.1f}s: {out}", progress)
        return out
    except BaseException:
        if rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)
        raise


def _stage_reads(model, family_cfg, ckpt: LazyHFCheckpoint, tied_output_read: bool):
    """``needed(hf_name)`` for this rank's stage / experts (see :func:`_needed_by_stage`)."""
    layers = set(layer_offsets(model).values())
    held = expert_indices(model)
    experts = {e for es in held.values() for e in es} if held else None
    tied_alias = family_cfg.tie_word_embeddings and "lm_head.weight" in ckpt
    first, last = pipeline_ends()
    return _needed_by_stage(family_cfg, layers, first, last, tied_alias, experts,
                            tied_output=tied_output_read)


last_import_stats: dict = {}  # this rank's last streaming import: bytes written, most full-tensor bytes held


def _save_streaming(tmp: Path, family_cfg, ckpt: LazyHFCheckpoint, params_dtype, progress: bool,
                    builder: str) -> None:
    """The rank's skeleton model gives the checkpoint's structure; the HF tensors stream through
    the mapping into :class:`~megatron_tepo.megatron.dist_writer.StreamingTorchDistSave`, piece by
    piece in layer order (module docstring)."""
    from megatron_tepo.megatron.dist_writer import ShardSource, StreamingTorchDistSave
    from megatron_tepo.megatron.sharding import global_named_parameters

    t0 = time.time()
    model = agree(build_model, family_cfg, params_dtype, initialize=False, model_builder=builder)
    # The last stage's tied output_layer copy is a non-main replica of the embedding (the first
    # stage writes it), so that stage never needs the HF embedding's data.
    needed = _stage_reads(model, family_cfg, ckpt, tied_output_read=False)

    def make_source():
        sharded, sts = dist_checkpoint.sharded_tensors(model)
        stats = {"read": 0}
        deferred = _DeferredReads(ckpt, family_cfg)
        stream = hf_to_megatron(_hf_stream(ckpt, needed, family_cfg.num_layers, progress, stats, deferred),
                                family_cfg)
        return sharded, ShardSource(sts, list(global_named_parameters(model)), stream, params_dtype,
                                    tied=family_cfg.tie_word_embeddings, materialize=deferred.materialize,
                                    on_release=trim_heap)

    sharded, source = agree(make_source)
    agree(dist_checkpoint.save, sharded, tmp, sharded_strategy=StreamingTorchDistSave(source))
    agree(source.finish)
    last_import_stats.clear()
    last_import_stats.update(bytes_written=source.bytes_written, peak_cached_bytes=source.peak_cached_bytes)
    log_progress(f"streamed and saved in {time.time() - t0:.1f}s (rank 0: {source.bytes_written / 2**20:.0f} "
                 f"MiB written, at most {source.peak_cached_bytes / 2**20:.0f} MiB of full tensors held)", progress)


def _save_from_filled_model(tmp: Path, family_cfg, ckpt: LazyHFCheckpoint, params_dtype, progress: bool,
                            builder: str) -> None:
    """Reference path: fill the rank's initialised stage through ``models``' TP/PP placement
    (``load_megatron_state_into``), then megatron-core's own ``dist_checkpointing.save``."""
    t0 = time.time()
    model = agree(build_model, family_cfg, params_dtype, model_builder=builder)
    needed = _stage_reads(model, family_cfg, ckpt, tied_output_read=True)
    stats = {"read": 0}
    gated = MegatronToHFLayout(family_cfg, layer_mapping(family_cfg)).gated
    agree(lambda: load_megatron_state_into(
        [model], hf_to_megatron(_hf_stream(ckpt, needed, family_cfg.num_layers, progress, stats), family_cfg),
        family_cfg.tie_word_embeddings, gated=gated))
    log_progress(f"read and placed in {time.time() - t0:.1f}s; saving torch_dist checkpoint", progress)
    dist_checkpoint.save(model.sharded_state_dict(), tmp)
