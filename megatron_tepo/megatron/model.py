"""One rank's share of a megatron-core model in training: the one home of the megatron stack.

:func:`build_train_model` turns an HF config (and weights), a :class:`~megatron_tepo.layout.ParallelLayout`
and the run's ``actor`` / ``optim`` settings into a :class:`TrainModel`, in this order:

1. :func:`plan_actor` -- the settings with ``auto`` decided for this machine, the family config
   and the layout checked, before any process group starts;
2. the process groups (:func:`~megatron_tepo.megatron.parallel.initialize_parallel`, their time-out);
3. the ``TransformerConfig`` (:func:`actor_transformer_config`) and the stage's model from the one
   construction function, :func:`~megatron_tepo.megatron.gpt.build_chunk`: megatron's
   ``HybridModel`` (:mod:`.hybrid`) or ``GPTModel`` (:func:`~megatron_tepo.megatron.gpt.build_gpt_chunk`),
   as ``actor.model_builder`` resolves (said once in the log: :func:`announce_builder`); HF weights
   loaded into it, each rank reading its own slices; with ``actor.lora`` the base frozen and
   adapters on its linears (:mod:`.lora`); ``Float16Module`` in bf16;
4. megatron's DDP (gradients reduced in fp32, summed: see ``actor/actor.py`` on exact gradients),
   megatron's optimizer (torch's fused AdamW where megatron falls back to torch,
   :mod:`.fast_paths`) and its LR schedule (:func:`build_lr_scheduler`).

:class:`TrainModel` is the small interface the actor's RL verbs use: the groups it computes over
(``tp_group``, ``dp_group``, ``is_last_stage``, :meth:`TrainModel.broadcast_from_last_stage`),
:meth:`TrainModel.run` (megatron's pipeline schedule over micro-batches, their megatron inputs
built here; each micro-batch's side inputs, :mod:`.side_inputs`, handed to the model for its
forward and recompute: the MoE routing replay of :mod:`.routing_replay` when
``actor.routing_replay`` is on), :meth:`TrainModel.zero_grads`, :meth:`TrainModel.step` (a non-finite gradient on any
rank skips it; else clip, Adam, LR schedule), :meth:`TrainModel.discard_gradients` and
:meth:`TrainModel.sync_params`, and for colocated mode :meth:`TrainModel.offload` /
:meth:`TrainModel.onload` (its optimizer states, gradients and parameters to host memory and back,
bit-identical: :mod:`.offload`). Its ``model`` / ``optimizer`` / ``scheduler`` / ``config`` are
megatron's own objects, which the checkpoints and the weight export read.

Context parallelism (``parallel.cp``): :meth:`TrainModel.inputs` takes a micro-batch already cut
for this rank (:meth:`~megatron_tepo.token_layout.MicroBatch.context_shard`) and hands megatron
the whole micro-batch's padded boundaries with every rank's split; megatron's DDP reduces the
gradients over the data- x context-parallel ranks.

Left out: virtual pipeline stages, fp16 loss scaling, megatron's FSDP.
"""
from __future__ import annotations

import dataclasses
import json
import math
import os
from functools import partial
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist

from megatron_tepo.config import OFFLOAD_LEVELS, ActorConfig, OptimConfig
from megatron_tepo.config.validation import lora_problem, packing_problem
from megatron_tepo.layout import ParallelLayout
from megatron_tepo.megatron.fast_paths import use_fused_adam
from megatron_tepo.megatron.gpt import build_chunk, transformer_config
from megatron_tepo.megatron.hf_load import load_hf_checkpoint_into, load_hf_weights_into
from megatron_tepo.megatron.lm_head import hidden_output, note_hidden_gradient_gemm
from megatron_tepo.megatron.offload import HostOffload
from megatron_tepo.megatron.parallel import initialize_parallel, validate_layout_here
from megatron_tepo.megatron.resolve import builder_problem, family_spec, resolve_actor_config, routing_replay_problem
from megatron_tepo.megatron.routing_replay import RoutingReplay
from megatron_tepo.models import GPTFamilyConfig, family_config_from_hf

#: what :meth:`TrainModel.offload` can move to host memory, in the order it moves them (the parts
#: of the config's ``actor.offload: all``)
OFFLOAD_PARTS = OFFLOAD_LEVELS["all"]

__all__ = ["TrainModel", "OFFLOAD_PARTS", "build_train_model", "plan_actor", "actor_transformer_config", "build_lr_scheduler",
           "load_hf_config", "announce_builder"]

#: what each ``actor.model_builder`` builds, as the log says it
BUILDER_NAMES = {"hybrid": "megatron-core's HybridModel", "gpt": "megatron-core's GPTModel"}
_ANNOUNCED: List[str] = []  # the builder this process said it uses (once)


def announce_builder(requested: str, resolved: str) -> None:
    """Say once per process (global rank 0) which model the actor builds, and why."""
    from megatron_tepo.megatron.compat import mcore_version

    if _ANNOUNCED:
        return
    _ANNOUNCED.append(resolved)
    if dist.is_initialized() and dist.get_rank() != 0:
        return
    if requested == "auto":
        why = (f"megatron-core {mcore_version()} has HybridModel" if resolved == "hybrid"
               else f"megatron-core {mcore_version()} has no HybridModel")
    else:
        why = f"actor.model_builder: {requested}"
    print(f"[megatron_tepo] model: {BUILDER_NAMES[resolved]} ({why})", flush=True)


def load_hf_config(hf_config):
    """A ``PretrainedConfig``/dict, or a directory / config.json path (read as a dict)."""
    if isinstance(hf_config, (str, os.PathLike)):
        path = Path(hf_config)
        path = path / "config.json" if path.is_dir() else path
        return json.loads(path.read_text())
    return hf_config


def build_lr_scheduler(optimizer, o: OptimConfig, total_steps: int = 1000):
    """megatron's ``OptimizerParamScheduler``: linear warmup from ``lr_warmup_init`` to ``lr`` over
    ``lr_warmup_steps``, then constant / linear / cosine decay to ``min_lr`` at ``lr_decay_steps``
    (default: ``total_steps``, the run's number of optimizer steps).
    Step 0 (the first optimizer step) uses the lr at ``num_steps=0``."""
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

    if o.lr_decay_style not in ("constant", "linear", "cosine"):
        raise ValueError(f"lr_decay_style must be constant, linear or cosine, got {o.lr_decay_style!r}")
    decay = o.lr_decay_steps or max(total_steps, o.lr_warmup_steps + 1)
    return OptimizerParamScheduler(
        optimizer, init_lr=o.lr_warmup_init, max_lr=o.lr, min_lr=o.min_lr,
        lr_warmup_steps=o.lr_warmup_steps, lr_decay_steps=decay, lr_decay_style=o.lr_decay_style,
        start_wd=o.weight_decay, end_wd=o.weight_decay, wd_incr_steps=decay, wd_incr_style="constant")


def plan_actor(hf_config, layout: ParallelLayout, actor_config: Optional[ActorConfig] = None,
               world_size: Optional[int] = None, **settings) -> Tuple[ActorConfig, GPTFamilyConfig]:
    """What :func:`build_train_model` will build, checked before any process group starts: the
    settings (``actor_config`` with the keyword ``settings`` on top, ``auto`` resolved for this
    machine) and the family config of ``hf_config`` (an HF config or dict) with their layer spec.
    Raises ValueError naming the setting (unknown names: TypeError) when they, or ``layout`` at
    ``world_size`` (default: the current world), cannot run here."""
    names = [f.name for f in dataclasses.fields(ActorConfig)]
    unknown = set(settings) - set(names)
    if unknown:
        raise TypeError(f"MegatronActor got unknown setting(s) {sorted(unknown)}; the actor's settings are {names}")
    resolved = resolve_actor_config(dataclasses.replace(actor_config or ActorConfig(), **settings))
    if isinstance(resolved.lora, dict):  # (a keyword setting given as plain data)
        from megatron_tepo.config import LoraConfig

        resolved = dataclasses.replace(resolved, lora=LoraConfig(**resolved.lora))
    problem = packing_problem(resolved) or lora_problem(resolved)
    if problem:
        raise ValueError(problem)
    family_cfg = family_config_from_hf(hf_config, spec=family_spec(resolved))
    problem = routing_replay_problem(family_cfg, resolved) or builder_problem(family_cfg, resolved)
    if not problem and resolved.lora is not None:
        from megatron_tepo.megatron.lora import lora_model_problem

        problem = lora_model_problem(family_cfg, resolved.lora, resolved.moe_grouped_gemm, layout.tp)
    if problem:
        from megatron_tepo.config import ConfigError

        raise ConfigError(problem)
    validate_layout_here(layout, family_cfg, world_size=world_size, sequence_parallel=resolved.sequence_parallel,
                         pack_sequences=resolved.pack_sequences)
    return resolved, family_cfg


def actor_transformer_config(family_cfg: GPTFamilyConfig, layout: ParallelLayout, settings: ActorConfig,
                             initialize: bool = True, on_gpu: bool = False):
    """The megatron ``TransformerConfig`` the actor builds its model with (no process group needed).
    ``initialize=False`` when weights will be loaded: no random init is drawn (and with ``on_gpu``
    the parameters are made on the GPU, never as a host copy)."""
    return transformer_config(
        family_cfg, tp=layout.tp, pp=layout.pp, ep=layout.ep, cp=layout.cp, actor=settings, initialize=initialize,
        variable_seq_lengths=layout.pp > 1,  # token-budget micro-batches vary in shape
        calculate_per_token_loss=True,  # the loss is already each micro-batch's share: exact gradient sums
        on_gpu=on_gpu)


def has_gated_delta_net(family_cfg: GPTFamilyConfig) -> bool:
    """Whether the model has Gated DeltaNet layers (a hybrid such as Qwen3.5)."""
    types = getattr(family_cfg, "layer_types", None) or []
    return any(family_cfg.is_linear(i) for i in range(len(types)))


class TrainModel:
    """One rank's megatron-core model in training: its chunks in DDP, the optimizer, the LR schedule
    and the pipeline schedule (see the module docstring). Made by :func:`build_train_model`."""

    def __init__(self, model: List[torch.nn.Module], optimizer, scheduler, config, settings: ActorConfig,
                 family_cfg: GPTFamilyConfig, layout: ParallelLayout, device: torch.device, dp_size: int):
        from megatron.core import parallel_state as ps

        self._ps = ps
        self.model, self.optimizer, self.scheduler, self.config = model, optimizer, scheduler, config
        self.settings, self.family_cfg, self.layout = settings, family_cfg, layout
        # megatron's Gated DeltaNet reads the packed boundaries from the ``*_padded`` fields first and
        # hands them to flash-linear-attention's Triton kernels, which read them on the device (a host
        # tensor there fails: "Pointer argument ... cannot be accessed from Triton (cpu tensor?)", the
        # GPU check of 2026-11-28); the padded fields are the real boundaries without CP, and RoPE
        # reads them too, once per micro-batch
        self.gated_delta_net = has_gated_delta_net(family_cfg)
        self.device, self.dp_size = device, dp_size
        self._host: Dict[str, HostOffload] = {}  # part -> its host copies (colocated mode)
        self._offloaded: List[str] = []
        self._gather_owed = False  # an optimizer step's deferred parameter gather not done yet
        # a LoRA model's base: the HF folder it was loaded from (actor/lora_checkpoint.py), None
        # when it cannot be referenced (its checkpoints then save it in full)
        self.lora_base = None
        self.replay: Optional[RoutingReplay] = None  # MoE routing replay (actor.routing_replay), else None
        self.routing_metrics: Dict[str, float] = {}  # the last replay run's gates
        config.grad_scale_func = optimizer.scale_loss
        config.finalize_model_grads_func = self._finalize_grads

    # ------------------------------------------------------------------ groups
    @property
    def tp_group(self):
        return self._ps.get_tensor_model_parallel_group()

    @property
    def dp_group(self):
        return self._ps.get_data_parallel_group()

    @property
    def cp_group(self):
        return self._ps.get_context_parallel_group()

    @property
    def cp_rank(self) -> int:
        return self._ps.get_context_parallel_rank() if self.layout.cp > 1 else 0

    @property
    def dp_rank(self) -> int:
        return self._ps.get_data_parallel_rank() if self.dp_size > 1 else 0

    @property
    def is_last_stage(self) -> bool:
        return self._ps.is_pipeline_last_stage()

    def broadcast_from_last_stage(self, tensor: torch.Tensor) -> torch.Tensor:
        """``tensor`` as the last pipeline stage holds it, on every stage (in place)."""
        if self._ps.get_pipeline_model_parallel_world_size() > 1:
            dist.broadcast(tensor, src=self._ps.get_pipeline_model_parallel_last_rank(),
                           group=self._ps.get_pipeline_model_parallel_group())
        return tensor

    def broadcast_object_from_last_stage(self, obj):
        """A picklable ``obj`` as the last pipeline stage holds it, on every stage."""
        box = [obj]
        if self._ps.get_pipeline_model_parallel_world_size() > 1:
            dist.broadcast_object_list(box, src=self._ps.get_pipeline_model_parallel_last_rank(),
                                       group=self._ps.get_pipeline_model_parallel_group())
        return box[0]

    # ------------------------------------------------------------------ the schedule
    def inputs(self, mb) -> Dict[str, Any]:
        """megatron's forward inputs for micro-batch ``mb`` (``input_ids`` / ``position_ids``, and
        ``cu_seqlens`` / ``max_seqlen`` when packed: :class:`~megatron_tepo.token_layout.MicroBatch`)."""
        d = self.device
        inputs: Dict[str, Any] = dict(input_ids=mb.input_ids.to(d), position_ids=mb.position_ids.to(d),
                                      attention_mask=None)
        if mb.cp_splits is not None:  # this rank's share of the micro-batch (MicroBatch.context_shard)
            from megatron_tepo.megatron.attention import PackedInputs

            # the whole micro-batch's padded boundaries: RoPE (megatron's, the fast path's) and
            # Transformer Engine's ring attention find this rank's chunks from them; the sdpa
            # attention takes every rank's split and the group
            cu = mb.cp_cu_seqlens.to(d) if self.settings.attention == "te" else mb.cp_cu_seqlens
            padded = cu.to(d) if self.gated_delta_net else cu  # (one copy: already there with te)
            inputs["packed_seq_params"] = PackedInputs(
                qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu, cu_seqlens_q_padded=padded,
                cu_seqlens_kv_padded=padded, max_seqlen_q=mb.cp_max_seqlen, max_seqlen_kv=mb.cp_max_seqlen,
                splits=mb.cp_splits, split_group=self.cp_group)
        elif mb.cu_seqlens is not None:
            from megatron_tepo.megatron.attention import PackedInputs

            # the sdpa attention splits on the host (CPU boundaries: no device sync per layer);
            # Transformer Engine's kernels read them on the device
            cu = mb.cu_seqlens.to(d) if self.settings.attention == "te" else mb.cu_seqlens
            padded = cu.to(d) if self.gated_delta_net else None  # (one copy: already there with te)
            inputs["packed_seq_params"] = PackedInputs(
                qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu, cu_seqlens_q_padded=padded,
                cu_seqlens_kv_padded=padded, max_seqlen_q=mb.max_seqlen, max_seqlen_kv=mb.max_seqlen)
        elif self.settings.attention == "unfused":  # megatron's local attention wants the mask itself
            s = mb.input_ids.shape[1]
            causal = torch.triu(torch.ones(s, s, dtype=torch.bool, device=d), diagonal=1)
            inputs["attention_mask"] = causal[None, None]
        if self.settings.precision == "bf16":
            inputs["fp32_output"] = False  # keep the hidden states bf16: the head computes in fp32
        return inputs

    def run(self, micro_batches: list, loss_func_for: Callable, forward_only: bool,
            routing: Optional[str] = None) -> List[Any]:
        """megatron's pipeline schedule over ``micro_batches`` (each with ``shape`` ``(rows,
        length)``): ``loss_func_for(mb, output)`` -> ``(loss, num_tokens, stored)``; returns the
        stored values of the last stage (forward and, unless ``forward_only``, backward).

        ``routing`` (only with routing replay built: :attr:`replay`): ``replay`` routes every
        forward, and its recompute, to the experts of each micro-batch's side inputs (``mb.side``,
        :mod:`.side_inputs`); ``record`` keeps the routers' own choice
        (``replay.recorded``). The run's gates land in :attr:`routing_metrics`."""
        from megatron.core.pipeline_parallel import get_forward_backward_func

        replay = self.replay if routing is not None else None
        if routing is not None and self.replay is None:
            raise ValueError(f"TrainModel.run(routing={routing!r}) needs actor.routing_replay on")

        def forward_step(data_iterator, model):
            mb = next(data_iterator)
            if replay is not None:
                replay.before_forward(mb.side)
            output = model(**self.inputs(mb), labels=None)
            if replay is not None:
                replay.after_forward()
            return output, partial(loss_func_for, mb)

        self._gather_owed = False  # the forward's pre-hooks finish any deferred parameter gather
        if replay is None:
            return self._schedule(get_forward_backward_func(), forward_step, micro_batches, forward_only)
        replay.start(routing, recomputes=not forward_only and self.config.recompute_granularity == "full")
        try:
            out = self._schedule(get_forward_backward_func(), forward_step, micro_batches, forward_only)
        except BaseException:
            replay.abort()  # targets dropped, no collective
            raise
        self.routing_metrics = replay.finish()
        return out

    def _schedule(self, schedule, forward_step, micro_batches, forward_only):
        return schedule(
            forward_step_func=forward_step, data_iterator=iter(micro_batches), model=self.model,
            num_microbatches=len(micro_batches), seq_length=max(mb.shape[1] for mb in micro_batches),
            micro_batch_size=max(mb.shape[0] for mb in micro_batches), forward_only=forward_only)

    def _finalize_grads(self, model, num_tokens=None, pg_collection=None, force_all_reduce=False):
        """megatron's finalize_model_grads without its division by the token count (the losses
        carry the whole mini-batch's normaliser already); then the sum over the TP ranks of the
        gradients each of them holds a part of (``tp_partial_grad``: the Gated DeltaNet's output
        norm, :class:`~megatron_tepo.megatron.hybrid.GatedOutputNorm`)."""
        from megatron.core.distributed import finalize_model_grads

        finalize_model_grads(model, None, pg_collection=pg_collection, force_all_reduce=force_all_reduce)
        sum_partial_grads_over_tp(model, self.tp_group)

    # ------------------------------------------------------------------ gradients and the step
    def zero_grads(self) -> None:
        for chunk in self.model:
            chunk.zero_grad_buffer()
        self.optimizer.zero_grad()

    def discard_gradients(self) -> None:
        """Drop the gradients of this step (every rank): the next forward-backward starts from zero."""
        self.optimizer.zero_grad()
        for chunk in self.model:
            chunk.zero_grad_buffer()

    def gradients_finite(self) -> bool:
        """Collective (every rank): whether the reduced gradients in every rank's DDP buffers are all
        finite. One sum per buffer, one all-reduce over the world, one host read. Read before the
        optimizer step: megatron copies these into the optimizer's main gradients only inside its
        ``step()``, which then writes whatever they hold (no loss scaler catches a NaN in bf16 or
        fp32)."""
        bad = torch.zeros((), dtype=torch.float32, device=self.device)
        for chunk in self.model:
            buffers = list(getattr(chunk, "buffers", [])) + list(getattr(chunk, "expert_parallel_buffers", []))
            grads = [b.grad_data for b in buffers if getattr(b, "grad_data", None) is not None]
            if not grads:  # (no contiguous buffers) every parameter's main_grad
                grads = [p.main_grad for p in chunk.parameters() if getattr(p, "main_grad", None) is not None]
            for g in grads:
                bad += (~torch.isfinite(g.sum(dtype=torch.float32))).float()  # NaN / inf survive a sum
        if dist.is_initialized() and dist.get_world_size() > 1:
            dist.all_reduce(bad, op=dist.ReduceOp.MAX)
        return float(bad) == 0.0

    def step(self) -> Dict[str, float]:
        """Clip, Adam step, advance the LR schedule; returns ``grad_norm`` (pre-clip), ``lr`` used and
        ``skipped_update``. Collective. A non-finite gradient on any rank (:meth:`gradients_finite`)
        skips the update: no weight, Adam state or LR step changes, the gradients are dropped, and
        the result says ``skipped_update: 1.0`` with ``grad_norm`` NaN."""
        lr = float(self.optimizer.param_groups[0]["lr"])
        if not self.gradients_finite():
            self.discard_gradients()
            return {"grad_norm": math.nan, "lr": lr, "skipped_update": 1.0}
        ok, grad_norm, _ = self.optimizer.step()
        self._gather_owed = True  # (overlap_param_gather: the new weights are gathered later; see sync_params)
        if not ok:
            raise RuntimeError("megatron optimizer step reported failure (inf/nan gradients)")
        self.scheduler.step(increment=1)
        return {"grad_norm": float(grad_norm) if grad_norm is not None else math.nan, "lr": lr,
                "skipped_update": 0.0}

    # ------------------------------------------------------------------ memory (colocated mode)
    def memory_parts(self) -> Dict[str, List[torch.Tensor]]:
        """The tensors of each part that :meth:`offload` moves: ``params`` (the model's parameters,
        in megatron's DDP parameter buffers where it keeps them), ``grads`` (the DDP gradient
        buffers, or each parameter's ``main_grad``) and ``optimizer`` (the optimizer's own tensors:
        Adam's states and the fp32 main parameters where they are copies, never the model's)."""
        params: List[torch.Tensor] = []
        grads: List[torch.Tensor] = []
        for chunk in self.model:
            for b in list(getattr(chunk, "buffers", [])) + list(getattr(chunk, "expert_parallel_buffers", [])):
                if getattr(b, "param_data", None) is not None:
                    params.append(b.param_data)
                if getattr(b, "grad_data", None) is not None:
                    grads.append(b.grad_data)
            for p in chunk.parameters():
                params.append(p)
                if getattr(p, "main_grad", None) is not None:
                    grads.append(p.main_grad)
        model_storages = {t.untyped_storage()._cdata for t in params + grads}
        optimizer: List[torch.Tensor] = []
        for opt in getattr(self.optimizer, "chained_optimizers", None) or [self.optimizer]:
            inner = getattr(opt, "optimizer", None)
            if inner is None:
                continue
            for group in inner.param_groups:
                for p in group["params"]:
                    optimizer += [t for t in (p, p.grad) if t is not None]
            for state in inner.state.values():
                optimizer += [v for v in state.values() if isinstance(v, torch.Tensor)]
        optimizer = [t for t in optimizer if t.untyped_storage()._cdata not in model_storages]
        return {"optimizer": optimizer, "grads": grads, "params": params}

    def offload(self, parts: Sequence[str] = OFFLOAD_PARTS) -> int:
        """Move ``parts`` (of :data:`OFFLOAD_PARTS`) to host memory and free their device memory;
        returns the bytes moved. Returns once the memory is free (:class:`~.offload.HostOffload`).
        Every rank, between steps; :meth:`onload` brings them back, bit-identical."""
        unknown = sorted(set(parts) - set(OFFLOAD_PARTS))
        if unknown:
            raise ValueError(f"offload: unknown part(s) {unknown}; choose from {list(OFFLOAD_PARTS)}")
        self.sync_params()  # a deferred parameter all-gather writes the parameters: finish it first
        tensors = self.memory_parts()
        moved = 0
        for part in OFFLOAD_PARTS:  # optimizer, grads, params: the order onload reverses
            if part not in parts or part in self._offloaded:
                continue
            held = self._host.get(part)
            if held is None or not held.holds(tensors[part]):
                held = self._host[part] = HostOffload(tensors[part])  # host copies made once, then reused
            held.offload()
            self._offloaded.append(part)
            moved += held.nbytes
        return moved

    def onload(self) -> int:
        """Bring back what :meth:`offload` moved (in reverse order); returns the bytes moved."""
        moved = 0
        while self._offloaded:
            held = self._host[self._offloaded.pop()]
            held.onload()
            moved += held.nbytes
        return moved

    @property
    def offloaded(self) -> Tuple[str, ...]:
        """The parts now in host memory."""
        return tuple(self._offloaded)

    def sync_params(self) -> None:
        """Finish the parameter all-gather of the last optimizer step (``overlap_param_gather``
        defers it to the next forward's pre-hooks): called before the weights are read other than
        by a forward (export for the weight sync, checkpoints, an offload). A no-op when no gather
        is owed: a gather between a backward and its step would mark the buckets gathered, and the
        next forward would then skip the gather of the step's new weights."""
        if not self._gather_owed:
            return
        for chunk in self.model:
            if chunk.ddp_config.use_distributed_optimizer and chunk.ddp_config.overlap_param_gather:
                chunk.start_param_sync(force_sync=True)
        self._gather_owed = False


def sum_partial_grads_over_tp(model, tp_group) -> int:
    """All-reduce (sum) over ``tp_group`` the gradients of the parameters marked ``tp_partial_grad``
    (each TP rank computed its own part of the gradient of a replicated parameter); one collective
    for all of them. Returns how many; a no-op at TP 1."""
    if tp_group is None or dist.get_world_size(tp_group) == 1:
        return 0
    grads = []
    for chunk in model:
        for p in chunk.parameters():
            if getattr(p, "tp_partial_grad", False) and p.requires_grad:
                g = getattr(p, "main_grad", None)
                g = p.grad if g is None else g
                if g is not None:
                    grads.append(g)
    if grads:
        from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

        flat = _flatten_dense_tensors([g.data for g in grads])
        dist.all_reduce(flat, group=tp_group)
        for g, synced in zip(grads, _unflatten_dense_tensors(flat, grads)):
            g.data.copy_(synced)
    return len(grads)


def ddp_config(optim: OptimConfig, settings: ActorConfig):
    """megatron's ``DistributedDataParallelConfig`` from ``optim`` and ``actor`` settings:
    ``overlap_grad_reduce`` as set; ``overlap_param_gather`` only with the distributed optimizer
    (megatron refuses it otherwise); gradients reduced in fp32 and summed (``calculate_per_token_loss``
    needs ``average_in_collective=False``)."""
    from megatron.core.distributed import DistributedDataParallelConfig

    dist_opt = optim.use_distributed_optimizer
    return DistributedDataParallelConfig(
        grad_reduce_in_fp32=True, overlap_grad_reduce=settings.overlap_grad_reduce,
        overlap_param_gather=dist_opt and settings.overlap_param_gather,
        use_distributed_optimizer=dist_opt,
        average_in_collective=False)


def build_optimizer(optim: OptimConfig, model: List[torch.nn.Module], bf16: bool):
    """megatron's Adam (plain or distributed) over ``model``; torch's fused AdamW where megatron
    falls back to torch (no TE, no apex)."""
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

    o = optim
    cfg = OptimizerConfig(optimizer="adam", lr=o.lr, min_lr=o.min_lr, weight_decay=o.weight_decay,
                          adam_beta1=o.adam_beta1, adam_beta2=o.adam_beta2, adam_eps=o.adam_eps,
                          clip_grad=o.clip_grad, bf16=bf16, fp16=False,
                          params_dtype=torch.bfloat16 if bf16 else torch.float32,
                          use_distributed_optimizer=o.use_distributed_optimizer)
    optimizer = get_megatron_optimizer(cfg, model)
    use_fused_adam(optimizer)  # torch's fused AdamW where megatron fell back to the per-parameter loop
    return optimizer


def build_train_model(hf_config, weights=None, layout: Optional[ParallelLayout] = None,
                      optim: Optional[OptimConfig] = None, actor_config: Optional[ActorConfig] = None, *,
                      seed: int = 1234, total_steps: int = 1000, process_group_timeout_s: Optional[float] = None,
                      **settings) -> TrainModel:
    """This rank's :class:`TrainModel` (see the module docstring for the steps; the arguments are
    :class:`~megatron_tepo.actor.MegatronActor`'s). ``weights``: None (megatron's random init), an
    HF state dict, or an open lazy reader of an HF safetensors checkpoint (``read_rows_into``:
    :class:`~megatron_tepo.checkpoint.hf_io.LazyHFCheckpoint`, which the caller closes), from which
    each rank reads only its own slices."""
    from megatron.core.distributed import DistributedDataParallel

    layout = layout or ParallelLayout()
    optim = optim or OptimConfig()
    resolved, family_cfg = plan_actor(load_hf_config(hf_config), layout, actor_config, **settings)
    dp_size = initialize_parallel(layout, family_cfg, seed=seed, sequence_parallel=resolved.sequence_parallel,
                                  timeout_s=process_group_timeout_s, pack_sequences=resolved.pack_sequences)
    device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    from megatron.core import parallel_state as ps

    # with weights, no random init: the parameters stay untouched torch.empty until loaded
    config = actor_transformer_config(family_cfg, layout, resolved, initialize=weights is None,
                                      on_gpu=device.type == "cuda")
    announce_builder(settings.get("model_builder", (actor_config or ActorConfig()).model_builder),
                     resolved.model_builder)
    chunk = build_chunk(config, family_cfg, ps.is_pipeline_first_stage(), ps.is_pipeline_last_stage(),
                        actor=resolved).to(device)
    chunk.family_cfg = family_cfg  # lets load_hf_weights_into find the mapping
    # the last stage returns its final hidden states; the actor's head scores the positions it needs
    output_weight = hidden_output(chunk) if ps.is_pipeline_last_stage() else None
    if output_weight is not None:  # (said once, by the last stage's first rank)
        note_hidden_gradient_gemm(device, resolved.precision == "bf16", resolved.lm_head,
                                  say=ps.get_tensor_model_parallel_rank() == 0
                                  and ps.get_data_parallel_rank(with_context_parallel=True) == 0)
    if hasattr(weights, "read_rows_into"):
        load_hf_checkpoint_into([chunk], weights, family_cfg)  # this rank's slices only
    elif weights is not None:
        load_hf_weights_into([chunk], weights, family_cfg)
    if resolved.lora is not None:  # the base frozen, adapters on its linears (before DDP sees the parameters)
        from megatron_tepo.megatron.lora import add_lora

        add_lora(chunk, resolved.lora, seed=seed)
        if resolved.lora.init_from:  # a PEFT adapter folder: its adapters, each rank its shard (a resume then loads its own)
            from megatron_tepo.megatron.lora_peft import load_peft_adapter_into

            load_peft_adapter_into([chunk], resolved.lora.init_from, family_cfg, resolved.lora)
    bf16 = resolved.precision == "bf16"
    if bf16:
        from megatron.core.transformer.module import Float16Module

        chunk = Float16Module(config, chunk)
    replay = None
    if resolved.routing_replay != "off":  # megatron built a RouterReplay per router; the actor drives them
        sp = resolved.sequence_parallel
        replay = RoutingReplay.attach([chunk], config, family_cfg.routing_shape(), device,
                                      sp_rank=ps.get_tensor_model_parallel_rank() if sp else 0,
                                      sp_size=layout.tp if sp else 1)
    ddp = DistributedDataParallel(config, ddp_config(optim, resolved), chunk)
    if ddp.ddp_config.overlap_grad_reduce:
        # the schedule runs every micro-batch but the last under no_sync: the bucket reductions
        # start during the last backward, and finalize_model_grads waits for them
        config.no_sync_func = ddp.no_sync
    model = [ddp]
    optimizer = build_optimizer(optim, model, bf16)
    scheduler = build_lr_scheduler(optimizer, optim, total_steps)
    train_model = TrainModel(model, optimizer, scheduler, config, resolved, family_cfg, layout, device, dp_size)
    train_model.replay = replay
    train_model.output_weight = output_weight
    return train_model
