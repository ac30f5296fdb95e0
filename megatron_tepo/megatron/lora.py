"""LoRA adapters on megatron-core's tensor-parallel linears of a built model (``actor.lora``).

:func:`add_lora` patches a built model chunk in place (the model code does not change): every
parameter is frozen (``requires_grad=False``: megatron's DDP and optimizer then hold neither
gradients nor Adam states for them), and each target linear (``actor.lora.target_modules``:
``linear_qkv``, ``linear_proj``, ``linear_fc1``, ``linear_fc2``, by the last part of the module's
name) gains two trainable parameters, ``lora_A`` ``[rank, in]`` and ``lora_B`` ``[out, rank]``,
and adds ``scale * B A x`` (``scale = alpha / rank``) to its output. B starts at zero (step 0 is
the base model); A is drawn uniformly in ``+-1/sqrt(in)`` (PEFT's default) from a generator seeded
by the run's seed and the parameter's global name, so every rank draws the same full A and keeps
its own shard.

Split the way the layer is split:

* column-parallel (``linear_qkv``, ``linear_fc1``; its weight split by output rows): A replicated,
  B split by rows like the weight (so B's rows follow the fused q/k/v per-group interleaving and
  the fused gate/up halves exactly as the weight's do). ``h = x A^T`` is the same on every TP
  rank; its gradient is the sum of every rank's part, so ``h`` passes megatron's
  ``copy_to_tensor_model_parallel_region`` (all-reduce in the backward), and with sequence
  parallelism ``gather_from_sequence_parallel_region`` (A's gradient is then each rank's tokens'
  share: summed over TP by the actor's ``tp_partial_grad`` rule).
* row-parallel (``linear_proj``, ``linear_fc2``; weight split by input columns): A split by
  columns, B replicated; each rank's ``scale * (x_r A_r^T) B^T`` is added to its partial product
  BEFORE megatron's reduction (all-reduce, or reduce-scatter with sequence parallelism), so the
  output needs no collective of its own; B's gradient is each rank's part (``tp_partial_grad``).

The adapters are added inside the linear's ``_forward_impl`` (an instance attribute), the
linear's checkpoint sharding is extended to the adapters (``sharded_state_dict``: B of a
column-parallel linear sharded on dim 0, A of a row-parallel one on dim 1, the others
replicated), and the base weight knows its adapters (:func:`merged_weight`: ``W + scale * B A``
in fp32, per shard, what the weight export sends).

Dropout (``actor.lora.dropout``) acts on the adapter's input, in training passes only (a pass
under ``torch.no_grad``, such as the old-log-prob pass, never drops); the default generator
draws it, which megatron seeds alike on the TP ranks of a column-parallel linear's replicated
input.

Left out: Transformer Engine's linears (``actor.attention: te``: refused), MoE experts and the
Gated DeltaNet's projections (refused / not targets), exactness checks at PP / CP / EP. PEFT's
format (export, ``actor.lora.init_from``, the adapters sent unmerged to SGLang's LoRA endpoints with
``actor.lora.sync: adapters``) is :mod:`.lora_peft`'s.
"""
from __future__ import annotations

import math
import zlib
from functools import partial
from typing import Dict, Iterator, List, Optional, Tuple

import torch
import torch.nn.functional as F

__all__ = ["add_lora", "lora_model_problem", "is_adapter", "merged_weight", "adapter_parameters", "adapter_full_tensors", "lora_modules",
           "LoraError"]


class LoraError(ValueError):
    """The model cannot carry the configured adapters (the message names ``actor.lora`` or the setting)."""


def is_adapter(param: torch.Tensor) -> bool:
    """Whether ``param`` is a LoRA adapter (``lora_A`` / ``lora_B``)."""
    return getattr(param, "lora_adapter", False)


def merged_weight(param: torch.Tensor) -> Optional[torch.Tensor]:
    """This rank's shard of ``W + scale * B A`` (computed in fp32, cast to ``W``'s dtype) when
    ``param`` is the weight of an adapted linear; None for any other parameter. Column-parallel:
    ``B_r A`` (B's rows are W's); row-parallel: ``B A_r`` (A's columns are W's)."""
    module = getattr(param, "lora_module", None)
    if module is None:
        return None
    a, b = module.lora_A.detach().float(), module.lora_B.detach().float()
    return torch.addmm(param.detach().float(), b, a, alpha=module.lora_scale).to(param.dtype)


def lora_modules(model: torch.nn.Module) -> Iterator[Tuple[str, torch.nn.Module]]:
    """``(name, linear)`` of every adapted linear of ``model``."""
    for name, module in model.named_modules():
        if getattr(module, "lora_scale", None) is not None:
            yield name, module


def adapter_parameters(model: torch.nn.Module) -> Iterator[Tuple[str, torch.nn.Parameter]]:
    """``(name, parameter)`` of every adapter of ``model``."""
    for name, param in model.named_parameters():
        if is_adapter(param):
            yield name, param


def lora_model_problem(family_cfg, lora) -> str:
    """Why ``lora`` cannot go on a model of ``family_cfg``, or "" (asked before any process group
    starts): MLP targets on an MoE family would put adapters on its experts, not built yet."""
    mlp = sorted(set(lora.target_modules) & {"linear_fc1", "linear_fc2"})
    if lora is not None and getattr(family_cfg, "moe", None) is not None and mlp:
        return (f"actor.lora.target_modules: {', '.join(mlp)} on an MoE model ({family_cfg.family}) would adapt its "
                f"experts, which is not built yet; target linear_qkv and linear_proj")
    return ""


def adapter_full_tensors(model_chunks, what: str = "param", tp_group=None) -> Iterator[Tuple[str, torch.Tensor]]:
    """``(global name, full tensor)`` of every adapter of this rank's stage (``what``: ``param`` or
    ``grad``), all-gathered over TP where split. Collective over the TP group."""
    from megatron_tepo.megatron.sharding import gather_full_tensors

    return gather_full_tensors(model_chunks, what, tp_group=tp_group, select=is_adapter)


def _linear_kind(module) -> Optional[str]:
    from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear

    if isinstance(module, ColumnParallelLinear):
        return "column"
    if isinstance(module, RowParallelLinear):
        return "row"
    return None


def add_lora(model: torch.nn.Module, lora, seed: int = 1234) -> int:
    """Freeze every parameter of ``model`` (one pipeline stage's chunk, before DDP and
    ``Float16Module``) and put adapters (``lora``: a :class:`~megatron_tepo.config.LoraConfig`) on
    its target linears; returns how many linears were adapted. Raises :class:`LoraError` for a
    target linear it cannot adapt (Transformer Engine's, an MoE expert's) and when no linear of
    the chunk is a target."""
    from megatron_tepo.megatron.sharding import expert_indices, layer_offsets, to_global_name, unwrap_model

    inner = unwrap_model(model)
    offsets, experts = layer_offsets(inner), expert_indices(inner)
    targets = set(lora.target_modules)
    found: List[Tuple[str, torch.nn.Module, str]] = []
    for name, module in inner.named_modules():
        if name.rsplit(".", 1)[-1] not in targets:
            continue
        kind = _linear_kind(module)
        if kind is None:
            raise LoraError(f"actor.lora: {name} is a {type(module).__name__}, not one of megatron's local "
                            f"Column/RowParallelLinear (Transformer Engine's linears are not adapted yet: "
                            f"set actor.attention: sdpa)")
        if getattr(module, "is_expert", False) or getattr(module, "explicit_expert_comm", False):
            raise LoraError(f"actor.lora: {name} is an MoE expert's linear; adapters on experts are not built yet "
                            f"(set actor.lora.target_modules to the attention ones: linear_qkv, linear_proj)")
        if kind == "column" and getattr(module, "disable_grad_reduce", False):
            raise LoraError(f"actor.lora: {name} does not reduce its input gradient over TP; not adaptable")
        found.append((name, module, kind))
    if not found:
        raise LoraError(f"actor.lora.target_modules: {sorted(targets)} match no linear of this model")
    for p in model.parameters():
        p.requires_grad_(False)
    for name, module, kind in found:
        gname = to_global_name(f"{name}.weight", offsets, experts)
        _adapt(module, kind, lora, seed, gname)
    return len(found)


def _tp(module) -> Tuple[int, int]:
    group = getattr(module, "tp_group", None)
    if group is None or not torch.distributed.is_initialized():
        return 0, 1
    return torch.distributed.get_rank(group), torch.distributed.get_world_size(group)


def _adapt(module, kind: str, lora, seed: int, gname: str) -> None:
    weight = module.weight
    rank, size = _tp(module)
    r = lora.rank
    full_in = module.input_size
    gen = torch.Generator().manual_seed((seed * 1000003 + zlib.crc32(gname.encode())) % (2**63))
    bound = 1.0 / math.sqrt(full_in)
    a_full = torch.empty(r, full_in, dtype=torch.float32).uniform_(-bound, bound, generator=gen)
    if kind == "column":
        a = a_full
        b = torch.zeros(weight.shape[0], r)
    else:
        a = a_full.chunk(size, dim=1)[rank]
        b = torch.zeros(weight.shape[0], r)
    lora_a = torch.nn.Parameter(a.to(device=weight.device, dtype=weight.dtype).contiguous())
    lora_b = torch.nn.Parameter(b.to(device=weight.device, dtype=weight.dtype).contiguous())
    split_b = kind == "column" and size > 1
    split_a = kind == "row" and size > 1
    # megatron's TP attributes: the optimizer's grad norm counts a replicated tensor once, and the
    # export / gathers unshard the split ones (B like W's rows, A like W's columns)
    for p, split, dim in ((lora_a, split_a, 1), (lora_b, split_b, 0)):
        p.tensor_model_parallel, p.partition_dim = split, dim
        p.partition_stride = getattr(weight, "partition_stride", 1) if split else 1
        p.lora_adapter = True
    sp = bool(getattr(module, "sequence_parallel", False)) and size > 1
    # the replicated factor whose gradient each TP rank holds a part of (summed over TP by the
    # actor's finalize: megatron/model.py's sum_partial_grads_over_tp)
    if kind == "row" and size > 1:
        lora_b.tp_partial_grad = True
    if kind == "column" and sp:
        lora_a.tp_partial_grad = True
    module.register_parameter("lora_A", lora_a)
    module.register_parameter("lora_B", lora_b)
    module.lora_scale, module.lora_dropout, module.lora_sp = lora.alpha / lora.rank, float(lora.dropout), sp
    weight.lora_module = module
    base_impl = module._forward_impl
    module._forward_impl = partial(_column_forward if kind == "column" else _row_forward, module, base_impl)
    axes = {"weight": 0, "bias": 0, "lora_B": 0} if kind == "column" else {"weight": 1, "lora_A": 1}
    module.sharded_state_dict = partial(_sharded_state_dict, module, axes)


def _dropped(module, x: torch.Tensor) -> torch.Tensor:
    p = module.lora_dropout
    if p > 0 and module.training and torch.is_grad_enabled():
        return F.dropout(x, p, training=True)
    return x


def _column_forward(module, base_impl, input, weight, *args, **kwargs):
    """The base's ``X W_r^T`` plus ``scale * h B_r^T``, ``h = x A^T`` whole on every TP rank."""
    from megatron.core.tensor_parallel.mappings import (copy_to_tensor_model_parallel_region,
                                                        gather_from_sequence_parallel_region)

    out = base_impl(input, weight, *args, **kwargs)
    h = F.linear(_dropped(module, input), module.lora_A)
    if module.lora_sp:  # the sequence shard's h, gathered like the base gathers its input
        h = gather_from_sequence_parallel_region(h, group=module.tp_group)
    else:  # the gradient of h: every TP rank's part, summed
        h = copy_to_tensor_model_parallel_region(h, group=module.tp_group)
    return out + module.lora_scale * F.linear(h, module.lora_B)


def _row_forward(module, base_impl, input, weight, *args, **kwargs):
    """The base's partial product ``x_r W_r^T`` plus this rank's ``scale * (x_r A_r^T) B^T``,
    before megatron's reduction sums them over TP."""
    out = base_impl(input, weight, *args, **kwargs)
    h = F.linear(_dropped(module, input), module.lora_A)
    return out + module.lora_scale * F.linear(h, module.lora_B)


def _sharded_state_dict(module, axes: Dict[str, int], prefix: str = "", sharded_offsets=(), metadata=None):
    """megatron's own sharding of the linear (weight, bias), with the adapters' added."""
    from megatron.core.transformer.utils import make_sharded_tensors_for_checkpoint

    state_dict = module.state_dict(prefix="", keep_vars=True)
    return make_sharded_tensors_for_checkpoint(state_dict, prefix, axes, sharded_offsets, tp_group=module.tp_group,
                                               dp_cp_group=(metadata or {}).get("dp_cp_group"))
