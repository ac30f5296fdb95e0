"""Generic TP/PP placement of full tensors onto Megatron parameters, and back.

Nothing here knows a parameter by name: the tensor-parallel split of each parameter is read from its
own megatron metadata (``tensor_model_parallel``, ``partition_dim``, ``partition_stride``, as
set by ``ColumnParallelLinear`` / ``RowParallelLinear`` / ``VocabParallelEmbedding``), and the
pipeline placement from each layer's global ``layer_number`` (so ``decoder.layers.{j}`` of a stage
is global layer ``layer_number - 1``).

* :func:`shard_tensor` / :func:`unshard_tensors` -- the stride-aware split used by megatron's
  ``_initialize_affine_weight_cpu`` and its inverse.
* :func:`global_named_parameters` -- a chunk's parameters under *global* Megatron names.
* :func:`load_megatron_state_into` / :func:`gather_full_tensors` -- fill this rank's shards from
  full tensors (every parameter checked filled), and all-gather full tensors (params or grads)
  over the TP group, one collective per tensor, Megatron names (this rank's experts only).
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
from typing import Dict, Iterable, Iterator, List, Optional, Tuple

import torch
import torch.distributed as dist

_LAYER = re.compile(r"^decoder\.layers\.(\d+)\.(.+)$")
_EXPERT = re.compile(r"^mlp\.experts\.local_experts\.(\d+)\.(.+)$")
TIED_OUTPUT = "output_layer.weight"
EMBEDDING = "embedding.word_embeddings.weight"


def tp_partition(param: torch.Tensor) -> Optional[Tuple[int, int]]:
    """``(partition_dim, partition_stride)`` of a TP-split parameter, None for a replicated one."""
    if not getattr(param, "tensor_model_parallel", False):
        return None
    return int(param.partition_dim), int(getattr(param, "partition_stride", 1))


def shard_tensor(full: torch.Tensor, dim: int, stride: int, rank: int, size: int) -> torch.Tensor:
    """This rank's shard: split ``dim`` into ``size*stride`` chunks, take chunks rank, rank+size, ..."""
    if full.shape[dim] % (size * stride):
        raise ValueError(f"dim {dim} of shape {tuple(full.shape)} is not divisible by "
                         f"tp_size*stride={size}*{stride}")
    chunk = full.shape[dim] // (size * stride)
    pieces = torch.split(full, chunk, dim=dim)[rank::size]
    return torch.cat(pieces, dim=dim)


def unshard_tensors(shards: List[torch.Tensor], dim: int, stride: int) -> torch.Tensor:
    """Inverse of :func:`shard_tensor` given every rank's shard in rank order."""
    per_rank = [torch.chunk(s, stride, dim=dim) for s in shards]
    return torch.cat([per_rank[r][s] for s in range(stride) for r in range(len(shards))], dim=dim)


def unwrap_model(model: torch.nn.Module) -> torch.nn.Module:
    """Strip DDP / Float16Module wrappers (anything exposing ``.module``)."""
    while hasattr(model, "module") and isinstance(model.module, torch.nn.Module):
        model = model.module
    return model


def layer_offsets(model: torch.nn.Module) -> Dict[int, int]:
    """Local decoder-layer index -> global layer index, from each layer's ``layer_number``."""
    decoder = getattr(unwrap_model(model), "decoder", None)
    if decoder is None:
        return {}
    return {j: int(layer.layer_number) - 1 for j, layer in enumerate(decoder.layers)}


def expert_indices(model: torch.nn.Module) -> Dict[int, List[int]]:
    """Local decoder-layer index -> global indices of its local experts (MoE layers only)."""
    decoder = getattr(unwrap_model(model), "decoder", None)
    if decoder is None:
        return {}
    return {j: list(layer.mlp.local_expert_indices) for j, layer in enumerate(decoder.layers)
            if hasattr(getattr(layer, "mlp", None), "local_expert_indices")}


def to_global_name(local_name: str, offsets: Dict[int, int],
                   experts: Optional[Dict[int, List[int]]] = None) -> str:
    """Local -> global layer index (pipeline stage offset) and expert index (expert parallelism)."""
    m = _LAYER.match(local_name)
    if m is None:
        return local_name
    j, rest = int(m.group(1)), m.group(2)
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


def _local_shard(full: torch.Tensor, param: torch.Tensor, group) -> torch.Tensor:
    part = tp_partition(param)
    size = dist.get_world_size(group)
    if part is None or size == 1:
        return full
    return shard_tensor(full, part[0], part[1], dist.get_rank(group), size)


def load_megatron_state_into(model_chunks: List[torch.nn.Module],
                             megatron_iter: Iterable[Tuple[str, torch.Tensor]],
                             tied_embeddings: bool, tp_group=None) -> List[str]:
    """Copy full tensors (global Megatron names) into this rank's parameter shards.

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
            local = _local_shard(full, param, group)
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
                        tp_group=None) -> Iterator[Tuple[str, torch.Tensor]]:
    """``(global name, full tensor)`` for every parameter of this rank's stage (and, for MoE, its
    own experts), all-gathered over the (expert-)tensor-parallel group.

    ``what``: "param" or "grad" (``main_grad`` under megatron DDP, else ``.grad``). Collective
    over the TP group: every TP rank must iterate it to the end in the same order.
    """
    if what not in ("param", "grad"):
        raise ValueError(f"what must be 'param' or 'grad', got {what!r}")
    groups = parallel_groups(tp_group)
    for chunk in model_chunks:
        for gname, param in global_named_parameters(chunk):
            local = local_tensor(param, what, gname)
            part = tp_partition(param)
            group = group_for(param, groups)
            size = dist.get_world_size(group)
            if part is None or size == 1:
                yield gname, local.clone()
                continue
            shards = [torch.empty_like(local) for _ in range(size)]
            dist.all_gather(shards, local.contiguous(), group=group)
            yield gname, unshard_tensors(shards, part[0], part[1])
