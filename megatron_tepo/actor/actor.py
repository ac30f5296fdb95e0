"""The Megatron-core policy actor: old-policy log-probs and one optimizer step per mini-batch.

:class:`MegatronActor` builds a megatron ``GPTModel`` (one chunk per pipeline stage) from a Hugging
Face config (+ optional HF weights), wraps it in megatron DDP, and owns megatron's optimizer
(Adam, fp32, optionally the distributed optimizer) and LR schedule.

* :meth:`MegatronActor.compute_log_probs` -- under ``no_grad``, through megatron's pipeline schedule
  (``forward_only``): per-response-token log-probs and entropies ``[B, R]`` of this DP rank's
  batch, returned on every rank of the model replica (broadcast from the last pipeline stage).
* :meth:`MegatronActor.train_step` = :meth:`forward_backward` + :meth:`optimizer_step`.

Exact gradient bookkeeping. ``compute_policy_loss`` receives ``normalizer`` = the count of the
WHOLE mini-batch (summed over micro-batches and all-reduced over DP ranks), so each micro-batch
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

Runtime flags forced for CPU (and harmless on GPU): ``use_cpu_initialization`` (identical init for
every TP size), no gradient-accumulation / rope / layer-norm / softmax / bias fusions, an
explicit causal attention mask, ``variable_seq_lengths`` when PP > 1 (token-budget micro-batches
have varying shapes).

Left out: virtual pipeline stages, context parallelism, sequence packing (THD), bf16/fp16 mixed
precision, MoE with PP > 1 on CPU. Checkpoints: :meth:`MegatronActor.save_checkpoint` /
:meth:`MegatronActor.load_checkpoint` (see :mod:`megatron_tepo.actor.checkpointing`).
"""
from __future__ import annotations

import json
import math
import os
from functools import partial
from pathlib import Path
from typing import Any, Dict, List, Mapping, Optional, Tuple

import torch
import torch.distributed as dist

from megatron_tepo.actor.batch import RolloutBatch
from megatron_tepo.config import OptimConfig
from megatron_tepo.megatron.gpt import build_gpt_chunk, transformer_config
from megatron_tepo.actor.batching import equalize_micro_batch_count, plan_micro_batches
from megatron_tepo.actor.parallel import ParallelLayout, initialize_parallel
from megatron_tepo.models import (
    GPTFamilyConfig,
    export_hf_state,
    family_config_from_hf,
    load_hf_weights_into,
)

__all__ = ["OptimConfig", "MegatronActor", "build_lr_scheduler", "response_log_probs", "SUMMED_METRICS"]

#: Loss metrics already divided by the global normaliser: the mini-batch value is their sum.
SUMMED_METRICS = ("pg_loss",)


def _load_hf_config(hf_config):
    """A ``PretrainedConfig``/dict, or a directory / config.json path (read as a dict)."""
    if isinstance(hf_config, (str, os.PathLike)):
        path = Path(hf_config)
        path = path / "config.json" if path.is_dir() else path
        return json.loads(path.read_text())
    return hf_config


def _load_hf_weights(source) -> Optional[Dict[str, torch.Tensor]]:
    """A state dict, or a directory of ``*.safetensors`` / ``pytorch_model*.bin`` files."""
    if source is None or isinstance(source, Mapping):
        return source
    path = Path(source)
    files = sorted(path.glob("*.safetensors"))
    state: Dict[str, torch.Tensor] = {}
    if files:
        from safetensors.torch import load_file

        for f in files:
            state.update(load_file(str(f)))
        return state
    files = sorted(path.glob("pytorch_model*.bin"))
    if not files:
        raise ValueError(f"no *.safetensors or pytorch_model*.bin weights under {path}")
    for f in files:
        state.update(torch.load(f, map_location="cpu", weights_only=True))
    return state


def response_log_probs(logits: torch.Tensor, input_ids: torch.Tensor, prompt_lens: torch.Tensor,
                       response_mask: torch.Tensor, tp_group=None,
                       temperature: float = 1.0) -> Tuple[torch.Tensor, torch.Tensor]:
    """Log-prob and entropy ``[b, R]`` of each response slot from vocab-sharded logits ``[b, S, V/tp]``.

    Slot j of row i is token ``input_ids[i, p_i + j]``, scored by the logits at ``p_i + j - 1``;
    only those ``b*R`` rows of logits reach the vocab-parallel op. Padding slots are 0.
    """
    from megatron_tepo.ops.vocab_parallel import vocab_parallel_log_probs_and_entropy

    b, s = input_ids.shape
    r = response_mask.shape[1]
    target = prompt_lens.to(input_ids.device)[:, None] + torch.arange(r, device=input_ids.device)[None]
    valid = (target < s) & (response_mask != 0)
    target = target.clamp(max=s - 1)
    index = (target - 1)[..., None].expand(b, r, logits.shape[-1])
    picked = logits.gather(1, index)
    labels = input_ids.gather(1, target)
    log_probs, entropy = vocab_parallel_log_probs_and_entropy(picked, labels, tp_group=tp_group,
                                                              temperature=temperature)
    zero = torch.zeros((), dtype=log_probs.dtype, device=log_probs.device)
    return torch.where(valid, log_probs, zero), torch.where(valid, entropy, zero)


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


def _empty_micro_batch(like: RolloutBatch) -> RolloutBatch:
    """A one-row dummy (2 tokens, nothing valid, same optional fields as ``like``): it runs
    through the pipeline and contributes exactly 0 to the loss and the gradients."""
    zeros = torch.zeros(1, like.response_len)
    optional = {f: zeros for f in ("advantages", "old_log_probs", "old_entropy", "ref_log_probs")
                if getattr(like, f) is not None}
    return RolloutBatch(input_ids=torch.zeros(1, 2, dtype=torch.long), prompt_lens=torch.ones(1, dtype=torch.long),
                        response_mask=zeros, **optional)


class MegatronActor:
    """Policy model on megatron-core: ``compute_log_probs`` and ``train_step`` on DP-local batches.

    Args:
        hf_config: an HF ``PretrainedConfig``, a config dict, or a model directory.
        hf_weights: an HF state dict or a directory of safetensors; None keeps megatron's init.
        layout: TP / PP / EP sizes (DP = world / (TP*PP)); validated before any process group.
        optim: optimizer and LR-schedule settings.
        max_tokens_per_micro_batch: token budget (padded length x rows) of a micro-batch.
        spec: "local" / "te" layer spec; None = TE when importable.
        seed: megatron's model-parallel RNG seed (initialisation when no weights are given).
        total_steps: optimizer steps of the whole run (the LR decay horizon unless
            ``optim.lr_decay_steps`` is set).
    """

    def __init__(self, hf_config, hf_weights=None, layout: Optional[ParallelLayout] = None,
                 optim: Optional[OptimConfig] = None, max_tokens_per_micro_batch: int = 4096,
                 spec: Optional[str] = None, seed: int = 1234, total_steps: int = 1000):
        self.family_cfg: GPTFamilyConfig = family_config_from_hf(_load_hf_config(hf_config), spec=spec)
        self.layout = layout = layout or ParallelLayout()
        self.optim_cfg = optim or OptimConfig()
        self.max_tokens_per_micro_batch = max_tokens_per_micro_batch
        self.total_steps = total_steps
        self.dp_size = initialize_parallel(layout, self.family_cfg, seed=seed)
        self.device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")

        from megatron.core import parallel_state as ps

        self._ps = ps
        self.config = self._transformer_config()
        chunk = self._build_model_chunk()
        weights = _load_hf_weights(hf_weights)
        chunk.family_cfg = self.family_cfg  # lets load_hf_weights_into find the mapping
        if weights is not None:
            load_hf_weights_into([chunk], weights, self.family_cfg)
        self.model = [self._wrap_ddp(chunk)]
        self.optimizer = self._build_optimizer()
        self.scheduler = self._build_scheduler()
        self.config.grad_scale_func = self.optimizer.scale_loss
        self.config.finalize_model_grads_func = self._finalize_grads

    # ------------------------------------------------------------------ construction
    def _transformer_config(self):
        return transformer_config(
            self.family_cfg, tp=self.layout.tp, pp=self.layout.pp, ep=self.layout.ep,
            sequence_parallel=self.layout.sequence_parallel,
            variable_seq_lengths=self.layout.pp > 1,  # token-budget micro-batches vary in shape
            calculate_per_token_loss=True)  # see the module docstring: exact gradient sums

    def _build_model_chunk(self):
        return build_gpt_chunk(self.config, self.family_cfg, self._ps.is_pipeline_first_stage(),
                               self._ps.is_pipeline_last_stage()).to(self.device)

    def _wrap_ddp(self, chunk):
        from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig

        ddp_config = DistributedDataParallelConfig(
            grad_reduce_in_fp32=True, overlap_grad_reduce=False,
            use_distributed_optimizer=self.optim_cfg.use_distributed_optimizer,
            average_in_collective=False)  # required by calculate_per_token_loss: SUM over DP
        return DistributedDataParallel(self.config, ddp_config, chunk)

    def _build_optimizer(self):
        from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

        o = self.optim_cfg
        cfg = OptimizerConfig(optimizer="adam", lr=o.lr, min_lr=o.min_lr, weight_decay=o.weight_decay,
                              adam_beta1=o.adam_beta1, adam_beta2=o.adam_beta2, adam_eps=o.adam_eps,
                              clip_grad=o.clip_grad, bf16=False, fp16=False, params_dtype=torch.float32,
                              use_distributed_optimizer=o.use_distributed_optimizer)
        return get_megatron_optimizer(cfg, self.model)

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

    def _micro_batches(self, batch: RolloutBatch) -> Tuple[List[List[int]], List[RolloutBatch]]:
        seq_lens = batch.seq_lens().tolist()
        plan = plan_micro_batches(seq_lens, self.max_tokens_per_micro_batch)
        plan = equalize_micro_batch_count(plan, self._ps.get_data_parallel_group())
        mbs = []
        for rows in plan:
            if not rows:
                mbs.append(_empty_micro_batch(batch))
                continue
            # at least 2 columns so that a response slot always has a scoring position
            mbs.append(batch.select(rows, max_len=max(2, max(seq_lens[i] for i in rows))))
        if self._needs_equal_shapes():
            mbs = self._pad_to_common_shapes(mbs)
        return plan, mbs

    def _needs_equal_shapes(self) -> bool:
        """The MoE allgather dispatcher all-gathers tokens over the expert-parallel group, which
        needs micro-batches of one shape on every rank of that group."""
        moe = self.family_cfg.extra.get("moe_transformer_kwargs", {})
        return self.layout.ep > 1 and moe.get("moe_token_dispatcher_type") == "allgather"

    def _pad_to_common_shapes(self, mbs: List[RolloutBatch]) -> List[RolloutBatch]:
        """Pad micro-batch i to the largest (rows, length) of micro-batch i over the DP group
        (dummy rows are fully masked; extra columns sit after every real token: causal attention
        and per-token routing leave the real tokens untouched)."""
        shapes = torch.tensor([[mb.batch_size, mb.input_ids.shape[1]] for mb in mbs], device=self.device)
        dist.all_reduce(shapes, op=dist.ReduceOp.MAX, group=self._ps.get_data_parallel_group())
        return [mb.padded(int(r), int(s)) for mb, (r, s) in zip(mbs, shapes.tolist())]

    def _model_inputs(self, mb: RolloutBatch) -> Dict[str, torch.Tensor]:
        b, s = mb.input_ids.shape
        causal = torch.triu(torch.ones(s, s, dtype=torch.bool, device=self.device), diagonal=1)
        return dict(input_ids=mb.input_ids.to(self.device),
                    position_ids=torch.arange(s, device=self.device).expand(b, s),
                    attention_mask=causal[None, None])

    def _run_schedule(self, mbs: List[RolloutBatch], loss_func_for, forward_only: bool) -> List[Any]:
        from megatron.core.pipeline_parallel import get_forward_backward_func

        def forward_step(data_iterator, model):
            mb = next(data_iterator)
            output = model(**self._model_inputs(mb), labels=None)
            return output, partial(loss_func_for, mb)

        return get_forward_backward_func()(
            forward_step_func=forward_step, data_iterator=iter(mbs), model=self.model,
            num_microbatches=len(mbs), seq_length=max(mb.input_ids.shape[1] for mb in mbs),
            micro_batch_size=max(mb.batch_size for mb in mbs), forward_only=forward_only)

    def _log_probs_of(self, mb: RolloutBatch, output: torch.Tensor, temperature: float):
        return response_log_probs(output, mb.input_ids.to(self.device), mb.prompt_lens,
                                  mb.response_mask.to(self.device), tp_group=self.tp_group,
                                  temperature=temperature)

    def _broadcast_from_last_stage(self, tensor: torch.Tensor) -> torch.Tensor:
        if self._ps.get_pipeline_model_parallel_world_size() > 1:
            dist.broadcast(tensor, src=self._ps.get_pipeline_model_parallel_last_rank(),
                           group=self._ps.get_pipeline_model_parallel_group())
        return tensor

    # ------------------------------------------------------------------ public API
    @torch.no_grad()
    def compute_log_probs(self, batch: RolloutBatch, temperature: float = 1.0) -> Tuple[torch.Tensor, torch.Tensor]:
        """Old-policy pass: ``(log_probs, entropy)`` fp32 ``[B, R]`` (0 on padding) on every rank."""
        plan, mbs = self._micro_batches(batch)

        def loss_func(mb, output):
            lp, ent = self._log_probs_of(mb, output, temperature)
            return output.new_zeros(()), torch.tensor(0, dtype=torch.int), {"lp": lp, "ent": ent}

        store = self._run_schedule(mbs, loss_func, forward_only=True)
        out = torch.zeros(2, batch.batch_size, batch.response_len, dtype=torch.float32, device=self.device)
        if self.is_last_stage:
            for rows, result in zip(plan, store):
                if rows:
                    idx = torch.as_tensor(rows, device=self.device)
                    out[0, idx] = result["lp"][: len(rows)].float()  # drop shape-padding rows
                    out[1, idx] = result["ent"][: len(rows)].float()
        self._broadcast_from_last_stage(out)
        return out[0].cpu(), out[1].cpu()

    def _loss_settings(self, loss_cfg: Mapping[str, Any]) -> Tuple[str, str, float, Dict[str, Any]]:
        from megatron_tepo.algorithms import get_loss_defaults

        kwargs = dict(loss_cfg)
        if "name" not in kwargs:
            raise ValueError("loss_cfg needs a 'name' (a registered policy loss)")
        name = kwargs.pop("name")
        temperature = float(kwargs.pop("temperature", 1.0))
        agg = kwargs.pop("agg", None) or get_loss_defaults(name)["agg"]
        return name, agg, temperature, kwargs

    def _global_normalizer(self, batch: RolloutBatch, agg: str) -> torch.Tensor:
        from megatron_tepo.algorithms import count_for_normalizer

        count = count_for_normalizer(batch.response_mask, agg).to(self.device, torch.float64)
        dist.all_reduce(count, group=self._ps.get_data_parallel_group())
        return count

    def forward_backward(self, batch: RolloutBatch, loss_cfg: Mapping[str, Any]) -> Dict[str, float]:
        """Zero the grads, run every micro-batch forward+backward, leave the summed grads in the
        DDP buffers (``param.main_grad``). Returns the mini-batch loss metrics (all ranks)."""
        from megatron_tepo.algorithms import compute_policy_loss

        if batch.advantages is None or batch.old_log_probs is None:
            raise ValueError("train batches need advantages and old_log_probs")
        name, agg, temperature, kwargs = self._loss_settings(loss_cfg)
        normalizer = self._global_normalizer(batch, agg)
        plan, mbs = self._micro_batches(batch)

        def loss_func(mb, output):
            lp, ent = self._log_probs_of(mb, output, temperature)
            d = self.device

            def opt(t):
                return None if t is None else t.to(d)

            loss, metrics = compute_policy_loss(
                name, lp, mb.old_log_probs.to(d), mb.advantages.to(d), mb.response_mask.to(d),
                entropy=ent, old_entropy=opt(mb.old_entropy), ref_log_prob=opt(mb.ref_log_probs),
                agg=agg, normalizer=normalizer, **kwargs)
            tokens = (mb.response_mask != 0).sum()
            return loss, torch.tensor(1, dtype=torch.int), {"loss": loss.detach(), "tokens": tokens,
                                                            "metrics": metrics}

        for chunk in self.model:
            chunk.zero_grad_buffer()
        self.optimizer.zero_grad()
        store = self._run_schedule(mbs, loss_func, forward_only=False)
        metrics = self._reduce_metrics(store)
        metrics["num_micro_batches"] = float(len(mbs))
        return metrics

    @staticmethod
    def _metric_weight(key: str, metrics: Mapping[str, Any], tokens: float) -> float:
        """How a micro-batch's metric enters the mini-batch value (see :meth:`_reduce_metrics`)."""
        if key in SUMMED_METRICS or key.startswith("num_"):
            return 1.0
        if key == "kl":  # a mean over the KL-mask tokens only
            return float(metrics.get("kl_mask_frac", 1.0)) * tokens
        return tokens

    def _reduce_metrics(self, store: List[Dict[str, Any]]) -> Dict[str, float]:
        """Mini-batch metrics from the micro-batches of every DP rank (last stage, then broadcast
        over the pipeline): ``loss`` and ``pg_loss`` (already normalised by the global count) and
        ``num_*`` counts are summed; ``kl`` is averaged over KL-mask tokens; every other metric
        (masked means over valid tokens) is averaged with the micro-batch token counts as weights."""
        result = [None]
        if self.is_last_stage:
            keys = sorted(store[0]["metrics"]) if store else []
            sums = torch.zeros(2 + 2 * len(keys), dtype=torch.float64, device=self.device)
            for item in store:
                n = float(item["tokens"])
                sums[0] += float(item["loss"])
                sums[1] += n
                for k, key in enumerate(keys):
                    w = self._metric_weight(key, item["metrics"], n)
                    sums[2 + 2 * k] += float(item["metrics"][key]) * w
                    sums[3 + 2 * k] += w
            dist.all_reduce(sums, group=self._ps.get_data_parallel_group())
            out = {"loss": float(sums[0]), "tokens": float(sums[1])}
            for k, key in enumerate(keys):
                summed = key in SUMMED_METRICS or key.startswith("num_")
                weight = float(sums[3 + 2 * k])
                out[key] = float(sums[2 + 2 * k]) if summed else float(sums[2 + 2 * k]) / max(weight, 1e-30)
            result = [out]
        if self._ps.get_pipeline_model_parallel_world_size() > 1:
            dist.broadcast_object_list(result, src=self._ps.get_pipeline_model_parallel_last_rank(),
                                       group=self._ps.get_pipeline_model_parallel_group())
        return result[0]

    def optimizer_step(self) -> Dict[str, float]:
        """Clip, Adam step, advance the LR schedule; returns ``grad_norm`` (pre-clip) and ``lr`` used."""
        lr = float(self.optimizer.param_groups[0]["lr"])
        ok, grad_norm, _ = self.optimizer.step()
        if not ok:
            raise RuntimeError("megatron optimizer step reported failure (inf/nan gradients)")
        self.scheduler.step(increment=1)
        return {"grad_norm": float(grad_norm) if grad_norm is not None else math.nan, "lr": lr}

    def train_step(self, batch: RolloutBatch, loss_cfg: Mapping[str, Any]) -> Dict[str, float]:
        """One optimizer step over a DP-local mini-batch; returns loss, grad_norm, lr and metrics."""
        metrics = self.forward_backward(batch, loss_cfg)
        metrics.update(self.optimizer_step())
        return metrics

    # ------------------------------------------------------------------ checkpointing
    def save_checkpoint(self, directory, extra_state: Optional[dict] = None):
        """Collective: model, optimizer, LR scheduler, every rank's RNG states and the JSON
        ``extra_state`` (e.g. trainer step, data position), written atomically to ``directory``
        (a ``<directory>.tmp-*`` renamed once complete; ``complete`` marker). See
        :mod:`megatron_tepo.actor.checkpointing`. Returns the checkpoint path."""
        from megatron_tepo.actor.checkpointing import save_actor_checkpoint

        return save_actor_checkpoint(self, directory, extra_state)

    def load_checkpoint(self, directory, model_only: bool = False) -> dict:
        """Collective: restore what :meth:`save_checkpoint` wrote (bit-exact continuation at the
        same layout) and return its ``extra_state``. A directory without the ``complete`` marker is
        refused. ``model_only``: just the weights, resharded to this actor's TP/PP."""
        from megatron_tepo.actor.checkpointing import load_actor_checkpoint

        return load_actor_checkpoint(self, directory, model_only=model_only)

    def export_hf_state(self, what: str = "param", dtype=None):
        """This pipeline stage's parameters (or grads) as HF ``(name, full tensor)``, every MoE
        expert included for params; collective over TP (and EP). ``dtype`` casts before the
        gather. A lazy :class:`~megatron_tepo.models.HFExport`: the weight sync reads it as
        buckets gathered to its sender only (``flat_buckets``)."""
        return export_hf_state(self.model, self.family_cfg, what=what, tp_group=self.tp_group, dtype=dtype)
