"""MoE routing replay on megatron-core's own mechanism: the actor routes each token to given experts.

``actor.routing_replay`` (:data:`REPLAY_MODES`): ``r3`` replays the rollout engine's routing in the
old-log-prob pass and in every training pass; ``r2`` records the actor's own routing in the
old-log-prob pass and replays that in the training passes; ``off`` builds nothing of this module
(``TransformerConfig.moe_enable_routing_replay`` stays False, so megatron creates no
``RouterReplay`` and its global registry stays empty).

How. With ``moe_enable_routing_replay`` every ``TopKRouter`` of the model holds a
``megatron.core.transformer.moe.router_replay.RouterReplay`` and asks it for its top-k
(``get_replay_topk``): megatron's own ``RECORD`` / ``REPLAY_FORWARD`` / ``REPLAY_BACKWARD``
actions. :class:`RoutingReplay` swaps each router's instance for a ``ReplaySlot`` (a
``RouterReplay`` that also measures) and takes both out of megatron's class-wide
``global_router_replay_instances`` list: the actor drives its own routers, layer by layer, and two
models in one process never share that list. Per micro-batch (:meth:`RoutingReplay.before_forward`,
called by :meth:`~megatron_tepo.megatron.model.TrainModel.run` just before the model's forward):

* replay: each layer's slot gets the micro-batch's experts for that layer (its
  :class:`~megatron_tepo.token_layout.SideInputs`, in the router's token order; positions
  nothing scores and that carry no routing get experts ``0..k-1``, which changes no output) and
  ``REPLAY_FORWARD``; megatron gathers the router's *current* scores at the given experts, so the
  probabilities still come from the router's logits and the router keeps its gradient. After the
  forward (:meth:`RoutingReplay.after_forward`) the action becomes ``REPLAY_BACKWARD``: the only
  router calls before the next forward are activation recompute in the backward, which pops each
  layer's targets first-in first-out -- the order megatron's schedules run the backwards in (1F1B
  included) -- so the recompute replays the same experts.
* record: ``RECORD``; after the forward each slot's recorded top-k is kept
  (:attr:`RoutingReplay.recorded`).

Gates. In ``REPLAY_FORWARD`` each slot also computes the router's unforced top-k (no gradient) and
counts, over the positions that must be replayed (``SideInputs.scored``), the tokens whose
unforced experts differ from the replayed ones and the tokens it replayed. :meth:`RoutingReplay.finish`
sums them over every rank (one all-reduce) into ``routing_mismatch_mean`` / ``routing_mismatch_max``
(per-layer fractions) and ``routing_coverage`` (token x layers replayed at the routers over those
that had to be); coverage under 1.0 -- a router that never asked its slot, a layer without
routing -- raises.

The MoE layers, the top-k, the expert count and the ids' dtype are the routing contract's
(:class:`megatron_tepo.routing.RoutingShape`, from the family config): a router's ``layer_number``
is translated to its HF decoder layer (:func:`~megatron_tepo.megatron.sharding.hf_layer_of`, which a
``HybridModel``'s two stack layers per HF layer need), then to its place among the shape's MoE layers.

Left out: megatron's fused router (``moe_router_fusion``, Transformer Engine) bypasses
``RouterReplay`` and is refused with replay; CUDA-graphed routers; dense layers inside an MoE
stack (the families refuse them, so today MoE layer ``i`` is HF decoder layer ``i``).
"""
from __future__ import annotations

from typing import Dict, List, Optional, Tuple

import torch
import torch.distributed as dist

from megatron_tepo.routing import RoutingShape
from megatron_tepo.token_layout import MicroBatch, SideInputs, positions_to_rows, scored_positions

__all__ = ["REPLAY_MODES", "RoutingReplay", "replay_slot_class"]

#: ``actor.routing_replay``'s choices
REPLAY_MODES = ("off", "r2", "r3")

_SLOT_CLASS = None


def replay_slot_class():
    """:class:`ReplaySlot`, made on first use (it subclasses megatron-core's ``RouterReplay``)."""
    global _SLOT_CLASS
    if _SLOT_CLASS is not None:
        return _SLOT_CLASS
    from megatron.core.transformer.moe.router_replay import RouterReplay, RouterReplayAction

    class ReplaySlot(RouterReplay):
        """megatron's ``RouterReplay`` for one MoE layer, outside the global registry, that also
        counts (in ``REPLAY_FORWARD``) the tokens whose unforced top-k differs from the replayed."""

        def __init__(self, stats: torch.Tensor, row: int):
            super().__init__()
            _forget(self)
            self.stats, self.row = stats, row  # stats[row] = (mismatched, replayed, to replay)
            self.observe: Optional[Tuple[torch.Tensor, torch.Tensor]] = None  # (given, scored) [n] bool

        def get_replay_topk(self, scores, topk, num_groups=None, group_topk=None, default_compute_topk=None):
            probs, idx = super().get_replay_topk(scores, topk, num_groups, group_topk, default_compute_topk)
            if self.router_replay_action == RouterReplayAction.REPLAY_FORWARD and self.observe is not None:
                given, scored = self.observe
                with torch.no_grad():
                    _, own = default_compute_topk(scores.detach(), topk, num_groups, group_topk)
                    differs = (own.sort(-1).values != idx.sort(-1).values).any(-1)
                    counted = given & scored
                    self.stats[self.row, 0] += (differs & counted).sum()
                    self.stats[self.row, 1] += counted.sum()
            return probs, idx

    ReplaySlot.__module__ = __name__
    _SLOT_CLASS = ReplaySlot
    return ReplaySlot


def _forget(instance) -> None:
    """Take ``instance`` out of megatron's class-wide ``RouterReplay`` registry."""
    from megatron.core.transformer.moe.router_replay import RouterReplay

    registry = RouterReplay.global_router_replay_instances
    for i in range(len(registry) - 1, -1, -1):
        if registry[i] is instance:
            del registry[i]


class RoutingReplay:
    """The routing replay of one rank's model chunks (module docstring). Made by :meth:`attach`
    only when ``actor.routing_replay`` is not ``off``."""

    def __init__(self, slots: List[Tuple[int, object]], shape: RoutingShape, stats: torch.Tensor,
                 sp_rank: int = 0, sp_size: int = 1):
        self.slots = slots  # (MoE layer index in the whole model, slot) for this stage's layers
        self.shape = shape  # the routing contract (the family config's): its MoE layers, top-k, experts, dtype
        self.num_layers, self.topk, self.num_experts = shape.num_moe_layers, shape.topk, shape.num_experts
        self.stats = stats  # [num_layers, 3] float64 on the device
        self.sp_rank, self.sp_size = sp_rank, sp_size
        self.action: Optional[str] = None
        self.recorded: List[torch.Tensor] = []  # record: [n, local layers, k] per micro-batch
        self.recomputes = False  # this run's backward re-runs the routers (full recompute)
        self._fill = None

    @classmethod
    def attach(cls, chunks, config, shape: RoutingShape, device: torch.device, sp_rank: int = 0,
               sp_size: int = 1) -> "RoutingReplay":
        """Swap the ``RouterReplay`` of every router in ``chunks`` (built with
        ``moe_enable_routing_replay``) for a ``ReplaySlot``; the model's MoE layers, top-k and experts
        are the routing contract's (``shape``: the family config's
        :meth:`~megatron_tepo.models.family.GPTFamilyConfig.routing_shape`), which megatron's config
        must agree with."""
        from megatron_tepo.megatron.sharding import hf_layer_of

        if getattr(config, "moe_router_fusion", False):
            raise ValueError("actor.routing_replay: megatron's fused router (moe_router_fusion) bypasses "
                             "RouterReplay; turn one of them off")
        if (config.moe_router_topk, config.num_moe_experts) != (shape.topk, shape.num_experts):
            raise ValueError(f"actor.routing_replay: megatron's routers take top-{config.moe_router_topk} of "
                             f"{config.num_moe_experts} experts, the family config's routing top-{shape.topk} of "
                             f"{shape.num_experts}")
        index = {layer: i for i, layer in enumerate(shape.moe_layers)}  # HF decoder layer -> MoE layer
        stats = torch.zeros(shape.num_moe_layers, 3, dtype=torch.float64, device=device)
        slots = []
        for chunk in chunks:
            for module in chunk.modules():
                old = getattr(module, "router_replay", None)
                if old is None:
                    continue
                _forget(old)
                hf_layer = hf_layer_of(chunk, module.layer_number)
                if hf_layer not in index:
                    raise ValueError(f"actor.routing_replay: decoder layer {hf_layer} routes, but the family "
                                     f"config's MoE layers are {shape.moe_layers}")
                layer = index[hf_layer]
                slot = replay_slot_class()(stats, layer)
                slot.layer_number = module.layer_number
                module.router_replay = slot
                slots.append((layer, slot))
        if not slots:
            raise ValueError("actor.routing_replay: the model has no MoE router that megatron built with "
                             "moe_enable_routing_replay")
        return cls(sorted(slots, key=lambda s: s[0]), shape, stats, sp_rank, sp_size)

    # ------------------------------------------------------------------ one run of the schedule
    def start(self, action: str, recomputes: bool = False) -> None:
        """Before a run: ``replay`` (forced experts from each micro-batch's side inputs) or
        ``record`` (the routers' own top-k kept); ``recomputes``: its backward re-runs the routers
        (megatron's full activation recompute), which then replay each forward's experts again."""
        if action not in ("replay", "record"):
            raise ValueError(f"routing replay action must be replay or record, got {action!r}")
        self._clear()
        self.stats.zero_()
        self.action, self.recorded, self.recomputes = action, [], recomputes

    def before_forward(self, side: Optional[SideInputs]) -> None:
        from megatron.core.transformer.moe.router_replay import RouterReplayAction

        if self.action == "record":
            for _, slot in self.slots:
                slot.set_router_replay_action(RouterReplayAction.RECORD)
            return
        if side is None or side.routed_experts is None:
            raise ValueError("routed_experts: a micro-batch has none, and actor.routing_replay replays it")
        side = side.shard(self.sp_rank, self.sp_size)
        routed = side.routed_experts
        if routed.dim() != 3 or routed.shape[1:] != (self.num_layers, self.topk):
            raise ValueError(f"routed_experts: [tokens, moe_layers, topk] must be [N, {self.num_layers}, "
                             f"{self.topk}] for this model, got {tuple(routed.shape)}")
        if self._fill is None or self._fill.device != routed.device:
            self._fill = torch.arange(self.topk, device=routed.device)
        scored = side.scored if side.scored is not None else torch.ones(routed.shape[0], dtype=torch.bool,
                                                                          device=routed.device)
        to_replay = scored.sum()
        for layer, slot in self.slots:
            target = routed[:, layer].long()
            given = target[:, 0] >= 0
            target = torch.where(given[:, None], target, self._fill)
            slot.set_target_indices(target)
            slot.observe = (given, scored)
            slot.set_router_replay_action(RouterReplayAction.REPLAY_FORWARD)
            self.stats[layer, 2] += to_replay

    def after_forward(self) -> None:
        from megatron.core.transformer.moe.router_replay import RouterReplayAction

        if self.action == "record":  # kept in the contract's dtype (one byte an id up to 128 experts)
            self.recorded.append(torch.stack([slot.get_recorded_indices() for _, slot in self.slots], dim=1)
                                 .to(self.shape.dtype))
            for _, slot in self.slots:
                slot.clear_router_replay_action()
                slot.recorded_topk_idx = None
            return
        for _, slot in self.slots:  # from here until the next forward: only the backward's recompute
            slot.observe = None
            slot.set_router_replay_action(RouterReplayAction.REPLAY_BACKWARD)
            if not self.recomputes:  # no recompute will pop them: megatron's queue holds nothing
                slot.replay_backward_list.clear()

    def finish(self, group=None) -> Dict[str, float]:
        """After a run: the routers back to plain routing, every target dropped; for a replay run
        the gates, summed over ``group`` (default: every rank; one all-reduce and one host read).
        Raises when the coverage is under 1.0."""
        action = self.action
        self._clear()
        self.action = None
        if action != "replay":
            return {}
        stats = self.stats.clone()
        if dist.is_initialized() and dist.get_world_size(group) > 1:
            dist.all_reduce(stats, group=group)
        mismatched, replayed, needed = stats.cpu().unbind(1)
        has = needed > 0
        fractions = (mismatched[has] / replayed[has].clamp(min=1)).tolist() or [0.0]
        total = float(needed.sum())
        coverage = float(replayed.sum()) / total if total else 1.0
        if coverage < 1.0:
            short = [i for i in range(self.num_layers) if replayed[i] < needed[i]]
            raise RuntimeError(f"actor.routing_replay: the routers replayed {coverage:.4f} of the token x layers "
                               f"that had to be (MoE layers {short[:8]} fell short): a router did not use "
                               f"RouterReplay, or routed_experts misses positions")
        return {"routing_mismatch_mean": sum(fractions) / len(fractions), "routing_mismatch_max": max(fractions),
                "routing_coverage": coverage}

    def check_input(self, routed: Optional[torch.Tensor], seq_lens: torch.Tensor, mode: str) -> None:
        """A ValueError naming ``routed_experts`` unless ``routed`` (a batch's ``[B, L, moe_layers,
        topk]``, ``seq_lens`` its rows' lengths) can be replayed by ``actor.routing_replay`` ``mode``:
        every position that scores a token has routing in this stage's layers, every id an expert."""
        if routed is None:
            what = ("the engine's routing (Sample.routed_experts)" if mode == "r3"
                    else "the routing that compute_log_probs recorded")
            raise ValueError(f"routed_experts: the batch has none, and actor.routing_replay {mode} replays {what}")
        layers = [layer for layer, _ in self.slots]
        if routed.shape[2:] != (self.num_layers, self.topk):
            raise ValueError(f"routed_experts: must be [B, L, {self.num_layers}, {self.topk}] (moe_layers, topk "
                             f"of this model), got {tuple(routed.shape)}")
        mine = routed[:, :, layers]
        if int(mine.max()) >= self.num_experts:
            raise ValueError(f"routed_experts: expert id {int(mine.max())} >= the model's {self.num_experts} experts")
        scored = scored_positions(seq_lens, routed.shape[1])
        missing = scored & (mine < 0).flatten(2).any(-1)
        if bool(missing.any()):
            row, pos = (int(i) for i in missing.nonzero()[0])
            raise ValueError(f"routed_experts: row {row} has no routing at position {pos} (of {int(missing.sum())} "
                             f"positions without it); routing replay needs every prompt and response position "
                             f"but each sequence's last")

    def gathered_recording(self, mbs: List[MicroBatch], batch_size: int, width: int, tp_group=None,
                           cp_group=None, cp: int = 1) -> torch.Tensor:
        """``[batch_size, width, moe_layers, topk]``: what the last recording pass's routers chose at
        each position of the batch that ``mbs`` were cut from (this pipeline stage's layers; -1
        elsewhere): each micro-batch's recording all-gathered over the sequence-parallel ranks
        (``tp_group``: each routed its share of the tokens) and the CP ranks (``cp_group``: each
        routed its chunks), then laid back into the batch's rows."""
        layers = torch.tensor([layer for layer, _ in self.slots])
        out = torch.full((batch_size, width, self.num_layers, self.topk), -1, dtype=self.shape.dtype)
        for mb, recorded in zip(mbs, self.recorded):
            if self.sp_size > 1:  # each TP rank routed its share of the tokens
                parts = [torch.empty_like(recorded) for _ in range(self.sp_size)]
                dist.all_gather(parts, recorded.contiguous(), group=tp_group)
                recorded = torch.cat(parts)
            if mb.cp_splits is not None:  # each CP rank routed its chunks: back to the whole layout
                parts = [torch.empty_like(recorded) for _ in range(cp)]
                dist.all_gather(parts, recorded.contiguous(), group=cp_group)
                recorded = mb.context_gather([p.cpu() for p in parts])
            if not mb.rows:
                continue
            rows = positions_to_rows(recorded.cpu(), width=width, **mb.side_layout())[: len(mb.rows)]
            index = torch.as_tensor(mb.rows, dtype=torch.long)
            grid = out[index]
            grid[:, :, layers] = rows.to(out.dtype)
            out[index] = grid
        return out

    def abort(self) -> None:
        """After a failed run: the routers back to plain routing, no collective."""
        self._clear()
        self.action, self.recorded = None, []

    def _clear(self) -> None:
        for _, slot in self.slots:
            slot.clear_indices()
            slot.clear_router_replay_action()
            slot.observe = None
