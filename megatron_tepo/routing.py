"""The MoE routing contract (``actor.routing_replay``): one definition of which layers route, how
many experts each token takes, and the integer dtype its expert ids travel in.

:class:`RoutingShape` is made in one place, the model family's config
(:meth:`megatron_tepo.models.family.GPTFamilyConfig.routing_shape`: the family knows which of its
decoder layers are MoE layers and their top-k). Everything else reads it from there:

- the SGLang fleet decodes a server's ``routed_experts`` with it (``rollout/sglang/routing.py``:
  SGLang captures every layer; the shape's ``moe_layers`` pick the routed ones);
- the embedded engine checks its routers against it and records their ids in its dtype
  (``rollout/embedded.py``);
- the actor's replay sizes its per-layer slots and statistics with it and hands the recorded ids
  back in its dtype (``megatron/routing_replay.py``);
- the batch carries ``routed_experts`` ``[B, L, len(moe_layers), topk]`` in :attr:`RoutingShape.dtype`
  (``batch.py``).

The trainer reads the shape from the family config and gives it to the engine
(``rollout/registry.py:EngineSettings.routing``), so no engine parses a ``config.json`` of its own.
Pure Python and torch: it imports nothing of the package.

Left out: dense layers inside an MoE stack (``mlp_only_layers``, ``decoder_sparse_step``): the
families refuse them, so ``moe_layers`` is every layer today; the field is the place they would go.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Tuple

import torch

__all__ = ["RoutingShape", "routing_dtype"]


def routing_dtype(num_experts: int) -> torch.dtype:
    """The smallest signed integer dtype holding expert ids ``0 .. num_experts - 1`` and -1 (the
    "unknown" of padding): int8 up to 128 experts (Qwen3-30B-A3B: 48 layers x top-8 x 1 byte =
    384 bytes a token), int16 up to 32768."""
    if num_experts < 1:
        raise ValueError(f"num_experts must be >= 1, got {num_experts}")
    for dtype in (torch.int8, torch.int16, torch.int32):
        if num_experts - 1 <= torch.iinfo(dtype).max:
            return dtype
    return torch.int64


@dataclass(frozen=True)
class RoutingShape:
    """``num_layers``: the model's decoder layers (SGLang captures every one); ``moe_layers``: those
    that route, in order (the layer axis of ``Sample.routed_experts`` and of the batch's
    ``routed_experts``); ``topk``: experts per token; ``num_experts``: the ids' range."""

    num_layers: int
    moe_layers: Tuple[int, ...]
    topk: int
    num_experts: int

    def __post_init__(self):
        object.__setattr__(self, "moe_layers", tuple(int(i) for i in self.moe_layers))
        bad = [f"{n}={getattr(self, n)!r}" for n in ("num_layers", "topk", "num_experts")
               if not isinstance(getattr(self, n), int) or getattr(self, n) < 1]
        if bad:
            raise ValueError(f"RoutingShape: {', '.join(bad)} must be integers >= 1")
        if not self.moe_layers or list(self.moe_layers) != sorted(set(self.moe_layers)) or \
                self.moe_layers[0] < 0 or self.moe_layers[-1] >= self.num_layers:
            raise ValueError(f"RoutingShape: moe_layers={self.moe_layers} must be increasing layer indices in "
                             f"[0, {self.num_layers})")
        if self.topk > self.num_experts:
            raise ValueError(f"RoutingShape: topk={self.topk} > num_experts={self.num_experts}")

    @property
    def num_moe_layers(self) -> int:
        return len(self.moe_layers)

    @property
    def dtype(self) -> torch.dtype:
        """The dtype the ids travel in, from the rollout to the replay (:func:`routing_dtype`)."""
        return routing_dtype(self.num_experts)
