"""The Megatron-core policy actor: old-policy log-probs and one optimizer step per mini-batch.

:class:`MegatronActor` builds a megatron ``GPTModel`` (one chunk per pipeline stage) from a Hugging
Face config (+ optional HF weights), wraps it in megatron DDP, and owns megatron's optimizer
(Adam, optionally the distributed optimizer) and LR schedule. How it computes is one
:class:`~megatron_tepo.config.ActorConfig` (the run config's ``actor`` section, or the same names
as keyword arguments): precision, attention, recompute, sequence packing, sequence parallelism,
the micro-batch token budget, fusions (see :mod:`megatron_tepo.megatron.gpt`).

* :meth:`MegatronActor.compute_log_probs` -- under ``no_grad``, through megatron's pipeline schedule
  (``forward_only``): per-response-token log-probs and entropies ``[B, R]`` of this DP rank's
  batch, returned on every rank of the model replica (broadcast from the last pipeline stage).
* :meth:`MegatronActor.train_step` = :meth:`forward_backward` + :meth:`optimizer_step`.

Precision. ``bf16`` is megatron's mixed precision: the model in ``Float16Module`` with bf16
parameters and compute, the optimizer (plain or distributed) keeping fp32 main parameters and
Adam states, gradients accumulated and reduced in fp32 (``grad_reduce_in_fp32``). The logits stay
bf16 (``fp32_output=False``: no fp32 copy of the ``[tokens, V/tp]`` logits); the vocab-parallel op
computes log-probs and entropy in fp32 from them, and the loss is fp32. ``fp32``: everything fp32.

Micro-batches (:mod:`megatron_tepo.actor.micro_batch`). With ``pack_sequences`` the rows are laid
end to end (THD) up to ``max_tokens_per_micro_batch`` tokens, first-fit decreasing; megatron gets
``packed_seq_params`` (``cu_seqlens``), so RoPE positions restart in every sequence and the core
attention (the sdpa one, or Transformer Engine's) never attends across two sequences. Without it,
rows are right-padded to the micro-batch's longest. Log-probs and entropy are computed once for
every position of the micro-batch and gathered into ``[B, R]``, so packing changes neither the
per-token outputs nor the loss.

Exact gradient bookkeeping. The :class:`~megatron_tepo.algorithms.PolicyLoss` receives
``normalizer`` = the count of the WHOLE mini-batch (summed over micro-batches and all-reduced over DP ranks), so each micro-batch
loss is already its share of the mini-batch loss and the wanted gradient is the plain SUM over
micro-batches and DP ranks. Megatron would otherwise divide twice: the schedule divides each
micro-batch loss by ``num_microbatches`` and DDP scales grads by ``1/dp``. The actor therefore sets
``calculate_per_token_loss=True`` (no division in the schedule, and DDP pre-scaling 1.0 with a
SUM all-reduce; this needs ``average_in_collective=False``), and installs a
``finalize_model_grads_func`` that passes ``num_tokens=None`` so megatron does not divide by its
own token count either. Tests prove it against a single-process Hugging Face reference.

Vocabulary: the HF vocab size must be divisible by TP (checked before any process group starts);
the embedding/output rows are not padded, so the vocab-parallel shard of rank r is exactly token
ids ``[r*V/tp, (r+1)*V/tp)``.

Left out: virtual pipeline stages, context parallelism, fp16 (loss scaling), MoE with PP > 1 on
CPU. Checkpoints: :meth:`MegatronActor.save_checkpoint` / :meth:`MegatronActor.load_checkpoint`
(see :mod:`megatron_tepo.actor.checkpointing`).
"""
from __future__ import annotations

import dataclasses
import json
import math
import os
from functools import partial
from pathlib import Path
from typing import Any, Dict, List, Mapping, Optional, Tuple

import torch
import torch.distributed as dist

from megatron_tepo.algorithms import PolicyLoss
from megatron_tepo.batch import RolloutBatch
from megatron_tepo.actor.batching import equalize_micro_batch_count, plan_micro_batches, plan_packed_micro_batches
from megatron_tepo.actor.micro_batch import MicroBatch, build_micro_batch
from megatron_tepo.layout import ParallelLayout
from megatron_tepo.megatron.fast_paths import use_fused_adam
from megatron_tepo.megatron.parallel import initialize_parallel, validate_layout_here
from megatron_tepo.config import ActorConfig, OptimConfig
from megatron_tepo.megatron.gpt import build_gpt_chunk, family_spec, resolve_actor_config, transformer_config
from megatron_tepo.actor.export import export_hf_state
from megatron_tepo.checkpoint.hf_io import LazyHFCheckpoint
from megatron_tepo.megatron.hf_load import load_hf_checkpoint_into, load_hf_weights_into
from megatron_tepo.models import GPTFamilyConfig, family_config_from_hf

__all__ = ["OptimConfig", "ActorConfig", "MegatronActor", "plan_actor", "actor_transformer_config", "build_lr_scheduler",
           "token_log_probs"]


def _load_hf_config(hf_config):
    """A ``PretrainedConfig``/dict, or a directory / config.json path (read as a dict)."""
    if isinstance(hf_config, (str, os.PathLike)):
        path = Path(hf_config)
        path = path / "config.json" if path.is_dir() else path
        return json.loads(path.read_text())
    return hf_config


def _load_hf_weights(source):
    """What ``hf_weights`` names, ready to load: a state dict as given; for a directory of
    ``*.safetensors`` a :class:`~megatron_tepo.checkpoint.hf_io.LazyHFCheckpoint` (headers only:
    each rank later reads just its own slices); ``pytorch_model*.bin`` files (pickles, which
    cannot be read in part) are loaded whole."""
    if source is None or isinstance(source, Mapping):
        return source
    if isinstance(source, LazyHFCheckpoint):
        return source
    path = Path(source)
    if not path.is_dir():
        raise ValueError(f"hf_weights: {path} is not a directory of HF weights")
    if any(path.glob("*.safetensors")):
        return LazyHFCheckpoint(path)
    state: Dict[str, torch.Tensor] = {}
    files = sorted(path.glob("pytorch_model*.bin"))
    if not files:
        raise ValueError(f"no *.safetensors or pytorch_model*.bin weights under {path}")
    for f in files:
        state.update(torch.load(f, map_location="cpu", weights_only=True))
    return state


def token_log_probs(logits: torch.Tensor, mb: MicroBatch, tp_group=None,
                    temperature: float = 1.0) -> Tuple[torch.Tensor, torch.Tensor]:
    """Log-prob and entropy ``[b, R]`` of each response slot of ``mb`` from its vocab-sharded
    logits (``[.., V/tp]``, one row per position of ``mb.input_ids``): the vocab-parallel op runs
    once over every position (``mb.labels``), then the response slots are gathered
    (``mb.score_index``). Padding slots are 0."""
    from megatron_tepo.ops.vocab_parallel import vocab_parallel_log_probs_and_entropy

    dev = logits.device
    flat = logits.reshape(-1, logits.shape[-1])
    lp, ent = vocab_parallel_log_probs_and_entropy(flat, mb.labels.to(dev), tp_group=tp_group,
                                                   temperature=temperature)
    idx, valid = mb.score_index.to(dev), mb.valid.to(dev)
    zero = torch.zeros((), dtype=lp.dtype, device=dev)
    return torch.where(valid, lp[idx], zero), torch.where(valid, ent[idx], zero)


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
    """What :class:`MegatronActor` will build, checked before any process group starts: the
    settings (``actor_config`` with the keyword ``settings`` on top, ``auto`` resolved for this
    machine) and the family config of ``hf_config`` (an HF config or dict) with their layer spec.
    Raises ValueError naming the setting (unknown names: TypeError) when they, or ``layout`` at
    ``world_size`` (default: the current world), cannot run here."""
    names = [f.name for f in dataclasses.fields(ActorConfig)]
    unknown = set(settings) - set(names)
    if unknown:
        raise TypeError(f"MegatronActor got unknown setting(s) {sorted(unknown)}; the actor's settings are {names}")
    resolved = resolve_actor_config(dataclasses.replace(actor_config or ActorConfig(), **settings))
    if resolved.pack_sequences and resolved.attention == "unfused":
        raise ValueError("actor.pack_sequences=true needs actor.attention sdpa or te (megatron's unfused "
                         "attention cannot keep packed sequences apart)")
    family_cfg = family_config_from_hf(hf_config, spec=family_spec(resolved))
    validate_layout_here(layout, family_cfg, world_size=world_size, sequence_parallel=resolved.sequence_parallel)
    return resolved, family_cfg


def actor_transformer_config(family_cfg: GPTFamilyConfig, layout: ParallelLayout, settings: ActorConfig,
                             initialize: bool = True, on_gpu: bool = False):
    """The megatron ``TransformerConfig`` the actor builds its model with (no process group needed).
    ``initialize=False`` when weights will be loaded: no random init is drawn (and with ``on_gpu``
    the parameters are made on the GPU, never as a host copy)."""
    return transformer_config(
        family_cfg, tp=layout.tp, pp=layout.pp, ep=layout.ep, actor=settings, initialize=initialize,
        variable_seq_lengths=layout.pp > 1,  # token-budget micro-batches vary in shape
        calculate_per_token_loss=True,  # see the module docstring: exact gradient sums
        on_gpu=on_gpu)


class MegatronActor:
    """Policy model on megatron-core: ``compute_log_probs`` and ``train_step`` on DP-local batches.

    Args:
        hf_config: an HF ``PretrainedConfig``, a config dict, or a model directory.
        hf_weights: an HF state dict, or a directory of safetensors (each rank reads only its own
            slices: its TP shards, pipeline stage and experts) or ``pytorch_model*.bin`` files;
            megatron's random init runs only when it is None.
        layout: TP / PP / EP sizes (DP = world / (TP*PP)); validated before any process group.
        optim: optimizer and LR-schedule settings.
        actor_config: how the actor computes (the run config's ``actor`` section); its fields can
            also be given, or overridden, as keyword arguments: ``precision``, ``attention``,
            ``recompute``, ``recompute_num_layers``, ``pack_sequences``, ``sequence_parallel``,
            ``max_tokens_per_micro_batch``, ``fusions``.
        seed: megatron's model-parallel RNG seed (initialisation when no weights are given).
        total_steps: optimizer steps of the whole run (the LR decay horizon unless
            ``optim.lr_decay_steps`` is set).
        process_group_timeout_s: how long every process group waits in one collective (None:
            torch's and megatron's defaults); the trainer derives it from ``fault.watchdog_*_s``.
    """

    def __init__(self, hf_config, hf_weights=None, layout: Optional[ParallelLayout] = None,
                 optim: Optional[OptimConfig] = None, actor_config: Optional[ActorConfig] = None, *,
                 seed: int = 1234, total_steps: int = 1000, process_group_timeout_s: Optional[float] = None,
                 **settings):
        self.layout = layout = layout or ParallelLayout()
        self.settings, self.family_cfg = plan_actor(_load_hf_config(hf_config), layout, actor_config, **settings)
        self.optim_cfg = optim or OptimConfig()
        self.total_steps = total_steps
        self.dp_size = initialize_parallel(layout, self.family_cfg, seed=seed,
                                           sequence_parallel=self.settings.sequence_parallel,
                                           timeout_s=process_group_timeout_s)
        self.device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")

        from megatron.core import parallel_state as ps

        self._ps = ps
        weights = _load_hf_weights(hf_weights)  # (a safetensors directory: its headers only)
        # with weights, no random init: the parameters stay untouched torch.empty until loaded
        self.config = self._transformer_config(initialize=weights is None)
        chunk = self._build_model_chunk()
        chunk.family_cfg = self.family_cfg  # lets load_hf_weights_into find the mapping
        if isinstance(weights, LazyHFCheckpoint):
            try:
                load_hf_checkpoint_into([chunk], weights, self.family_cfg)  # this rank's slices only
            finally:
                if weights is not hf_weights:
                    weights.close()
        elif weights is not None:
            load_hf_weights_into([chunk], weights, self.family_cfg)
        del weights
        if self.bf16:
            from megatron.core.transformer.module import Float16Module

            chunk = Float16Module(self.config, chunk)
        self.model = [self._wrap_ddp(chunk)]
        self.optimizer = self._build_optimizer()
        self.scheduler = self._build_scheduler()
        self.config.grad_scale_func = self.optimizer.scale_loss
        self.config.finalize_model_grads_func = self._finalize_grads

    @property
    def bf16(self) -> bool:
        return self.settings.precision == "bf16"

    @property
    def max_tokens_per_micro_batch(self) -> int:
        return self.settings.max_tokens_per_micro_batch

    @max_tokens_per_micro_batch.setter
    def max_tokens_per_micro_batch(self, value: int) -> None:
        self.settings = dataclasses.replace(self.settings, max_tokens_per_micro_batch=int(value))

    # ------------------------------------------------------------------ construction
    def _transformer_config(self, initialize: bool = True):
        return actor_transformer_config(self.family_cfg, self.layout, self.settings, initialize=initialize,
                                        on_gpu=self.device.type == "cuda")

    def _build_model_chunk(self):
        return build_gpt_chunk(self.config, self.family_cfg, self._ps.is_pipeline_first_stage(),
                               self._ps.is_pipeline_last_stage(), actor=self.settings).to(self.device)

    def ddp_config(self):
        """megatron's ``DistributedDataParallelConfig`` from ``optim`` and ``actor`` settings:
        ``overlap_grad_reduce`` as set; ``overlap_param_gather`` only with the distributed optimizer
        (megatron refuses it otherwise)."""
        from megatron.core.distributed import DistributedDataParallelConfig

        dist_opt = self.optim_cfg.use_distributed_optimizer
        return DistributedDataParallelConfig(
            grad_reduce_in_fp32=True, overlap_grad_reduce=self.settings.overlap_grad_reduce,
            overlap_param_gather=dist_opt and self.settings.overlap_param_gather,
            use_distributed_optimizer=dist_opt,
            average_in_collective=False)  # required by calculate_per_token_loss: SUM over DP

    def _wrap_ddp(self, chunk):
        from megatron.core.distributed import DistributedDataParallel

        ddp = DistributedDataParallel(self.config, self.ddp_config(), chunk)
        if ddp.ddp_config.overlap_grad_reduce:
            # the schedule runs every micro-batch but the last under no_sync: the bucket reductions
            # start during the last backward, and finalize_model_grads waits for them
            self.config.no_sync_func = ddp.no_sync
        return ddp

    def sync_params(self) -> None:
        """Finish the parameter all-gather of the last optimizer step (``overlap_param_gather``
        defers it to the next forward's pre-hooks): called before the weights are read other than
        by a forward (export for the weight sync, checkpoints). A no-op otherwise."""
        for chunk in self.model:
            if chunk.ddp_config.use_distributed_optimizer and chunk.ddp_config.overlap_param_gather:
                chunk.start_param_sync(force_sync=True)

    def _build_optimizer(self):
        from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

        o = self.optim_cfg
        cfg = OptimizerConfig(optimizer="adam", lr=o.lr, min_lr=o.min_lr, weight_decay=o.weight_decay,
                              adam_beta1=o.adam_beta1, adam_beta2=o.adam_beta2, adam_eps=o.adam_eps,
                              clip_grad=o.clip_grad, bf16=self.bf16, fp16=False,
                              params_dtype=torch.bfloat16 if self.bf16 else torch.float32,
                              use_distributed_optimizer=o.use_distributed_optimizer)
        optimizer = get_megatron_optimizer(cfg, self.model)
        use_fused_adam(optimizer)  # torch's fused AdamW where megatron fell back to the per-parameter loop
        return optimizer

    def _build_scheduler(self):
        return build_lr_scheduler(self.optimizer, self.optim_cfg, self.total_steps)

    def _finalize_grads(self, model, num_tokens=None, pg_collection=None, force_all_reduce=False):
        """megatron's finalize_model_grads without its division by the token count (see module doc)."""
        from megatron.core.distributed import finalize_model_grads

        finalize_model_grads(model, None, pg_collection=pg_collection, force_all_reduce=force_all_reduce)

    # ------------------------------------------------------------------ helpers
    @property
    def tp_group(self):
        return self._ps.get_tensor_model_parallel_group()

    @property
    def is_last_stage(self) -> bool:
        return self._ps.is_pipeline_last_stage()

    def _micro_batches(self, batch: RolloutBatch) -> List[MicroBatch]:
        packed = self.settings.pack_sequences
        planner = plan_packed_micro_batches if packed else plan_micro_batches
        plan = planner(batch.seq_lens().tolist(), self.settings.max_tokens_per_micro_batch)
        plan = equalize_micro_batch_count(plan, self._ps.get_data_parallel_group())
        # sequence parallelism splits the tokens (packed) / positions (padded) over the TP ranks
        multiple = self.layout.tp if self.settings.sequence_parallel else 1
        mbs = [build_micro_batch(batch, rows, packed=packed, pad_multiple=multiple) for rows in plan]
        if self._needs_equal_shapes():
            mbs = self._pad_to_common_shapes(mbs)
        # every micro-batch's inputs queued to the device before the first forward (pinned, async)
        return [mb.staged(self.device) for mb in mbs]

    def _needs_equal_shapes(self) -> bool:
        """The MoE allgather dispatcher all-gathers tokens over the expert-parallel group, which
        needs micro-batches of one shape on every rank of that group."""
        return (self.family_cfg.moe is not None and self.layout.ep > 1
                and self.config.moe_token_dispatcher_type == "allgather")

    def _pad_to_common_shapes(self, mbs: List[MicroBatch]) -> List[MicroBatch]:
        """Pad micro-batch i to the largest shape of micro-batch i over the DP group (a pad
        segment when packed; dummy rows and pad columns after every real token otherwise: causal
        attention and per-token routing leave the real tokens untouched)."""
        shapes = torch.tensor([mb.shape for mb in mbs], device=self.device)
        dist.all_reduce(shapes, op=dist.ReduceOp.MAX, group=self._ps.get_data_parallel_group())
        return [mb.padded_to(int(r), int(s)) for mb, (r, s) in zip(mbs, shapes.tolist())]

    def _model_inputs(self, mb: MicroBatch) -> Dict[str, Any]:
        d = self.device
        inputs: Dict[str, Any] = dict(input_ids=mb.input_ids.to(d), position_ids=mb.position_ids.to(d),
                                      attention_mask=None)
        if mb.packed:
            from megatron.core.packed_seq_params import PackedSeqParams

            # the sdpa attention splits on the host (CPU boundaries: no device sync per layer);
            # Transformer Engine's kernels read them on the device
            cu = mb.cu_seqlens.to(d) if self.settings.attention == "te" else mb.cu_seqlens
            inputs["packed_seq_params"] = PackedSeqParams(
                qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu,
                max_seqlen_q=mb.max_seqlen, max_seqlen_kv=mb.max_seqlen)
        elif self.settings.attention == "unfused":  # megatron's local attention wants the mask itself
            s = mb.input_ids.shape[1]
            causal = torch.triu(torch.ones(s, s, dtype=torch.bool, device=d), diagonal=1)
            inputs["attention_mask"] = causal[None, None]
        if self.bf16:
            inputs["fp32_output"] = False  # keep the logits bf16: the vocab op computes in fp32
        return inputs

    def _run_schedule(self, mbs: List[MicroBatch], loss_func_for, forward_only: bool) -> List[Any]:
        from megatron.core.pipeline_parallel import get_forward_backward_func

        def forward_step(data_iterator, model):
            mb = next(data_iterator)
            output = model(**self._model_inputs(mb), labels=None)
            return output, partial(loss_func_for, mb)

        return get_forward_backward_func()(
            forward_step_func=forward_step, data_iterator=iter(mbs), model=self.model,
            num_microbatches=len(mbs), seq_length=max(mb.shape[1] for mb in mbs),
            micro_batch_size=max(mb.shape[0] for mb in mbs), forward_only=forward_only)

    def _log_probs_of(self, mb: MicroBatch, output: torch.Tensor, temperature: float):
        return token_log_probs(output, mb, tp_group=self.tp_group, temperature=temperature)

    def _broadcast_from_last_stage(self, tensor: torch.Tensor) -> torch.Tensor:
        if self._ps.get_pipeline_model_parallel_world_size() > 1:
            dist.broadcast(tensor, src=self._ps.get_pipeline_model_parallel_last_rank(),
                           group=self._ps.get_pipeline_model_parallel_group())
        return tensor

    # ------------------------------------------------------------------ public API
    @torch.no_grad()
    def compute_log_probs(self, batch: RolloutBatch) -> Tuple[torch.Tensor, torch.Tensor]:
        """Old-policy pass: ``(log_probs, entropy)`` fp32 ``[B, R]`` (0 on padding) on every rank,
        under ``softmax(logits / batch.temperature)``."""
        mbs = self._micro_batches(batch)

        def loss_func(mb, output):
            lp, ent = self._log_probs_of(mb, output, batch.temperature)
            return output.new_zeros((), dtype=torch.float32), torch.tensor(0, dtype=torch.int), {"lp": lp, "ent": ent}

        store = self._run_schedule(mbs, loss_func, forward_only=True)
        out = torch.zeros(2, batch.batch_size, batch.response_len, dtype=torch.float32, device=self.device)
        if self.is_last_stage:
            for mb, result in zip(mbs, store):
                if mb.rows:
                    out[0, mb.row_index] = result["lp"][: len(mb.rows)].float()  # drop shape-padding rows
                    out[1, mb.row_index] = result["ent"][: len(mb.rows)].float()
        self._broadcast_from_last_stage(out)
        return out[0].cpu(), out[1].cpu()

    def _global_normalizer(self, batch: RolloutBatch, loss) -> torch.Tensor:
        count = loss.count(batch.response_mask).to(self.device, torch.float64)
        dist.all_reduce(count, group=self._ps.get_data_parallel_group())
        return count

    def forward_backward(self, batch: RolloutBatch, loss: PolicyLoss) -> Dict[str, float]:
        """Zero the grads, run every micro-batch forward+backward with ``loss`` (a
        :class:`~megatron_tepo.algorithms.PolicyLoss`: its settings, its normaliser count and how its
        metrics reduce), leave the summed grads in the DDP buffers (``param.main_grad``). Returns the
        mini-batch loss metrics (all ranks)."""
        if not isinstance(loss, PolicyLoss):
            raise TypeError(f"loss must be a megatron_tepo.algorithms.PolicyLoss, got {type(loss).__name__} "
                            f"(PolicyLoss.of(name, **settings) builds one from keyword settings)")
        if batch.advantages is None or batch.old_log_probs is None:
            raise ValueError("train batches need advantages and old_log_probs")
        normalizer = self._global_normalizer(batch, loss)
        mbs = self._micro_batches(batch)

        def loss_func(mb, output):
            lp, ent = self._log_probs_of(mb, output, batch.temperature)
            f = mb.field  # these rows' per-token fields, already on the device

            value, metrics = loss(
                lp, f("old_log_probs"), f("advantages"), f("response_mask"),
                entropy=ent, old_entropy=f("old_entropy"), ref_log_prob=f("ref_log_probs"),
                rollout_log_prob=f("rollout_log_probs"), normalizer=normalizer)
            tokens = (f("response_mask") != 0).sum()
            return value, torch.tensor(1, dtype=torch.int), {"loss": value.detach(), "tokens": tokens,
                                                             "metrics": metrics}

        for chunk in self.model:
            chunk.zero_grad_buffer()
        self.optimizer.zero_grad()
        store = self._run_schedule(mbs, loss_func, forward_only=False)
        metrics = self._reduce_metrics(store, loss)
        metrics["num_micro_batches"] = float(len(mbs))
        return metrics

    def _reduce_metrics(self, store: List[Dict[str, Any]], loss: PolicyLoss) -> Dict[str, float]:
        """Mini-batch metrics from the micro-batches of every DP rank (last stage, then broadcast
        over the pipeline): ``loss`` (already normalised by the global count) is summed, and each
        metric reduces as the loss says (:meth:`PolicyLoss.metric_weight`, :meth:`PolicyLoss.is_summed`)."""
        result = [None]
        if self.is_last_stage:
            keys = sorted(store[0]["metrics"]) if store else []

            def f64(x):
                return torch.as_tensor(x, dtype=torch.float64, device=self.device)

            # one [micro-batch, 2 + 2 * keys] tensor built on the device: no host sync per micro-batch
            rows = []
            for item in store:
                n = f64(item["tokens"])
                values = {k: f64(v) for k, v in item["metrics"].items()}  # each converted once
                row = [f64(item["loss"]), n]
                for key in keys:
                    w = f64(loss.metric_weight(key, values, n))
                    row += [values[key] * w, w]
                rows.append(torch.stack([r.reshape(()) for r in row]))
            sums = (torch.stack(rows).sum(0) if rows
                    else torch.zeros(2 + 2 * len(keys), dtype=torch.float64, device=self.device))
            dist.all_reduce(sums, group=self._ps.get_data_parallel_group())
            values = sums.tolist()  # the one host read of the step
            out = {"loss": values[0], "tokens": values[1]}
            for k, key in enumerate(keys):
                summed = loss.is_summed(key)
                out[key] = values[2 + 2 * k] if summed else values[2 + 2 * k] / max(values[3 + 2 * k], 1e-30)
            result = [out]
        if self._ps.get_pipeline_model_parallel_world_size() > 1:
            dist.broadcast_object_list(result, src=self._ps.get_pipeline_model_parallel_last_rank(),
                                       group=self._ps.get_pipeline_model_parallel_group())
        return result[0]

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

    def discard_gradients(self) -> None:
        """Drop the gradients of this step (every rank): the next forward-backward starts from zero."""
        self.optimizer.zero_grad()
        for chunk in self.model:
            chunk.zero_grad_buffer()

    def optimizer_step(self) -> Dict[str, float]:
        """Clip, Adam step, advance the LR schedule; returns ``grad_norm`` (pre-clip), ``lr`` used and
        ``skipped_update``. Collective. A non-finite gradient on any rank (:meth:`gradients_finite`)
        skips the update: no weight, Adam state or LR step changes, the gradients are dropped, and
        the result says ``skipped_update: 1.0`` with ``grad_norm`` NaN."""
        lr = float(self.optimizer.param_groups[0]["lr"])
        if not self.gradients_finite():
            self.discard_gradients()
            return {"grad_norm": math.nan, "lr": lr, "skipped_update": 1.0}
        ok, grad_norm, _ = self.optimizer.step()
        if not ok:
            raise RuntimeError("megatron optimizer step reported failure (inf/nan gradients)")
        self.scheduler.step(increment=1)
        return {"grad_norm": float(grad_norm) if grad_norm is not None else math.nan, "lr": lr,
                "skipped_update": 0.0}

    def train_step(self, batch: RolloutBatch, loss: PolicyLoss) -> Dict[str, float]:
        """One optimizer step over a DP-local mini-batch; returns loss, grad_norm, lr and metrics."""
        metrics = self.forward_backward(batch, loss)
        metrics.update(self.optimizer_step())
        return metrics

    # ------------------------------------------------------------------ checkpointing
    def save_checkpoint(self, directory, extra_state: Optional[dict] = None, write_extra=None,
                        asynchronous: bool = False, on_publish=None):
        """Collective: model, optimizer, LR scheduler, every rank's RNG states and the JSON
        ``extra_state`` (e.g. trainer step, data position), written atomically to ``directory``
        (a ``<directory>.tmp-*`` renamed once complete; ``complete`` marker); ``write_extra(tmp)``
        adds files on rank 0, ``on_publish(path)`` runs there once it is complete. ``asynchronous``:
        the tensors are written in the background and the checkpoint is published by a later
        :meth:`finalize_checkpoints` (at most one in flight).
        See :mod:`megatron_tepo.actor.checkpointing`. Returns the path."""
        from megatron_tepo.actor.checkpointing import AsyncSaves, save_actor_checkpoint

        self.sync_params()
        if asynchronous and getattr(self, "_async_saves", None) is None:
            self._async_saves = AsyncSaves()
        return save_actor_checkpoint(self, directory, extra_state, write_extra,
                                     saves=self._async_saves if asynchronous else None, on_publish=on_publish)

    def finalize_checkpoints(self, blocking: bool = False) -> int:
        """Collective: publish the asynchronous saves whose files are written (``blocking``: wait
        for every one); returns how many are still in flight (0 without asynchronous saves)."""
        saves = getattr(self, "_async_saves", None)
        return saves.finalize(blocking=blocking) if saves is not None else 0

    def prefer_settings_over_checkpoint(self) -> None:
        """A later :meth:`load_checkpoint` keeps this actor's optimizer settings (LR schedule,
        weight decay, Adam's betas and eps) instead of the saved ones: the trainer's
        ``train.allow_config_change``. The optimizer's state (moments, step) is still restored."""
        self.scheduler.use_checkpoint_opt_param_scheduler = False
        self.scheduler.override_opt_param_scheduler = True
        self.keep_optim_settings = True

    def apply_optim_settings(self) -> None:
        """``optim``'s peak / floor LR (megatron keeps them per parameter group) and Adam's betas
        and eps into every parameter group (after a load restored the saved ones)."""
        o = self.optim_cfg
        for opt in getattr(self.optimizer, "chained_optimizers", [self.optimizer]):
            for group in opt.optimizer.param_groups:
                group["betas"], group["eps"] = (o.adam_beta1, o.adam_beta2), o.adam_eps
                if "max_lr" in group:
                    group["max_lr"], group["min_lr"] = o.lr, o.min_lr

    def load_checkpoint(self, directory, model_only: bool = False) -> dict:
        """Collective: restore what :meth:`save_checkpoint` wrote (bit-exact continuation at the
        same layout) and return its ``extra_state``. A directory without the ``complete`` marker is
        refused. ``model_only``: just the weights, resharded to this actor's TP/PP."""
        from megatron_tepo.actor.checkpointing import load_actor_checkpoint

        return load_actor_checkpoint(self, directory, model_only=model_only)

    def export_hf_state(self, what: str = "param", dtype=None):
        """This pipeline stage's parameters (or grads) as HF ``(name, full tensor)``, every MoE
        expert included for params; collective over TP (and EP). ``dtype`` casts before the
        gather. A lazy :class:`~megatron_tepo.actor.export.HFExport`: the weight sync reads it as
        buckets gathered to its sender only (``flat_buckets``)."""
        if what == "param":
            self.sync_params()
        return export_hf_state(self.model, self.family_cfg, what=what, tp_group=self.tp_group, dtype=dtype)
