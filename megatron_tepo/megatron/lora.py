"""LoRA adapters on megatron-core's tensor-parallel linears of a built model (``actor.lora``).

:func:`add_lora` patches a built model chunk in place (the model code does not change): every
parameter is frozen (``requires_grad=False``: megatron's DDP and optimizer then hold neither
gradients nor Adam states for them), and each target linear (``actor.lora.target_modules``:
``linear_qkv``, ``linear_proj``, ``linear_fc1``, ``linear_fc2``, by the last part of the module's
name) gains two trainable parameters, ``lora_A`` ``[rank, in]`` and ``lora_B`` ``[out, rank]``,
and adds ``scale * B A x`` (``scale = alpha / rank``) to its output. The targets' names are
megatron's: an MoE layer's ``linear_fc1`` / ``linear_fc2`` are every local expert's (megatron's
``SequentialMLP`` of local linears), a Gated DeltaNet's ``in_proj`` / ``out_proj`` its projections
(column- and row-parallel like the attention's). B starts at zero (step 0 is
the base model); A is drawn uniformly in ``+-1/sqrt(in)`` (PEFT's default) from a generator seeded
by the run's seed and the parameter's global name, so every rank draws the same full A and keeps
its own shard.

Split the way the layer is split:

* column-parallel (``linear_qkv``, ``linear_fc1``, ``in_proj``; its weight split by output rows): A replicated,
  B split by rows like the weight (so B's rows follow the fused q/k/v per-group interleaving and
  the fused gate/up halves exactly as the weight's do). ``h = x A^T`` is the same on every TP
  rank; its gradient is the sum of every rank's part, so ``h`` passes megatron's
  ``copy_to_tensor_model_parallel_region`` (all-reduce in the backward), and with sequence
  parallelism ``gather_from_sequence_parallel_region`` (A's gradient is then each rank's tokens'
  share: summed over TP by the actor's ``tp_partial_grad`` rule).
* row-parallel (``linear_proj``, ``linear_fc2``, ``out_proj``; weight split by input columns): A split by
  columns, B replicated; each rank's ``scale * (x_r A_r^T) B^T`` is added to its partial product
  BEFORE megatron's reduction (all-reduce, or reduce-scatter with sequence parallelism), so the
  output needs no collective of its own; B's gradient is each rank's part (``tp_partial_grad``).
* an expert's linear (expert parallelism): its adapters live with the expert on its EP rank, whole
  (expert TP 1: :func:`lora_model_problem` refuses experts split over TP), and carry the weight's
  ``allreduce=False``, so megatron's DDP reduces their gradients over the expert-data-parallel
  group as it does the expert's weights, and the gathers name them by their global expert.

The adapters are added inside the linear's ``_forward_impl`` (an instance attribute), the
linear's checkpoint sharding is extended to the adapters (``sharded_state_dict``: B of a
column-parallel linear sharded on dim 0 -- a SwiGLU ``linear_fc1``'s in its gate and up halves,
as megatron's MLP saves W, so a checkpoint reshards to another TP --, A of a row-parallel one on
dim 1, the others replicated), and the base weight knows its adapters (:func:`merged_weight`: ``W + scale * B A``
in fp32, per shard, what the weight export sends).

Dropout (``actor.lora.dropout``) acts on the adapter's input, in training passes only (a pass
under ``torch.no_grad``, such as the old-log-prob pass, never drops); the default generator
draws it, which megatron seeds alike on the TP ranks of a column-parallel linear's replicated
input.

Left out: Transformer Engine's linears (``actor.attention: te``: refused) and its grouped experts
(``moe_grouped_gemm: on``: refused), experts split over tensor parallelism (refused), the
sections of a Gated DeltaNet ``in_proj``'s B at TP > 1 (B's rows follow the weight's on each rank,
so training and the merged export are right, but :func:`adapter_full_tensors` cuts B as plain
rows, not per q/k/v/z/b/a section, and a checkpoint saves it so: its load at another TP is refused,
``actor/checkpointing.py:lora_tp_problem``). PEFT's format (export, ``actor.lora.init_from``, the
adapters sent unmerged to SGLang's LoRA endpoints with ``actor.lora.sync: adapters``) is
:mod:`.lora_peft`'s: SGLang serves no adapter on an expert or a Gated DeltaNet projection, so
``sync: adapters`` refuses a model that would carry them (:func:`lora_model_problem`).
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


def lora_model_problem(family_cfg, lora, moe_grouped_gemm: str = "off", tp: int = 1) -> str:
    """Why ``lora`` cannot go on a model of ``family_cfg``, or "" (asked before any process group
    starts, with the resolved ``actor.moe_grouped_gemm`` and the layout's TP size): MLP targets on
    an MoE family adapt its experts, which must be megatron's ``SequentialMLP`` of local linears
    (grouped GEMM off), each expert whole on its rank (expert TP, megatron's default: the TP size, 1).
    With ``sync: adapters`` no adapter SGLang cannot serve (an expert's, a Gated DeltaNet's)."""
    if lora is None:
        return ""
    targets = set(lora.target_modules)
    moe = getattr(family_cfg, "moe", None) is not None
    mlp = sorted(targets & {"linear_fc1", "linear_fc2"}) if moe else []
    gdn = sorted(targets & {"in_proj", "out_proj"}) if getattr(family_cfg, "linear_attention", None) else []
    if getattr(lora, "sync", "merged") == "adapters" and (mlp or gdn):
        what = "an MoE expert's" if mlp else "a Gated DeltaNet layer's"
        return (f"actor.lora.sync: adapters sends PEFT adapters to SGLang, whose LoRA serves none of {what} "
                f"linears (actor.lora.target_modules: {', '.join(mlp + gdn)} on {family_cfg.family}): use "
                f"sync: merged, or leave them out of target_modules")
    if not mlp:
        return ""
    if moe_grouped_gemm == "on":
        return (f"actor.lora.target_modules: {', '.join(mlp)} on an MoE model ({family_cfg.family}) adapt its "
                f"experts, one local linear per expert: set actor.moe_grouped_gemm: off (Transformer Engine's "
                f"grouped experts are not adapted)")
    if tp > 1:
        return (f"actor.lora.target_modules: {', '.join(mlp)} on an MoE model ({family_cfg.family}) adapt its "
                f"experts, which parallel.tp: {tp} splits (expert TP); adapters on split experts are not built "
                f"yet: use parallel.tp: 1 (with ep), or target linear_qkv and linear_proj only")
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
    target linear it cannot adapt (Transformer Engine's, an expert's split over TP) and when no
    linear of the chunk is a target."""
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
        if getattr(module, "is_expert", False) and _tp(module)[1] > 1:
            raise LoraError(f"actor.lora: {name} is an MoE expert's linear split over tensor parallelism "
                            f"(expert TP {_tp(module)[1]}); adapters on TP-split experts are not built yet "
                            f"(use parallel.tp: 1 with ep, or target linear_qkv and linear_proj only)")
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
        # an expert's adapters are reduced over the expert-data-parallel group as its weight is
        # (megatron's ``allreduce=False``), and the gathers / export find its expert by it
        p.allreduce = getattr(weight, "allreduce", True)
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
    # a SwiGLU linear_fc1's rows are [gate_r; up_r] on each rank: B is saved as megatron saves W
    gated = (kind == "column" and gname.endswith("linear_fc1.weight")
             and getattr(module.config, "gated_linear_unit", False))
    module.sharded_state_dict = partial(_sharded_state_dict, module, axes, gated)


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


def _sharded_state_dict(module, axes: Dict[str, int], gated: bool, prefix: str = "", sharded_offsets=(),
                        metadata=None):
    """megatron's own sharding of the linear (weight, bias), with the adapters' added; a gated
    ``linear_fc1``'s B split into its gate and up halves as megatron's MLP splits W (so a checkpoint
    reshards to another TP)."""
    import inspect

    from megatron.core.transformer.mlp import apply_swiglu_sharded_factory
    from megatron.core.transformer.utils import make_sharded_tensors_for_checkpoint

    metadata = metadata or {}
    state_dict = module.state_dict(prefix="", keep_vars=True)
    out = make_sharded_tensors_for_checkpoint(state_dict, prefix, axes, sharded_offsets, tp_group=module.tp_group,
                                              dp_cp_group=metadata.get("dp_cp_group"))
    if gated:
        accepts = inspect.signature(apply_swiglu_sharded_factory).parameters  # (tp / dp groups: megatron-core 0.17 on)
        kw = {k: v for k, v in (("tp_group", module.tp_group), ("dp_group", metadata.get("dp_cp_group")))
              if k in accepts}
        key = f"{prefix}lora_B"
        out[key] = apply_swiglu_sharded_factory(out[key], sharded_offsets,
                                                metadata.get("singleton_local_shards", False), **kw)
    return out
