"""The Megatron-core policy actor: the RL verbs -- old-policy log-probs, the loss over micro-batches
and one optimizer step per mini-batch, their metrics, the weight export and the checkpoints.

:class:`MegatronActor` sits on a :class:`~megatron_tepo.megatron.model.TrainModel`, the megatron
stack's one home (:mod:`megatron_tepo.megatron.model`: the model built from a Hugging Face config
and weights, megatron DDP, the optimizer, the LR schedule and the pipeline schedule); here the
rollout batch becomes micro-batches and the per-token log-probs, entropy and loss of the RL
algorithms. How it computes is one :class:`~megatron_tepo.config.ActorConfig` (the run config's
``actor`` section, or the same names as keyword arguments): precision, attention, recompute,
sequence packing, sequence parallelism, the micro-batch token budget, fusions (see
:mod:`megatron_tepo.megatron.gpt`).

* :meth:`MegatronActor.compute_log_probs` -- under ``no_grad``, through megatron's pipeline schedule
  (``forward_only``): per-response-token log-probs and entropies ``[B, R]`` of this DP rank's
  batch, returned on every rank of the model replica (broadcast from the last pipeline stage).
* :meth:`MegatronActor.train_step` = :meth:`forward_backward` + :meth:`optimizer_step`.

Precision. ``bf16`` is megatron's mixed precision: the model in ``Float16Module`` with bf16
parameters and compute, the optimizer (plain or distributed) keeping fp32 main parameters and
Adam states, gradients accumulated and reduced in fp32 (``grad_reduce_in_fp32``). The final hidden
states stay bf16 (``fp32_output=False``); the LM head computes log-probs and entropy in fp32 from
bf16 logits, and the loss is fp32. ``fp32``: everything fp32.

The LM head (``actor.lm_head``, :mod:`megatron_tepo.megatron.lm_head`): the last stage's model
returns its final hidden states, and the head runs only at the positions that score a response
slot. ``fused`` (the default) never holds their ``[tokens, V/tp]`` logits
(:mod:`megatron_tepo.ops.lm_head`); ``materialized`` makes them and runs the vocab op.

Micro-batches (:mod:`megatron_tepo.token_layout`). With ``pack_sequences`` the rows are laid
end to end (THD) up to ``max_tokens_per_micro_batch`` tokens, first-fit decreasing; megatron gets
``packed_seq_params`` (``cu_seqlens``), so RoPE positions restart in every sequence and the core
attention (the sdpa one, or Transformer Engine's) never attends across two sequences. Without it,
rows are right-padded to the micro-batch's longest. Log-probs and entropy are computed once for
every scored position of the micro-batch and laid into ``[B, R]``, so packing changes neither the
per-token outputs nor the loss.

Exact gradient bookkeeping. The :class:`~megatron_tepo.algorithms.PolicyLoss` receives
``normalizer`` = the count of the WHOLE mini-batch (summed over micro-batches and all-reduced over DP ranks), so each micro-batch
loss is already its share of the mini-batch loss and the wanted gradient is the plain SUM over
micro-batches and DP ranks. Megatron would otherwise divide twice: the schedule divides each
micro-batch loss by ``num_microbatches`` and DDP scales grads by ``1/dp``. The model is therefore
built with ``calculate_per_token_loss=True`` (no division in the schedule, and DDP pre-scaling 1.0
with a SUM all-reduce; this needs ``average_in_collective=False``) and a
``finalize_model_grads_func`` that passes ``num_tokens=None`` so megatron does not divide by its
own token count either (:mod:`megatron_tepo.megatron.model`). Tests prove it against a
single-process Hugging Face reference.

Vocabulary: the HF vocab size must be divisible by TP (checked before any process group starts);
the embedding/output rows are not padded, so the vocab-parallel shard of rank r is exactly token
ids ``[r*V/tp, (r+1)*V/tp)``.

MoE routing replay (``actor.routing_replay``, :mod:`megatron_tepo.megatron.routing_replay`): with
``r3`` both verbs route every token to ``batch.routed_experts`` (the engine's); with ``r2``
:meth:`MegatronActor.compute_log_probs` records the actor's own routing into
``batch.routed_experts`` and :meth:`MegatronActor.forward_backward` replays it. The routing travels
as each micro-batch's side inputs; the gates of the last pass are :attr:`MegatronActor.routing_metrics`
(and part of the training metrics). With ``off`` a batch's ``routed_experts`` is ignored.

Context parallelism (``parallel.cp``): each micro-batch is packed, then cut for this CP rank in one
place (:meth:`~megatron_tepo.token_layout.MicroBatch.context_shard`: its tokens, true
positions, labels, side inputs and scored slots); the head scores this rank's slots, and the
``[b, R]`` results are summed over the CP group, so the loss sees whole rows (sequence means,
token means over the DP batch: each token once) and is the same on every CP rank; the gradients
each rank's tokens contribute are summed over data x context parallel by megatron's DDP.

Left out: virtual pipeline stages, fp16 (loss scaling), MoE with PP > 1 on
CPU. Checkpoints: :meth:`MegatronActor.save_checkpoint` / :meth:`MegatronActor.load_checkpoint`
(see :mod:`megatron_tepo.actor.checkpointing`).
"""
from __future__ import annotations

import dataclasses
import os
from pathlib import Path
from typing import Any, Dict, List, Mapping, Optional, Tuple

import torch
import torch.distributed as dist

from megatron_tepo.algorithms import PolicyLoss
from megatron_tepo.batch import RolloutBatch
from megatron_tepo.actor.batching import equalize_micro_batch_count, plan_micro_batches, plan_packed_micro_batches
from megatron_tepo.token_layout import MicroBatch, micro_batches
from megatron_tepo.layout import ParallelLayout
from megatron_tepo.config import ActorConfig, OptimConfig
from megatron_tepo.actor.export import export_hf_state
from megatron_tepo.checkpoint.hf_io import LazyHFCheckpoint, open_hf_checkpoint
from megatron_tepo.megatron.model import (TrainModel, actor_transformer_config, build_lr_scheduler, build_train_model,
                                          plan_actor)
from megatron_tepo.megatron.lm_head import scored_log_probs, sum_over_context

__all__ = ["OptimConfig", "ActorConfig", "MegatronActor", "plan_actor", "actor_transformer_config", "build_lr_scheduler",
           "token_log_probs"]


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
        return open_hf_checkpoint(path)  # (a multimodal checkpoint: its text model's tensors only)
    state: Dict[str, torch.Tensor] = {}
    files = sorted(path.glob("pytorch_model*.bin"))
    if not files:
        raise ValueError(f"no *.safetensors or pytorch_model*.bin weights under {path}")
    for f in files:
        state.update(torch.load(f, map_location="cpu", weights_only=True))
    return state


def token_log_probs(hidden: torch.Tensor, mb: MicroBatch, weight: torch.Tensor, tp_group=None,
                    temperature: float = 1.0, lm_head: str = "fused") -> Tuple[torch.Tensor, torch.Tensor]:
    """Log-prob and entropy ``[b, R]`` of each response slot of ``mb`` from the model's final hidden
    states (one row per position of ``mb.input_ids``) and the output weight's vocabulary shard: the
    LM head runs at the positions that score a valid slot only (``actor.lm_head``:
    :mod:`megatron_tepo.megatron.lm_head`). Padding slots are 0."""
    dev = hidden.device
    scored = tuple(t.to(dev) for t in mb.scored_index())
    return scored_log_probs(hidden, weight, mb.labels.to(dev), scored, tuple(mb.valid.shape), tp_group=tp_group,
                            temperature=temperature, lm_head=lm_head)


class _OfTrainModel:
    """An attribute of the actor that is its :class:`TrainModel`'s: read from it, written to it."""

    def __set_name__(self, owner, name: str) -> None:
        self.name = name

    def __get__(self, actor, owner=None):
        return self if actor is None else getattr(actor.train_model, self.name)

    def __set__(self, actor, value) -> None:
        setattr(actor.train_model, self.name, value)


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
        self.layout = layout or ParallelLayout()
        self.optim_cfg = optim or OptimConfig()
        self.total_steps = total_steps
        weights = _load_hf_weights(hf_weights)  # (a safetensors directory: its headers only)
        try:
            self.train_model: TrainModel = build_train_model(
                hf_config, weights, self.layout, self.optim_cfg, actor_config, seed=seed, total_steps=total_steps,
                process_group_timeout_s=process_group_timeout_s, **settings)
        finally:
            if isinstance(weights, LazyHFCheckpoint) and weights is not hf_weights:
                weights.close()
        tm = self.train_model
        self.family_cfg, self.device = tm.family_cfg, tm.device
        if tm.settings.lora is not None:  # its checkpoints reference this base, not copy it
            from megatron_tepo.actor.lora_checkpoint import base_reference

            tm.lora_base = base_reference(hf_weights)

    # the megatron stack's objects, as the actor itself, the trainer (dp_rank, dp_size) and the tests read them: the
    # train model's own (read there and, for ``settings``, written there)
    model = _OfTrainModel()
    optimizer = _OfTrainModel()
    scheduler = _OfTrainModel()
    config = _OfTrainModel()
    settings = _OfTrainModel()
    tp_group = _OfTrainModel()
    dp_rank = _OfTrainModel()
    dp_size = _OfTrainModel()
    is_last_stage = _OfTrainModel()

    @property
    def bf16(self) -> bool:
        return self.settings.precision == "bf16"

    @property
    def max_tokens_per_micro_batch(self) -> int:
        return self.settings.max_tokens_per_micro_batch

    @max_tokens_per_micro_batch.setter
    def max_tokens_per_micro_batch(self, value: int) -> None:
        self.settings = dataclasses.replace(self.settings, max_tokens_per_micro_batch=int(value))

    def sync_params(self) -> None:
        """Finish the last optimizer step's deferred parameter all-gather (see
        :meth:`~megatron_tepo.megatron.model.TrainModel.sync_params`)."""
        self.train_model.sync_params()

    # ------------------------------------------------------------------ micro-batches
    @property
    def routing_metrics(self) -> Dict[str, float]:
        """The gates of the last replayed pass (``routing_mismatch_mean`` / ``_max``,
        ``routing_coverage``); empty with ``routing_replay: off`` or after a recording pass."""
        return dict(self.train_model.routing_metrics)

    def _routing_action(self, old_log_probs: bool) -> Optional[str]:
        mode = self.settings.routing_replay
        if mode == "off":
            return None
        return "record" if (mode == "r2" and old_log_probs) else "replay"

    def _routing_input(self, batch: RolloutBatch, action: Optional[str]) -> RolloutBatch:
        """``batch`` as the pass needs it: without ``routed_experts`` unless it replays them
        (nothing of the routing is laid out or staged otherwise); checked when it does: every
        position that scores a token has routing in this stage's layers, every id an expert."""
        if action != "replay":
            return batch if batch.routed_experts is None else dataclasses.replace(batch, routed_experts=None)
        self.train_model.replay.check_input(batch.routed_experts, batch.seq_lens(), self.settings.routing_replay)
        return batch

    def _recorded_routing(self, batch: RolloutBatch, mbs: List[MicroBatch]) -> torch.Tensor:
        """``[B, L, moe_layers, topk]``: what a recording pass's routers chose at each position of
        ``batch`` (this pipeline stage's layers; -1 elsewhere:
        :meth:`~megatron_tepo.megatron.routing_replay.RoutingReplay.gathered_recording`)."""
        return self.train_model.replay.gathered_recording(mbs, batch.batch_size, batch.input_ids.shape[1],
                                                          tp_group=self.tp_group, cp_group=self.train_model.cp_group,
                                                          cp=self.layout.cp)

    def _micro_batches(self, batch: RolloutBatch) -> List[MicroBatch]:
        """This rank's micro-batches of ``batch``: planned here (the token budget, the same count on
        every DP rank), laid out in one call (:func:`~megatron_tepo.token_layout.micro_batches`)."""
        packed = self.settings.pack_sequences
        planner = plan_packed_micro_batches if packed else plan_micro_batches
        plan = planner(batch.seq_lens().tolist(), self.settings.max_tokens_per_micro_batch)
        plan = equalize_micro_batch_count(plan, self.train_model.dp_group)
        # sequence parallelism splits the tokens (packed) / positions (padded) over the TP ranks
        return micro_batches(batch, plan, packed=packed, sp=self.layout.tp if self.settings.sequence_parallel else 1,
                             cp=self.layout.cp, cp_rank=self.train_model.cp_rank,
                             group_max=self._max_over_dp if self._needs_equal_shapes() else None, device=self.device)

    def _needs_equal_shapes(self) -> bool:
        """The MoE allgather dispatcher all-gathers tokens over the expert-parallel group, which
        needs micro-batches of one shape on every rank of that group."""
        return (self.family_cfg.moe is not None and self.layout.ep > 1
                and self.config.moe_token_dispatcher_type == "allgather")

    def _max_over_dp(self, sizes: List[List[int]]) -> List[List[int]]:
        """The DP group's maximum of each entry of ``sizes`` (micro-batch i's shape, or its share of
        one CP rank: every DP rank pads micro-batch i to the largest)."""
        t = torch.tensor(sizes, device=self.device)
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=self.train_model.dp_group)
        return t.tolist()

    def _log_probs_of(self, mb: MicroBatch, output: torch.Tensor, temperature: float):
        """``[b, R]`` log-probs and entropy of ``mb``'s rows; with context parallelism every CP
        rank's slots, summed over the group (:func:`~megatron_tepo.megatron.lm_head.sum_over_context`)."""
        lp, ent = token_log_probs(output, mb, self.train_model.output_weight, tp_group=self.tp_group,
                                  temperature=temperature, lm_head=self.settings.lm_head)
        if self.layout.cp > 1:
            both = sum_over_context(torch.stack([lp, ent]), self.train_model.cp_group)
            lp, ent = both[0], both[1]
        return lp, ent

    # ------------------------------------------------------------------ public API
    @torch.no_grad()
    def compute_log_probs(self, batch: RolloutBatch) -> Tuple[torch.Tensor, torch.Tensor]:
        """Old-policy pass: ``(log_probs, entropy)`` fp32 ``[B, R]`` (0 on padding) on every rank,
        under ``softmax(logits / batch.temperature)``. With ``actor.routing_replay: r2`` it also
        sets ``batch.routed_experts`` to the routing it used (the training passes replay it); with
        ``r3`` it routes to ``batch.routed_experts``."""
        action = self._routing_action(old_log_probs=True)
        routed_input = self._routing_input(batch, action)
        mbs = self._micro_batches(routed_input)

        def loss_func(mb, output):
            lp, ent = self._log_probs_of(mb, output, batch.temperature)
            return output.new_zeros((), dtype=torch.float32), torch.tensor(0, dtype=torch.int), {"lp": lp, "ent": ent}

        store = self.train_model.run(mbs, loss_func, forward_only=True, routing=action)
        if action == "record":
            batch.routed_experts = self._recorded_routing(batch, mbs)
            batch.validate()
        out = torch.zeros(2, batch.batch_size, batch.response_len, dtype=torch.float32, device=self.device)
        if self.is_last_stage:
            for mb, result in zip(mbs, store):
                if mb.rows:
                    out[0, mb.row_index] = result["lp"][: len(mb.rows)].float()  # drop shape-padding rows
                    out[1, mb.row_index] = result["ent"][: len(mb.rows)].float()
        self.train_model.broadcast_from_last_stage(out)
        return out[0].cpu(), out[1].cpu()

    def _global_normalizer(self, batch: RolloutBatch, loss) -> torch.Tensor:
        count = loss.count(batch.response_mask).to(self.device, torch.float64)
        dist.all_reduce(count, group=self.train_model.dp_group)
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
        action = self._routing_action(old_log_probs=False)
        mbs = self._micro_batches(self._routing_input(batch, action))

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

        self.train_model.zero_grads()
        store = self.train_model.run(mbs, loss_func, forward_only=False, routing=action)
        metrics = self._reduce_metrics(store, loss)
        metrics["num_micro_batches"] = float(len(mbs))
        if action is not None:
            metrics.update(self.train_model.routing_metrics)
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
            dist.all_reduce(sums, group=self.train_model.dp_group)
            values = sums.tolist()  # the one host read of the step
            out = {"loss": values[0], "tokens": values[1]}
            for k, key in enumerate(keys):
                summed = loss.is_summed(key)
                out[key] = values[2 + 2 * k] if summed else values[2 + 2 * k] / max(values[3 + 2 * k], 1e-30)
            result = [out]
        return self.train_model.broadcast_object_from_last_stage(result[0])

    def gradients_finite(self) -> bool:
        """Collective: whether every rank's reduced gradients are finite
        (:meth:`~megatron_tepo.megatron.model.TrainModel.gradients_finite`)."""
        return self.train_model.gradients_finite()

    def discard_gradients(self) -> None:
        """Drop the gradients of this step (every rank): the next forward-backward starts from zero."""
        self.train_model.discard_gradients()

    def optimizer_step(self) -> Dict[str, float]:
        """Clip, Adam step, advance the LR schedule; returns ``grad_norm`` (pre-clip), ``lr`` used and
        ``skipped_update``. Collective. A non-finite gradient on any rank skips the update: no weight,
        Adam state or LR step changes, the gradients are dropped, and the result says
        ``skipped_update: 1.0`` with ``grad_norm`` NaN (:meth:`~megatron_tepo.megatron.model.TrainModel.step`)."""
        return self.train_model.step()

    def train_step(self, batch: RolloutBatch, loss: PolicyLoss) -> Dict[str, float]:
        """One optimizer step over a DP-local mini-batch; returns loss, grad_norm, lr and metrics."""
        metrics = self.forward_backward(batch, loss)
        metrics.update(self.optimizer_step())
        return metrics

    # ------------------------------------------------------------------ memory (colocated mode)
    def offload(self, parts=("optimizer", "grads", "params")) -> int:
        """Every rank, between steps: ``parts`` (``optimizer``, ``grads``, ``params``) to host memory,
        their device memory freed; returns the bytes moved
        (:meth:`~megatron_tepo.megatron.model.TrainModel.offload`)."""
        return self.train_model.offload(parts)

    def onload(self) -> int:
        """Bring back what :meth:`offload` moved, bit-identical; returns the bytes moved."""
        return self.train_model.onload()

    @property
    def offloaded(self) -> Tuple[str, ...]:
        """The parts now in host memory."""
        return self.train_model.offloaded

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
        from megatron_tepo.actor.checkpointing import AsyncSaves, choose_async_writer, save_actor_checkpoint

        self.sync_params()
        if asynchronous and getattr(self, "_async_saves", None) is None:  # (/dev/shm room: this node's ranks)
            node_bytes = self.checkpoint_bytes() * int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
            self._async_saves = AsyncSaves(choose_async_writer(staged_bytes=node_bytes))
        return save_actor_checkpoint(self.train_model, directory, extra_state, write_extra,
                                     saves=self._async_saves if asynchronous else None, on_publish=on_publish,
                                     optim=self.optim_cfg)

    def checkpoint_bytes(self) -> int:
        """The bytes of this rank's tensors a checkpoint holds: the model's parameters and the
        optimizer's main parameters and states, each tensor once; a parameter whose Adam moments are not
        made yet (before the first step) counts them (two of its main parameter's size)."""
        seen, total = set(), 0

        def add(t) -> None:
            nonlocal total
            key = (str(t.device), t.data_ptr(), t.numel())
            if t.numel() and key not in seen:
                seen.add(key)
                total += t.numel() * t.element_size()

        for chunk in self.model:
            for p in chunk.parameters():
                add(p)
        for opt in getattr(self.optimizer, "chained_optimizers", [self.optimizer]):
            inner = getattr(opt, "optimizer", None)
            for group in getattr(inner, "param_groups", ()):
                for p in group["params"]:
                    add(p)
                    state = inner.state.get(p) or {}
                    for v in state.values():
                        if torch.is_tensor(v) and v.numel() > 1:
                            add(v)
                    if not state:
                        total += 2 * p.numel() * 4
        return total

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

    def _keep_settings(self):
        """What a checkpoint load calls to keep this actor's optimizer settings
        (:meth:`prefer_settings_over_checkpoint`), or None to keep the saved ones."""
        return self.apply_optim_settings if getattr(self, "keep_optim_settings", False) else None

    def apply_optim_settings(self) -> None:
        """``optim``'s peak / floor LR (megatron keeps them per parameter group) and Adam's betas
        and eps into every parameter group (after a load restored the saved ones)."""
        o = self.optim_cfg
        for opt in getattr(self.optimizer, "chained_optimizers", [self.optimizer]):
            for group in opt.optimizer.param_groups:
                group["betas"], group["eps"] = (o.adam_beta1, o.adam_beta2), o.adam_eps
                if "max_lr" in group:
                    group["max_lr"], group["min_lr"] = o.lr, o.min_lr

    def load_newest_checkpoint(self, root, report=None):
        """Collective: the newest complete checkpoint under ``root`` that loads (a damaged one is
        reported through ``report`` and the one before it tried): ``(path, extra_state)``, or
        ``(None, None)`` when there is none (:func:`~megatron_tepo.actor.checkpointing.load_newest_checkpoint`)."""
        from megatron_tepo.actor.checkpointing import load_newest_checkpoint

        return load_newest_checkpoint(self.train_model, root, report, optim=self.optim_cfg,
                                      keep_settings=self._keep_settings())

    def write_conversion_files(self, directory, source_model: str) -> None:
        """The sidecars that make a checkpoint in ``directory`` convertible back to the HF model
        ``source_model`` (its config and tokenizer, the typed family config, the dtype and layout:
        :func:`~megatron_tepo.checkpoint.sidecars.write_conversion_sidecars`)."""
        from megatron_tepo.checkpoint import write_conversion_sidecars

        write_conversion_sidecars(directory, source_model, self.family_cfg, next(self.model[0].parameters()).dtype,
                                  self.layout, model_builder=self.settings.model_builder)

    def export_hf(self, directory, source_model: str):
        """Collective: the live policy as an HF model folder (:func:`~megatron_tepo.checkpoint.export_actor_to_hf`);
        its path on global rank 0, None elsewhere."""
        from megatron_tepo.checkpoint import export_actor_to_hf

        return export_actor_to_hf(self, directory, source_model)

    def export_peft(self, directory, source_model: str):
        """Collective: with ``actor.lora``, the adapters as a PEFT adapter folder for the HF model
        ``source_model`` (:func:`~megatron_tepo.megatron.lora_peft.export_peft_adapter`); its path on
        global rank 0, None elsewhere and without LoRA."""
        if self.settings.lora is None:
            return None
        from megatron_tepo.megatron.lora_peft import export_peft_adapter
        from megatron_tepo.megatron.model import load_hf_config
        from megatron_tepo.models import checkpoint_naming

        naming = checkpoint_naming(load_hf_config(source_model)) if source_model else None
        return export_peft_adapter(self.model, self.family_cfg, self.settings.lora, directory, source_model,
                                   naming=naming, tp_group=self.tp_group)

    def export_adapters(self):
        """Collective: with ``actor.lora``, every adapter in PEFT's names on global rank 0 (the weight
        sync's sender), with PEFT's config (:func:`~megatron_tepo.megatron.lora_peft.gather_peft_adapters`);
        what ``actor.lora.sync: adapters`` sends instead of :meth:`export_hf_state`."""
        if self.settings.lora is None:
            raise ValueError("export_adapters: the actor has no LoRA adapters (actor.lora is not set)")
        from megatron_tepo.megatron.lora_peft import gather_peft_adapters

        return gather_peft_adapters(self.model, self.family_cfg, self.settings.lora, tp_group=self.tp_group)

    def load_checkpoint(self, directory, model_only: bool = False) -> dict:
        """Collective: restore what :meth:`save_checkpoint` wrote (bit-exact continuation at the
        same layout) and return its ``extra_state``. A directory without the ``complete`` marker is
        refused. ``model_only``: just the weights, resharded to this actor's TP/PP."""
        from megatron_tepo.actor.checkpointing import load_actor_checkpoint

        return load_actor_checkpoint(self.train_model, directory, model_only=model_only, optim=self.optim_cfg,
                                     keep_settings=self._keep_settings())

    def export_hf_state(self, what: str = "param", dtype=None):
        """This pipeline stage's parameters (or grads) as HF ``(name, full tensor)``, every MoE
        expert included for params; collective over TP (and EP). ``dtype`` casts before the
        gather. A lazy :class:`~megatron_tepo.actor.export.HFExport`: the weight sync reads it as
        buckets gathered to its sender only (``flat_buckets``)."""
        if what == "param":
            self.sync_params()
        return export_hf_state(self.model, self.family_cfg, what=what, tp_group=self.tp_group, dtype=dtype)
