"""Hugging Face <-> megatron-core ``dist_checkpointing`` conversion (the library behind ``tools/``).

The name/tensor mapping is NOT here: it is :mod:`megatron_tepo.models` (``hf_to_megatron`` /
``megatron_to_hf`` / ``load_hf_weights_into``'s TP/PP placement). This module only moves tensors
between files and models, streaming, and guards the output directory.

HF -> Megatron (:func:`convert_hf_to_megatron`), run on ``tp*pp*ep`` ranks (gloo), streaming:
  1. every rank checks the input before anything is created: family known (else the error names
     the architecture), layout valid (TP dividing heads etc., named), every HF tensor present with
     the shape ``config.json`` implies and none unexpected (named) -- from safetensors headers only;
  2. each rank builds its pipeline stage of the ``GPTModel`` as a skeleton (no init: its
     ``torch.empty`` storage is never touched, so not resident) only for megatron's own
     ``sharded_state_dict()``: the key, global shape/offset, local shape and replica id of every
     piece it saves (TP splits, fused QKV rows, the gate/up halves of ``linear_fc1``, stacked
     layers, experts);
  3. ``dist_checkpointing.save`` with :class:`~.dist_writer.StreamingTorchDistSave` (torch_dist,
     the same format, keys and bytes as megatron's own strategy writes -- tested): the writer walks
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
  4. sidecars: ``megatron_tepo_checkpoint.json`` (family, its whole family config with the MoE
     sizes, dtype, saved layout, HF tensor names / dtypes / shapes) and ``hf_source/`` (config,
     generation config, tokenizer files).
  Output goes to ``<out>.tmp-<pid>`` and is renamed to ``<out>`` only when complete; any error on
  any rank removes it. An existing ``<out>`` is refused unless ``force``. ``streaming=False``
  keeps the whole-model reference path (fill an initialised model through ``models``' TP/PP
  placement, then megatron-core's own ``dist_checkpointing.save``; ~2.2x the model at TP=1):
  the tests compare both outputs item by item.

Megatron -> HF (:func:`convert_megatron_to_hf`), one process, streaming: the TP=PP=EP=1 model is
built without init (its ``torch.empty`` storage stays untouched, so not resident) only to get
megatron's own ``sharded_state_dict()`` -- the checkpoint key, global offset and shape of every
piece of every parameter (fused QKV, the gate/up halves of ``linear_fc1``, stacked layers,
experts). Parameter by parameter, :class:`_DistCheckpointReader` reads exactly those regions
from the torch_dist files (PyTorch DCP ``FileSystemReader`` + ``create_read_items_for_chunk_list``,
which reshards from whatever TP/PP/EP the checkpoint was saved at: megatron saves global
tensors), checks each region fully covered, and the parameter goes through
``models.megatron_to_hf``, is checked against the recorded HF names/shapes/dtypes, handed to the
sharded safetensors writer and its storage released. Peak: about one output shard plus the
largest parameter. (``dist_checkpointing.load`` cannot do this per layer: megatron-core 0.16.1's
torch_dist loader rejects a partial load of its stacked ``decoder.layers.*`` tensors in a
1-process world -- it places the other layers' fragments on rank ``(rank+1) % world_size`` =
itself and then counts them as missing local shards -- hence reading the DCP chunks directly.)

Trainer checkpoints (``train.output_dir/checkpoints/step_N``) carry the same sidecars
(:func:`write_conversion_sidecars`, plus the layer spec and the parameters' dtype, bf16 for a
bf16 actor), so :func:`convert_megatron_to_hf` exports any of them; the model part of a trainer
checkpoint uses the same keys. :func:`export_actor_to_hf` writes the live actor's policy the same
way (the trainer's end-of-run export), through the same :class:`HFDirWriter`.

:func:`build_gpt_model` / :func:`load_checkpoint_into` build this rank's stage and load a
converted checkpoint into it (used by the tests; the actor may reuse them).

MoE (Qwen3-MoE, sequential experts, one HF tensor per expert as checkpoints store them): import
runs at ``ep`` > 1 (each rank builds, reads with ``safe_open`` and saves only the experts it holds;
the others pass as meta stand-ins like other stages' tensors) -- on CPU at TP=PP=1 only, see
``models/qwen3_moe/README.md``; the checkpoint's expert tensors are sharded by global expert
index, so export -- one process, EP=1 -- reads and writes every expert whatever EP it was saved
at (tests/checkpoint/test_convert_roundtrip.py::test_qwen3_moe_ep2_and_ep1).

Left out: grouped-GEMM expert layouts, virtual pipeline stages, the Transformer-Engine spec on
export (the checkpoint keys are the same for both specs; export builds the local spec),
optimizer state. On import, a TP rank reads the whole HF tensor of a layer and keeps its slice
(no partial reads of row ranges), and with tied embeddings at PP>1 megatron's model init
all-reduces the embedding between the first and last stage, which makes that tensor resident
on both; a tied checkpoint that also stores ``lm_head.weight`` holds both copies until the
mapping has compared them at the end.
"""
from __future__ import annotations

import json
import os
import re
import shutil
import sys
import time
from collections import Counter
from pathlib import Path
from typing import Callable, Optional

import torch
import torch.distributed as dist

from megatron_tepo.layout import ParallelLayout, validate_layout
from megatron_tepo.megatron.parallel import initialize_parallel, raise_if_any_rank_failed, single_process_env
from megatron_tepo.megatron.sharding import expert_indices, layer_offsets, load_megatron_state_into
from megatron_tepo.models import GPTFamilyConfig, family_config_from_hf, hf_to_megatron, megatron_to_hf

from .hf_io import (
    LazyHFCheckpoint,
    ShardedSafetensorsWriter,
    check_hf_tensors,
    copy_side_files,
    dtype_from_name,
    dtype_name,
    hf_layer_index,
    load_hf_config,
    streaming_order,
)

INFO_NAME = "megatron_tepo_checkpoint.json"
HF_SOURCE = "hf_source"
FORMAT = "megatron_tepo/hf-dist-ckpt/1"

__all__ = ["convert_hf_to_megatron", "convert_megatron_to_hf", "build_gpt_model",
           "load_checkpoint_into", "read_checkpoint_info", "read_family_config", "check_hf_input",
           "ensure_process_group"]


# ---------------------------------------------------------------------------------------------
# small helpers
# ---------------------------------------------------------------------------------------------
def _log(msg: str, progress: bool = True) -> None:
    if progress and (not dist.is_initialized() or dist.get_rank() == 0):
        print(f"[convert] {msg}", file=sys.stderr, flush=True)


def ensure_process_group() -> None:
    """Join torchrun's world, or start a 1-process gloo world when not launched by torchrun."""
    if dist.is_initialized():
        return
    single_process_env()
    dist.init_process_group("gloo")


def _agree(fn: Callable, *args, **kwargs):
    """Run ``fn`` on every rank; if it raised anywhere, raise on every rank (no rank hangs in a
    later collective). The message names the rank(s) and the original error."""
    result, err = None, None
    try:
        result = fn(*args, **kwargs)
    except Exception as e:  # noqa: BLE001 -- re-raised below on every rank
        err = e
    raise_if_any_rank_failed(err, "conversion")
    return result


def _check_out(out: Path, force: bool) -> None:
    if out.exists() and not force:
        raise FileExistsError(f"output {out} already exists (pass --force / force=True to replace it)")


def _finalize_dir(tmp: Path, out: Path, force: bool) -> None:
    """Atomically put ``tmp`` at ``out`` (replacing an old ``out`` only when ``force``)."""
    old = None
    if out.exists():
        _check_out(out, force)
        old = out.with_name(f"{out.name}.old-{os.getpid()}")
        os.replace(out, old)
    os.replace(tmp, out)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


def _tmp_dir_for(out: Path) -> Path:
    return out.with_name(f"{out.name}.tmp-{os.getpid()}")


def read_checkpoint_info(megatron_dir) -> dict:
    path = Path(megatron_dir) / INFO_NAME
    if not path.exists():
        raise FileNotFoundError(f"{path} not found: {megatron_dir} is not a checkpoint written by "
                                f"convert_hf_to_megatron (it needs {INFO_NAME} and {HF_SOURCE}/)")
    info = json.loads(path.read_text())
    if info.get("format") != FORMAT:
        raise ValueError(f"{path}: unknown format {info.get('format')!r} (expected {FORMAT!r})")
    return info


def read_family_config(megatron_dir, info: Optional[dict] = None) -> GPTFamilyConfig:
    """The family config a checkpoint directory was written with (``info``: its
    :func:`read_checkpoint_info`, read when None). Sidecars record it whole (``family_config``,
    with ``moe`` null for a dense model); older ones left the MoE sizes out (an untyped ``extra``
    then, not written), so for a ``family_config`` without ``moe`` it is rebuilt from
    ``hf_source/config.json`` at the recorded layer spec, as the exporter always did."""
    info = read_checkpoint_info(megatron_dir) if info is None else info
    stored = info.get("family_config")
    if isinstance(stored, dict) and "moe" in stored:
        return GPTFamilyConfig.from_dict(stored)
    return family_config_from_hf(_read_raw_config(Path(megatron_dir) / HF_SOURCE), spec=info.get("spec", "local"))


def _read_raw_config(config_dir) -> dict:
    path = Path(config_dir) / "config.json"
    if not path.exists():
        raise FileNotFoundError(f"{path} does not exist")
    return json.loads(path.read_text())


def check_hf_input(hf_dir, tp: int = 1, pp: int = 1, ep: int = 1, world_size: Optional[int] = None,
                   spec: str = "local"):
    """All input checks of HF -> Megatron, from headers only: family, layout, tensor names/shapes.
    Returns ``(family_cfg, hf_config, LazyHFCheckpoint)``; raises naming the culprit."""
    raw = _read_raw_config(hf_dir)
    family_cfg = family_config_from_hf(raw, spec=spec)  # unknown architecture -> ValueError naming it
    validate_layout(ParallelLayout(tp=tp, pp=pp, ep=ep), family_cfg.dims(),
                    tp * pp * ep if world_size is None else world_size, te_available=False,
                    cpu=not torch.cuda.is_available(), field="--", world="the converter's ranks")
    hf_config = load_hf_config(hf_dir)
    ckpt = LazyHFCheckpoint(hf_dir)
    check_hf_tensors(ckpt, hf_config)
    return family_cfg, hf_config, ckpt


# ---------------------------------------------------------------------------------------------
# model building / loading
# ---------------------------------------------------------------------------------------------
def build_gpt_model(family_cfg, params_dtype: torch.dtype = torch.float32, initialize: bool = True):
    """This rank's pipeline stage of the ``GPTModel`` for ``family_cfg``, with the actor's CPU-safe
    runtime flags. Needs megatron's ``parallel_state`` initialised (TP/PP read from it).
    ``initialize=False`` skips megatron's init -- and with it the ``tensor_model_parallel`` /
    ``partition_dim`` / ``partition_stride`` attributes that ``megatron.sharding`` places by, so it
    is only right at TP=1 or when loading through ``sharded_state_dict`` (which does not use
    them); it is what the meta-device export model uses."""
    from megatron.core import parallel_state as ps

    from megatron_tepo.megatron.gpt import build_gpt_chunk, transformer_config

    config = transformer_config(
        family_cfg, tp=ps.get_tensor_model_parallel_world_size(),
        pp=ps.get_pipeline_model_parallel_world_size(), ep=ps.get_expert_model_parallel_world_size(),
        params_dtype=params_dtype, initialize=initialize)
    return build_gpt_chunk(config, family_cfg, ps.is_pipeline_first_stage(), ps.is_pipeline_last_stage())


def load_checkpoint_into(model: torch.nn.Module, megatron_dir) -> None:
    """Load a (converted) dist checkpoint into this rank's stage, whatever layout it was saved at."""
    from megatron.core import dist_checkpointing

    state = dist_checkpointing.load(model.sharded_state_dict(), str(megatron_dir))
    model.load_state_dict(state)


# ---------------------------------------------------------------------------------------------
# HF -> Megatron
# ---------------------------------------------------------------------------------------------
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
            _log(f"layer {layer + 1}/{num_layers} ({time.time() - t0:.1f}s)", progress)
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
                           progress: bool = True, streaming: bool = True) -> Path:
    """Write ``hf_dir`` (safetensors) as a megatron-core torch_dist checkpoint at ``out_dir``.

    Collective over the default process group, whose size must be ``tp*pp*ep`` (a 1-process gloo
    group is started when none exists). See the module docstring. ``streaming=False`` is the
    whole-model reference path (fill an initialised model, megatron's own
    ``dist_checkpointing.save``): same checkpoint, ~2.3x the rank's share of the model in
    memory; the tests compare the two."""
    ensure_process_group()
    rank, world = dist.get_rank(), dist.get_world_size()
    out = Path(out_dir).absolute()
    t_start = time.time()

    def validate():
        if world != tp * pp * ep:
            raise ValueError(f"world size {world} != tp*pp*ep = {tp}*{pp}*{ep}")
        _check_out(out, force)
        return check_hf_input(hf_dir, tp=tp, pp=pp, ep=ep, world_size=world)

    family_cfg, _, ckpt = _agree(validate)
    tmp_holder = [str(_tmp_dir_for(out)) if rank == 0 else None]
    if world > 1:
        dist.broadcast_object_list(tmp_holder, src=0)
    tmp = Path(tmp_holder[0])
    if rank == 0:
        tmp.mkdir(parents=True)
    try:
        if world > 1:
            dist.barrier()
        _agree(initialize_parallel, ParallelLayout(tp=tp, pp=pp, ep=ep), family_cfg, backend="gloo")
        params_dtype = _params_dtype(ckpt)
        _log(f"{family_cfg.family}: {family_cfg.num_layers} layers, {len(ckpt.names())} HF tensors, "
             f"tp={tp} pp={pp} ep={ep}, dtype {dtype_name(params_dtype)}"
             f"{'' if streaming else ', whole-model reference path'} -> {out}", progress)
        save = _save_streaming if streaming else _save_from_filled_model
        save(tmp, family_cfg, ckpt, params_dtype, progress)
        ckpt.close()
        if rank == 0:
            _agree(_write_sidecars, tmp, hf_dir, family_cfg, ckpt, params_dtype, tp, pp, ep)
        else:
            _agree(lambda: None)
        if world > 1:
            dist.barrier()
        if rank == 0:
            _finalize_dir(tmp, out, force)
        if world > 1:
            dist.barrier()
        _log(f"done in {time.time() - t_start:.1f}s: {out}", progress)
        return out
    except BaseException:
        if rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)
        raise


def _stage_reads(model, family_cfg, ckpt: LazyHFCheckpoint, tied_output_read: bool):
    """``needed(hf_name)`` for this rank's stage / experts (see :func:`_needed_by_stage`)."""
    from megatron.core import parallel_state as ps

    layers = set(layer_offsets(model).values())
    held = expert_indices(model)
    experts = {e for es in held.values() for e in es} if held else None
    tied_alias = family_cfg.tie_word_embeddings and "lm_head.weight" in ckpt
    last = ps.is_pipeline_last_stage()
    return _needed_by_stage(family_cfg, layers, ps.is_pipeline_first_stage(), last, tied_alias, experts,
                            tied_output=tied_output_read)


last_import_stats: dict = {}  # this rank's last streaming import: bytes written, most full-tensor bytes held


def _save_streaming(tmp: Path, family_cfg, ckpt: LazyHFCheckpoint, params_dtype, progress: bool) -> None:
    """The rank's skeleton model gives the checkpoint's structure; the HF tensors stream through
    the mapping into :class:`~.dist_writer.StreamingTorchDistSave`, piece by piece in layer
    order (module docstring)."""
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing.dict_utils import nested_values
    from megatron.core.dist_checkpointing.mapping import ShardedTensor, apply_factories

    from megatron_tepo.megatron.sharding import global_named_parameters

    from .dist_writer import ShardSource, StreamingTorchDistSave

    t0 = time.time()
    model = _agree(build_gpt_model, family_cfg, params_dtype, initialize=False)
    # The last stage's tied output_layer copy is a non-main replica of the embedding (the first
    # stage writes it), so that stage never needs the HF embedding's data.
    needed = _stage_reads(model, family_cfg, ckpt, tied_output_read=False)

    def make_source():
        sharded = model.sharded_state_dict()
        apply_factories(sharded)
        sts = [v for v in nested_values(sharded) if isinstance(v, ShardedTensor)]
        stats = {"read": 0}
        deferred = _DeferredReads(ckpt, family_cfg)
        stream = hf_to_megatron(_hf_stream(ckpt, needed, family_cfg.num_layers, progress, stats, deferred),
                                family_cfg)
        return sharded, ShardSource(sts, list(global_named_parameters(model)), stream, params_dtype,
                                    tied=family_cfg.tie_word_embeddings, materialize=deferred.materialize,
                                    on_release=_trim_heap)

    sharded, source = _agree(make_source)
    _agree(dist_checkpointing.save, sharded, str(tmp), sharded_strategy=StreamingTorchDistSave(source))
    _agree(source.finish)
    last_import_stats.clear()
    last_import_stats.update(bytes_written=source.bytes_written, peak_cached_bytes=source.peak_cached_bytes)
    _log(f"streamed and saved in {time.time() - t0:.1f}s (rank 0: {source.bytes_written / 2**20:.0f} MiB "
         f"written, at most {source.peak_cached_bytes / 2**20:.0f} MiB of full tensors held)", progress)


def _save_from_filled_model(tmp: Path, family_cfg, ckpt: LazyHFCheckpoint, params_dtype, progress: bool) -> None:
    """Reference path: fill the rank's initialised stage through ``models``' TP/PP placement
    (``load_megatron_state_into``), then megatron-core's own ``dist_checkpointing.save``."""
    from megatron.core import dist_checkpointing

    t0 = time.time()
    model = _agree(build_gpt_model, family_cfg, params_dtype)
    needed = _stage_reads(model, family_cfg, ckpt, tied_output_read=True)
    stats = {"read": 0}
    _agree(lambda: load_megatron_state_into(
        [model], hf_to_megatron(_hf_stream(ckpt, needed, family_cfg.num_layers, progress, stats), family_cfg),
        family_cfg.tie_word_embeddings))
    _log(f"read and placed in {time.time() - t0:.1f}s; saving torch_dist checkpoint", progress)
    dist_checkpointing.save(model.sharded_state_dict(), str(tmp))


def _write_sidecars(tmp: Path, hf_dir, family_cfg, ckpt: LazyHFCheckpoint, params_dtype, tp, pp, ep):
    write_conversion_sidecars(tmp, hf_dir, family_cfg, params_dtype, ParallelLayout(tp=tp, pp=pp, ep=ep), ckpt)


def write_conversion_sidecars(directory, hf_dir, family_cfg, params_dtype, layout: ParallelLayout,
                              ckpt: Optional[LazyHFCheckpoint] = None) -> None:
    """What makes a megatron checkpoint directory convertible back to HF by
    :func:`convert_megatron_to_hf`: ``hf_source/`` (config, generation config, tokenizer files of
    ``hf_dir``) and ``megatron_tepo_checkpoint.json`` (family, the family config with its ``moe``
    entry -- :meth:`GPTFamilyConfig.as_dict`, read back by :func:`read_family_config` --, layer
    spec, parameter dtype, saved layout, the HF tensor names / dtypes / shapes of ``hf_dir``). The converter writes them; so
    does the trainer into each of its checkpoints."""
    import megatron.core

    directory = Path(directory)
    ckpt = ckpt or LazyHFCheckpoint(hf_dir)
    copy_side_files(hf_dir, directory / HF_SOURCE)
    info = {
        "format": FORMAT,
        "family": family_cfg.family,
        "family_config": family_cfg.as_dict(),
        "spec": family_cfg.spec,
        "params_dtype": dtype_name(params_dtype),
        "saved_layout": layout.as_dict(),
        "megatron_core_version": getattr(megatron.core, "__version__", "?"),
        "hf_tensors": {n: {"dtype": dtype_name(ckpt.dtype(n)), "shape": list(ckpt.shape(n))}
                       for n in ckpt.names()},
    }
    (directory / INFO_NAME).write_text(json.dumps(info, indent=1))


# ---------------------------------------------------------------------------------------------
# Megatron -> HF
# ---------------------------------------------------------------------------------------------
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


class _DistCheckpointReader:
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


def _trim_heap() -> None:
    """Give freed heap memory back to the OS (glibc ``malloc_trim``; a no-op elsewhere). Without
    it the per-tensor read buffers (below glibc's dynamic mmap threshold, so on the heap) leave
    a fragmented heap that grows with the model (measured: 1.17 GiB instead of 0.64 GiB RSS for a
    1.9 GiB model)."""
    global _MALLOC_TRIM
    if _MALLOC_TRIM is None:
        try:
            import ctypes

            _MALLOC_TRIM = ctypes.CDLL("libc.so.6").malloc_trim
        except (OSError, AttributeError):
            _MALLOC_TRIM = False
    if _MALLOC_TRIM:
        _MALLOC_TRIM(0)


_MALLOC_TRIM = None


def _params_streamed(model, src):
    """``(global name, full tensor)`` of every parameter of the TP=PP=EP=1 ``model`` (built with
    ``initialize=False``: its ``torch.empty`` storage is never touched before this), each read
    from the checkpoint only when asked for and released from the model once the consumer asks
    for the next (the writer's shard buffer keeps what it still needs). Peak: one parameter
    plus the writer's shard -- the model's untouched storage is not resident."""
    from megatron.core.dist_checkpointing.dict_utils import nested_values
    from megatron.core.dist_checkpointing.mapping import ShardedTensor, apply_factories

    from megatron_tepo.megatron.sharding import global_named_parameters

    reader = _DistCheckpointReader(src)
    sharded = model.sharded_state_dict()
    apply_factories(sharded)
    by_storage: dict = {}
    for st in nested_values(sharded):
        if isinstance(st, ShardedTensor):
            by_storage.setdefault(st.data.untyped_storage().data_ptr(), []).append(st)
    del sharded  # its ShardedTensors view every parameter: they must not outlive their release
    for name, param in list(global_named_parameters(model)):
        sts = by_storage.pop(param.untyped_storage().data_ptr(), [])
        if sum(st.data.numel() for st in sts) != param.numel():
            raise ValueError(f"parameter {name!r} is not fully covered by the model's "
                             f"sharded_state_dict ({len(sts)} piece(s))")
        reader.read(sts)
        del sts
        yield name, param.detach()
        param.data = torch.empty(0, dtype=param.dtype)
        _trim_heap()


class HFDirWriter:
    """Writes ``(HF name, tensor)`` pairs as an HF model directory, atomically: sharded safetensors
    + index in ``<out>.tmp-<pid>``, each tensor checked against ``expected`` (name -> dtype, shape:
    the source checkpoint's) and cast to its dtype, then the side files (config, generation
    config, tokenizer) of ``side_files``; :meth:`close` checks that every expected tensor came and
    renames the directory to ``out``. Used by :func:`convert_megatron_to_hf` and
    :func:`export_actor_to_hf`."""

    def __init__(self, out, expected: dict, side_files, tie_word_embeddings: bool, force: bool,
                 max_shard_bytes: int = 2 * 1024 ** 3):
        self.out, self.expected, self.side_files = Path(out).absolute(), expected, Path(side_files)
        self.tie, self.force = tie_word_embeddings, force
        _check_out(self.out, force)
        self.tmp = _tmp_dir_for(self.out)
        self.tmp.mkdir(parents=True)
        self.writer = ShardedSafetensorsWriter(self.tmp, max_shard_bytes)
        self.written: set = set()

    def add(self, name: str, tensor: torch.Tensor) -> None:
        """``tensor`` is copied (it may be a view into a reused buffer)."""
        if name not in self.expected:
            raise ValueError(f"exported HF tensor {name!r} is not in the source checkpoint "
                             f"({len(self.expected)} tensors listed)")
        want = self.expected[name]
        if list(tensor.shape) != list(want["shape"]):
            raise ValueError(f"exported HF tensor {name!r} has shape {tuple(tensor.shape)}, "
                             f"the source had {tuple(want['shape'])}")
        self.writer.add(name, tensor.to(dtype_from_name(want["dtype"]), copy=True))
        self.written.add(name)
        if name == "model.embed_tokens.weight" and self.tie and "lm_head.weight" in self.expected:
            self.add("lm_head.weight", tensor)  # the source stored the tied copy too

    def close(self) -> Path:
        missing = [n for n in self.expected if n not in self.written]
        if missing:
            raise ValueError(f"the export did not give HF tensor(s) {missing[:8]}")
        self.writer.close()
        copy_side_files(self.side_files, self.tmp)
        _finalize_dir(self.tmp, self.out, self.force)
        return self.out

    def abort(self) -> None:
        shutil.rmtree(self.tmp, ignore_errors=True)


def convert_megatron_to_hf(megatron_dir, out_dir, force: bool = False,
                           max_shard_bytes: int = 2 * 1024 ** 3, progress: bool = True) -> Path:
    """Write a checkpoint made by :func:`convert_hf_to_megatron`, or a trainer checkpoint (both
    carry :func:`write_conversion_sidecars`' files; any saved TP/PP, any precision), back as an HF
    directory: sharded safetensors + index + config/generation config/tokenizer files.
    Runs in ONE process (a 1-process gloo group is started when none exists)."""

    t_start = time.time()
    src = Path(megatron_dir)
    out = Path(out_dir).absolute()
    info = read_checkpoint_info(src)
    family_cfg = read_family_config(src, info)
    params_dtype = dtype_from_name(info["params_dtype"])
    _check_out(out, force)
    ensure_process_group()
    if dist.get_world_size() != 1:
        raise ValueError(f"convert_megatron_to_hf runs in one process, world size is {dist.get_world_size()}")
    initialize_parallel(ParallelLayout(), family_cfg, backend="gloo")
    writer = HFDirWriter(out, info["hf_tensors"], src / HF_SOURCE, family_cfg.tie_word_embeddings, force,
                         max_shard_bytes)
    try:
        model = build_gpt_model(family_cfg, params_dtype, initialize=False)
        _log(f"streaming {src} (saved at {info['saved_layout']}) at tp=1 pp=1 ep=1", progress)
        current = None
        for name, tensor in megatron_to_hf(_params_streamed(model, src), family_cfg):
            layer = hf_layer_index(name)
            if layer is not None and layer != current:
                current = layer
                _log(f"layer {layer + 1}/{family_cfg.num_layers} ({time.time() - t_start:.1f}s)", progress)
            writer.add(name, tensor)
        del model
        writer.close()
    except BaseException:
        writer.abort()
        raise
    _log(f"done in {time.time() - t_start:.1f}s: {out}", progress)
    return out


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
            ckpt = LazyHFCheckpoint(hf_source)
            expected = {n: {"dtype": dtype_name(ckpt.dtype(n)), "shape": list(ckpt.shape(n))} for n in ckpt.names()}
            ckpt.close()
            writer = HFDirWriter(out_dir, expected, hf_source, actor.family_cfg.tie_word_embeddings, force,
                                 max_shard_bytes)
        except (OSError, ValueError) as exc:
            err = exc
    raise_if_any_rank_failed(err, "export to HF")
    try:
        for bucket in actor.export_hf_state().flat_buckets(dst=0):
            if writer is not None:
                for name, tensor in bucket.named_tensors():
                    writer.add(name, tensor)
        return writer.close() if writer is not None else None
    except BaseException:
        if writer is not None:
            writer.abort()
        raise
