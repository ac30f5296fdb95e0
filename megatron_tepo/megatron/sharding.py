"""Generic TP/PP placement of full tensors onto Megatron parameters, and back.

Nothing here knows a parameter by name: the tensor-parallel split of each parameter is read from its
own megatron metadata (``tensor_model_parallel``, ``partition_dim``, ``partition_stride``, as
set by ``ColumnParallelLinear`` / ``RowParallelLinear`` / ``VocabParallelEmbedding``), and the
pipeline placement from each layer's global ``layer_number`` (so ``decoder.layers.{j}`` of a stage
is global layer ``layer_number - 1``).

Global names are the GPT names of the HF layers whatever the builder: a ``HybridModel``
(:mod:`.hybrid`) holds HF layer ``i`` as stack layers ``2i`` (token mixer) and ``2i + 1`` (MLP),
whose parameters' suffixes do not overlap, so its stack layer ``k`` is named ``decoder.layers.{k // 2}``
(its decoder's ``sublayers_per_hf_layer``), and its ``decoder.final_norm`` is
``decoder.final_layernorm`` (:func:`to_global_name`).

* :func:`shard_tensor` / :func:`unshard_tensors` -- the stride-aware split used by megatron's
  ``_initialize_affine_weight_cpu`` and its inverse.
* :func:`global_named_parameters` -- a chunk's parameters under *global* Megatron names.
* :func:`load_megatron_state_into` / :func:`gather_full_tensors` -- fill this rank's shards from
  full tensors (every parameter checked filled), and all-gather full tensors (params or grads)
  over the TP group, one collective per tensor, Megatron names (this rank's experts only).
* :func:`load_checkpoint_slices_into` -- fill this rank's shards from a lazily read HF
  checkpoint, reading only the rows (and columns) of its own shards of its own stage and experts.
* :func:`mark_tensor_parallel_attributes` -- the attributes above on a model built without
  megatron's init (which is where megatron sets them for its own layers).
* :func:`parallel_groups` / :func:`group_for` / :func:`grad_of` -- the group a parameter is split
  over, and the gradient the optimizer sees.

The bucketed export in HF layout that the rollout weight sync sends is built on these, next to
the actor: :mod:`megatron_tepo.actor.export`.

Expert parameters (megatron's ``allreduce=False``) are split over the expert-tensor-parallel
group, and their local expert index is mapped to the global one through the MoE layer's
``local_expert_indices``; a rank only loads the experts it holds.

Left out: virtual pipeline stages beyond plain chunk lists, FSDP/DTensor parameters.
"""
from __future__ import annotations

import re
from typing import Callable, Dict, Iterable, Iterator, List, Optional, Tuple, Union

import torch
import torch.distributed as dist

_LAYER = re.compile(r"^decoder\.layers\.(\d+)\.(.+)$")
_EXPERT = re.compile(r"^mlp\.experts\.local_experts\.(\d+)\.(.+)$")
# TEGroupedMLP (``moe_grouped_gemm`` with TE): one GroupedLinear per fc, expert i's weight is ``weight{i}``
_GROUPED = re.compile(r"^mlp\.experts\.(linear_fc[12])\.(weight|bias)(\d+)$")
HYBRID_FINAL_NORM, GPT_FINAL_NORM = "decoder.final_norm.", "decoder.final_layernorm."
TIED_OUTPUT = "output_layer.weight"
EMBEDDING = "embedding.word_embeddings.weight"


#: how a TP-split dimension is cut: an int ``stride`` (that many equal sections, each split over the
#: ranks: 1 plain, 2 a SwiGLU ``[gate; up]``) or a tuple of the full sections' sizes (each split over
#: the ranks: a Gated DeltaNet's fused ``in_proj`` / ``conv1d``, whose sections are unequal)
Split = Union[int, Tuple[int, ...]]


def tp_partition(param: torch.Tensor, gated: Union[bool, Tuple[int, ...]] = False) -> Optional[Tuple[int, Split]]:
    """``(partition_dim, split)`` of a TP-split parameter, None for a replicated one; ``split`` its
    ``partition_stride`` unless ``gated`` says otherwise (the family's mapping:
    :meth:`~megatron_tepo.models.converters.MegatronToHFLayout.gated`): True for a SwiGLU
    ``linear_fc1`` (``[gate; up]``), which every rank holds as ``[gate_r; up_r]`` -- stride 2,
    whatever its ``partition_stride`` says: megatron-core resets that to 1 on Transformer Engine's
    expert layers (``_set_expert_parameter_attributes``); a tuple of section sizes for a tensor
    whose every rank holds its share of each section (a Gated DeltaNet's ``in_proj`` / ``conv1d``)."""
    if not getattr(param, "tensor_model_parallel", False):
        return None
    dim = int(param.partition_dim)
    if isinstance(gated, tuple) and dim == 0:
        return dim, gated
    return dim, (2 if gated is True and dim == 0 else int(getattr(param, "partition_stride", 1)))


def gated_split(gated: Optional[Callable[[str], object]], name: str) -> Union[bool, Tuple[int, ...]]:
    """What ``gated(name)`` says (see :func:`tp_partition`); False without a ``gated``."""
    if gated is None:
        return False
    said = gated(name)
    return tuple(said) if isinstance(said, (tuple, list)) else bool(said)


def full_sections(length: int, split: Split) -> List[int]:
    """The sizes of the full sections of a dimension of ``length`` cut by ``split``."""
    if isinstance(split, int):
        if split < 1 or length % split:
            raise ValueError(f"a dimension of {length} does not split into {split} equal sections")
        return [length // split] * split
    if sum(split) != length:
        raise ValueError(f"sections {list(split)} do not add up to the dimension's {length}")
    return list(split)


def _check_divisible(shape, dim: int, split: Split, size: int) -> List[int]:
    try:
        sections = full_sections(int(shape[dim]), split)
    except ValueError as e:
        raise ValueError(f"dim {dim} of shape {tuple(shape)}: {e}") from None
    if any(n % size for n in sections):
        what = f"tp_size*stride={size}*{split}" if isinstance(split, int) else f"tp_size={size} in every section {sections}"
        raise ValueError(f"dim {dim} of shape {tuple(shape)} is not divisible by {what}")
    return sections


def shard_tensor(full: torch.Tensor, dim: int, stride: Split, rank: int, size: int) -> torch.Tensor:
    """This rank's shard: every section of ``dim`` (``stride``: :data:`Split`) split into ``size``
    chunks, this rank's chunk of each in order (for an int stride: chunks rank, rank+size, ... of
    ``size*stride``)."""
    sections = _check_divisible(full.shape, dim, stride, size)
    pieces, at = [], 0
    for n in sections:
        c = n // size
        pieces.append(full.narrow(dim, at + rank * c, c))
        at += n
    return torch.cat(pieces, dim=dim) if len(pieces) > 1 else pieces[0].contiguous()


def shard_pieces(shards: List[torch.Tensor], dim: int, stride: Split) -> List[torch.Tensor]:
    """Every rank's shard cut into its sections, in the full tensor's order (section by section,
    rank by rank): what :func:`unshard_tensors` concatenates (piece ``i`` is rank ``i % size``'s)."""
    size = len(shards)
    local = ([shards[0].shape[dim] // stride] * stride if isinstance(stride, int)
             else [n // size for n in stride])
    per_rank = [torch.split(s, local, dim=dim) for s in shards]
    return [per_rank[r][j] for j in range(len(local)) for r in range(size)]


def unshard_tensors(shards: List[torch.Tensor], dim: int, stride: Split) -> torch.Tensor:
    """Inverse of :func:`shard_tensor` given every rank's shard in rank order."""
    return torch.cat(shard_pieces(shards, dim, stride), dim=dim)


def unwrap_model(model: torch.nn.Module) -> torch.nn.Module:
    """Strip DDP / Float16Module wrappers (anything exposing ``.module``)."""
    while hasattr(model, "module") and isinstance(model.module, torch.nn.Module):
        model = model.module
    return model


def layer_offsets(model: torch.nn.Module) -> Dict[int, int]:
    """Local decoder-layer index -> global (HF) layer index, from each layer's ``layer_number``
    (a hybrid stack's ``sublayers_per_hf_layer`` layers share one HF layer)."""
    decoder = getattr(unwrap_model(model), "decoder", None)
    if decoder is None:
        return {}
    per = int(getattr(decoder, "sublayers_per_hf_layer", 1))
    return {j: (int(layer.layer_number) - 1) // per for j, layer in enumerate(decoder.layers)}


def hf_layer_of(model: torch.nn.Module, layer_number: int) -> int:
    """The HF layer index of megatron's 1-based ``layer_number`` (of a module inside ``model``)."""
    decoder = getattr(unwrap_model(model), "decoder", None)
    per = int(getattr(decoder, "sublayers_per_hf_layer", 1)) if decoder is not None else 1
    return (int(layer_number) - 1) // per


def expert_indices(model: torch.nn.Module) -> Dict[int, List[int]]:
    """Local decoder-layer index -> global indices of its local experts (MoE layers only)."""
    decoder = getattr(unwrap_model(model), "decoder", None)
    if decoder is None:
        return {}
    return {j: list(layer.mlp.local_expert_indices) for j, layer in enumerate(decoder.layers)
            if hasattr(getattr(layer, "mlp", None), "local_expert_indices")}


def to_global_name(local_name: str, offsets: Dict[int, int],
                   experts: Optional[Dict[int, List[int]]] = None) -> str:
    """Local -> global layer index (pipeline stage offset) and expert index (expert parallelism);
    a hybrid stack's final norm by its GPT name."""
    m = _LAYER.match(local_name)
    if m is None:
        if local_name.startswith(HYBRID_FINAL_NORM):
            return GPT_FINAL_NORM + local_name[len(HYBRID_FINAL_NORM):]
        return local_name
    j, rest = int(m.group(1)), m.group(2)
    g = _GROUPED.match(rest)
    if g is not None:  # name grouped-GEMM experts like SequentialMLP's, which the HF mapping knows
        rest = f"mlp.experts.local_experts.{g.group(3)}.{g.group(1)}.{g.group(2)}"
    e = _EXPERT.match(rest)
    if e is not None and experts and j in experts:
        rest = f"mlp.experts.local_experts.{experts[j][int(e.group(1))]}.{e.group(2)}"
    return f"decoder.layers.{offsets[j]}.{rest}"


def global_named_parameters(model: torch.nn.Module) -> Iterator[Tuple[str, torch.nn.Parameter]]:
    """``(global megatron name, parameter)`` for one (possibly wrapped) model chunk."""
    inner = unwrap_model(model)
    offsets, experts = layer_offsets(inner), expert_indices(inner)
    for name, param in inner.named_parameters():
        yield to_global_name(name, offsets, experts), param


def is_expert_param(param: torch.Tensor) -> bool:
    """megatron marks expert-parallel parameters with ``allreduce=False``."""
    return not getattr(param, "allreduce", True)


def parallel_groups(tp_group):
    """(dense TP group, expert TP group); the latter is megatron's expert-tensor-parallel group."""
    from megatron.core import parallel_state

    if tp_group is None:
        tp_group = parallel_state.get_tensor_model_parallel_group()
    expert_tp = parallel_state.get_expert_tensor_parallel_group(check_initialized=False)
    return tp_group, (expert_tp if expert_tp is not None else tp_group)


def group_for(param: torch.Tensor, groups) -> object:
    return groups[1] if is_expert_param(param) else groups[0]


def _local_shard(full: torch.Tensor, param: torch.Tensor, group, gated: bool = False) -> torch.Tensor:
    part = tp_partition(param, gated)
    size = dist.get_world_size(group)
    if part is None or size == 1:
        return full
    return shard_tensor(full, part[0], part[1], dist.get_rank(group), size)


def load_megatron_state_into(model_chunks: List[torch.nn.Module],
                             megatron_iter: Iterable[Tuple[str, torch.Tensor]],
                             tied_embeddings: bool, tp_group=None,
                             gated: Optional[Callable[[str], bool]] = None) -> List[str]:
    """Copy full tensors (global Megatron names) into this rank's parameter shards.

    ``gated(name)``: whether a tensor is a SwiGLU ``linear_fc1`` (the family mapping's
    :meth:`~megatron_tepo.models.converters.MegatronToHFLayout.gated`; see :func:`tp_partition`).
    Tensors for other pipeline stages are skipped. With tied embeddings the last stage's
    ``output_layer.weight`` copy is filled from ``embedding.word_embeddings.weight``. Raises
    ValueError naming any shape mismatch, any tensor given twice, and any parameter of this rank
    left unfilled. Returns the names filled.
    """
    groups = parallel_groups(tp_group)
    targets: Dict[str, List[Tuple[str, torch.nn.Parameter]]] = {}
    for chunk in model_chunks:
        for gname, param in global_named_parameters(chunk):
            key = EMBEDDING if (tied_embeddings and gname == TIED_OUTPUT) else gname
            targets.setdefault(key, []).append((gname, param))
    filled, given = set(), set()
    for name, full in megatron_iter:
        if name in given:
            raise ValueError(f"Megatron tensor {name!r} produced twice")
        given.add(name)
        for gname, param in targets.get(name, []):
            group = group_for(param, groups)
            local = _local_shard(full, param, group, gated_split(gated, gname))
            if local.shape != param.shape:
                raise ValueError(f"{gname!r}: full tensor {tuple(full.shape)} gives shard "
                                 f"{tuple(local.shape)} on TP rank {dist.get_rank(group)}/"
                                 f"{dist.get_world_size(group)}, parameter is {tuple(param.shape)}")
            with torch.no_grad():
                param.copy_(local.to(param.dtype))
            filled.add(gname)
    missing = [g for entries in targets.values() for g, _ in entries if g not in filled]
    if missing:
        raise ValueError(f"{len(missing)} Megatron parameter(s) of this rank were not filled: {missing}")
    return sorted(filled)


# ---------------------------------------------------------------------------------------------
# per-rank reading of an HF checkpoint (only this rank's slices)
# ---------------------------------------------------------------------------------------------
#: a temporary buffer (dtype cast, a column-split parameter, a parameter off the CPU) holds at
#: most this many bytes of checkpoint rows; a same-dtype row-split CPU parameter needs none.
READ_BLOCK_BYTES = 64 * 2 ** 20


def _shard_reads(full_shape, part, rank: int, size: int, sources):
    """What to read for one parameter shard: ``[(hf name, (a, b), local row, columns)]``, where
    rows ``[a, b)`` of the HF tensor go to the shard's rows from ``local row`` on, and
    ``columns`` is None (all) or ``[(local col, full col, n)]`` (a shard split on dim 1).
    ``sources``: ``[(hf name, full rows of it or None)]`` as :class:`~.common.MegatronToHFLayout`
    gives them (None: the whole tensor). The split is :func:`shard_tensor`'s."""
    rows = int(full_shape[0])
    segments = []  # (full row a, full row b, hf name, hf row of a)
    for hf, ranges in sources:
        at = 0
        for a, b in (ranges if ranges is not None else ((0, rows),)):
            segments.append((a, b, hf, at))
            at += b - a
    dim, stride = part if (part is not None and size > 1) else (None, 1)
    if dim is not None:
        sections = _check_divisible(full_shape, dim, stride, size)
    if dim is not None and dim != 0 and (dim != 1 or len(full_shape) != 2):
        raise ValueError(f"a shard split on dim {dim} of shape {tuple(full_shape)} is not supported")

    def blocks_of():  # (local start, full start, length) of this rank's share of each section
        out, local, at = [], 0, 0
        for n in sections:
            c = n // size
            out.append((local, at + rank * c, c))
            local, at = local + c, at + n
        return out

    blocks = blocks_of() if dim == 0 else [(0, 0, rows)]
    columns = blocks_of() if dim is not None and dim != 0 else None
    reads = []
    for local, first, n in blocks:
        for a, b, hf, hf_at in segments:
            lo, hi = max(a, first), min(b, first + n)
            if lo < hi:
                reads.append((hf, (hf_at + lo - a, hf_at + hi - a), local + lo - first, columns))
    return reads


def _read_into(ckpt, hf: str, rows, dest: torch.Tensor, columns, block_bytes: int) -> None:
    """Rows ``rows`` of HF tensor ``hf`` (with ``columns``: only those column ranges) into
    ``dest`` (the shard's matching rows): straight into its memory when it is a same-dtype CPU
    tensor, else through a buffer of at most ``block_bytes`` (cast by ``copy_``, which rounds as
    ``Tensor.to`` does). Only the bytes of the shard are read."""
    a, b = rows
    direct = dest.device.type == "cpu" and dest.dtype == ckpt.dtype(hf) and dest.is_contiguous()
    if columns is None and direct:
        ckpt.read_rows_into(hf, rows, dest)
        return
    if columns is not None and direct:
        for local, first, n in columns:
            ckpt.read_columns_into(hf, rows, (first, first + n), dest[:, local:local + n])
        return
    shape = ckpt.shape(hf)
    row_bytes = ckpt.dtype(hf).itemsize
    for d in (shape[1:] if columns is None else (max(n for _, _, n in columns),)):
        row_bytes *= int(d)
    step = max(1, block_bytes // max(row_bytes, 1))
    with torch.no_grad():
        for s in range(a, b, step):
            e = min(b, s + step)
            if columns is None:
                dest[s - a:e - a].copy_(ckpt.get(hf, rows=(s, e)))
                continue
            for local, first, n in columns:
                buf = torch.empty((e - s, n), dtype=ckpt.dtype(hf))
                ckpt.read_columns_into(hf, (s, e), (first, first + n), buf)
                dest[s - a:e - a, local:local + n].copy_(buf)


def load_checkpoint_slices_into(model_chunks: List[torch.nn.Module], ckpt, sources_of,
                                tied_embeddings: bool, tp_group=None,
                                block_bytes: int = READ_BLOCK_BYTES,
                                select: Optional[Callable[[torch.Tensor], bool]] = None) -> List[str]:
    """Fill this rank's parameters from a lazily read HF checkpoint, reading only their slices.

    ``ckpt``: a :class:`~megatron_tepo.checkpoint.hf_io.LazyHFCheckpoint` (or anything with its
    ``shape`` / ``dtype`` / ``file_of`` / ``get`` / ``read_rows_into`` / ``path``);
    ``sources_of(global name, full shape)``: the HF tensors of a full Megatron tensor and their
    rows in it (a :class:`~.common.MegatronToHFLayout`). Each parameter of this rank (its
    pipeline stage, its experts, its TP shard as its ``tensor_model_parallel`` /
    ``partition_dim`` / ``partition_stride`` say) is read row range by row range, a dim-0 shard
    straight into the parameter's memory; nothing is read twice and nothing of another rank.
    Bit for bit what :func:`load_megatron_state_into` gives from full tensors. With tied
    embeddings the last stage's ``output_layer.weight`` copy is read from the embedding.
    ValueError (one line, naming the HF tensor and its file) for a missing tensor or a shape that
    is not the one the parameter needs. ``select(param)``: only the parameters it accepts (e.g. a
    LoRA model's base, not its adapters). Returns the global names filled.
    """
    groups = parallel_groups(tp_group)
    gated = getattr(sources_of, "gated", None)
    filled = []
    for chunk in model_chunks:
        for gname, param in global_named_parameters(chunk):
            if select is not None and not select(param):
                continue
            key = EMBEDDING if (tied_embeddings and gname == TIED_OUTPUT) else gname
            part, group = tp_partition(param, gated_split(gated, key)), group_for(param, groups)
            size = dist.get_world_size(group)
            full_shape = list(param.shape)
            if part is not None and size > 1:
                full_shape[part[0]] *= size
            sources = sources_of(key, full_shape)
            if not sources:
                raise ValueError(f"Megatron parameter {gname!r} has no HF tensor to load from")
            for hf, ranges in sources:
                if hf not in ckpt:
                    raise ValueError(f"HF tensor {hf!r} (for Megatron parameter {gname!r}) is not in the "
                                     f"checkpoint {ckpt.path}")
                want = tuple(full_shape) if ranges is None else (sum(b - a for a, b in ranges), *full_shape[1:])
                if tuple(ckpt.shape(hf)) != want:
                    raise ValueError(f"HF tensor {hf!r} in {ckpt.file_of(hf)} has shape {tuple(ckpt.shape(hf))}, "
                                     f"Megatron parameter {gname!r} needs {want}")
            for hf, rows, local, columns in _shard_reads(full_shape, part, dist.get_rank(group), size, sources):
                dest = param.data[local:local + rows[1] - rows[0]]
                _read_into(ckpt, hf, rows, dest, columns, block_bytes)
            filled.append(gname)
    return sorted(filled)


def checkpoint_slices_equal(model_chunks: List[torch.nn.Module], ckpt, gname: str, hf: str,
                            tp_group=None, block_bytes: int = READ_BLOCK_BYTES) -> bool:
    """Whether this rank's shard of parameter ``gname`` (if it holds it) equals the same slice
    of HF tensor ``hf`` (e.g. a tied ``lm_head.weight`` against the embedding), read in blocks."""
    groups = parallel_groups(tp_group)
    for chunk in model_chunks:
        for name, param in global_named_parameters(chunk):
            if name != gname:
                continue
            part, group = tp_partition(param), group_for(param, groups)
            size = dist.get_world_size(group)
            full_shape = list(param.shape)
            if part is not None and size > 1:
                full_shape[part[0]] *= size
            if tuple(ckpt.shape(hf)) != tuple(full_shape):
                return False
            for _, rows, local, columns in _shard_reads(full_shape, part, dist.get_rank(group), size, [(hf, None)]):
                got = torch.empty((rows[1] - rows[0], *param.shape[1:]), dtype=param.dtype)
                _read_into(ckpt, hf, rows, got, columns, block_bytes)
                if not torch.equal(got, param.data[local:local + got.shape[0]].cpu()):
                    return False
    return True


def mark_tensor_parallel_attributes(model: torch.nn.Module) -> int:
    """Set megatron's ``tensor_model_parallel`` / ``partition_dim`` / ``partition_stride`` on the
    weights of megatron's own tensor-parallel layers where they are missing, as its init would.

    megatron-core (0.16) sets them on ``ColumnParallelLinear`` / ``RowParallelLinear`` /
    ``VocabParallelEmbedding`` weights only inside ``_initialize_affine_weight_cpu`` / ``_gpu``,
    which ``perform_initialization=False`` skips (biases get theirs either way). Transformer
    Engine's layers set them in their own ``reset_parameters``, which runs with or without init
    (megatron passes a no-op ``init_method`` then, and corrects ``partition_stride``); they are
    left alone. The stride is 2 only for the SwiGLU ``linear_fc1`` of megatron's ``MLP``, as its
    constructor passes it. Returns the number of parameters marked."""
    from megatron.core.tensor_parallel.layers import (ColumnParallelLinear, RowParallelLinear,
                                                      VocabParallelEmbedding,
                                                      set_tensor_model_parallel_attributes)
    from megatron.core.transformer.mlp import MLP

    strided = set()
    for module in model.modules():
        if isinstance(module, MLP) and module.config.gated_linear_unit and not getattr(module.config, "use_kitchen", False):
            strided.add(id(module.linear_fc1))
    marked = 0
    for module in model.modules():
        if isinstance(module, (ColumnParallelLinear, VocabParallelEmbedding)):
            dim = 0
        elif isinstance(module, RowParallelLinear):
            dim = 1
        else:
            continue
        weight = getattr(module, "weight", None)
        if weight is None or hasattr(weight, "tensor_model_parallel"):
            continue
        set_tensor_model_parallel_attributes(weight, True, dim, 2 if id(module) in strided else 1)
        marked += 1
    return marked


def grad_of(param: torch.Tensor) -> Optional[torch.Tensor]:
    grad = getattr(param, "main_grad", None)
    return grad if grad is not None else param.grad


def local_tensor(param: torch.Tensor, what: str, name: str) -> torch.Tensor:
    """This rank's shard of ``param`` (``what``: ``param`` or ``grad``), shaped like the parameter."""
    local = param.detach() if what == "param" else grad_of(param)
    if local is None:
        raise ValueError(f"{name!r} has no gradient")
    return local.detach().reshape(param.shape)


def gather_full_tensors(model_chunks: List[torch.nn.Module], what: str = "param",
                        tp_group=None, gated: Optional[Callable[[str], bool]] = None,
                        select: Optional[Callable[[torch.Tensor], bool]] = None
                        ) -> Iterator[Tuple[str, torch.Tensor]]:
    """``(global name, full tensor)`` for every parameter of this rank's stage (and, for MoE, its
    own experts), all-gathered over the (expert-)tensor-parallel group.

    ``what``: "param" or "grad" (``main_grad`` under megatron DDP, else ``.grad``); ``gated``: as
    in :func:`load_megatron_state_into`; ``select(param)``: only the parameters it accepts (e.g.
    LoRA's adapters). Collective over the TP group: every TP rank must iterate it to the end in
    the same order.
    """
    if what not in ("param", "grad"):
        raise ValueError(f"what must be 'param' or 'grad', got {what!r}")
    groups = parallel_groups(tp_group)
    for chunk in model_chunks:
        for gname, param in global_named_parameters(chunk):
            if select is not None and not select(param):
                continue
            local = local_tensor(param, what, gname)
            part = tp_partition(param, gated_split(gated, gname))
            group = group_for(param, groups)
            size = dist.get_world_size(group)
            if part is None or size == 1:
                yield gname, local.clone()
                continue
            shards = [torch.empty_like(local) for _ in range(size)]
            dist.all_gather(shards, local.contiguous(), group=group)
            yield gname, unshard_tensors(shards, part[0], part[1])
