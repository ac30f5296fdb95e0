"""Rollout correction: importance weights and rejection for the rollout/training policy mismatch.

The rollout engine samples response tokens from ``pi_rollout`` (its own numerical stack: SGLang in
bf16, or weights one step older when generation overlaps training); the loss's ratios are taken
against ``pi_old``, the actor's score of the same tokens. The two differ, so the policy-gradient
estimate is biased. Following verl's rollout correction (and slime's TIS/MIS, NeMo-RL's TIS and
icepop), each token's policy-loss term is multiplied by a weight computed under no-grad from

    d_{i,t} = lo_{i,t} - lr_{i,t}        (old minus rollout log-prob, 0 on padding)

at one of three levels, broadcast to the sequence's valid tokens:

* ``token``:     ``x_{i,t} = d_{i,t}``
* ``sequence``:  ``x_{i,t} = sum_t d_{i,t}`` over the sequence's valid tokens
* ``geometric``: ``x_{i,t} = mean_t d_{i,t}`` over the sequence's valid tokens

Importance sampling (``rollout_is``) gives the weight ``min(exp(x), cap)`` (truncated IS, TIS).
Rejection (``rollout_rs``) gives weight 0 to the tokens (``token``) or whole sequences
(``sequence``, ``geometric``) whose ``exp(x)`` lies outside ``[lo, hi]`` (masked IS, icepop).
Both may be on, at different levels; their weights multiply. ``x`` is clamped to ``[-20, 20]``
before ``exp``, like every log-ratio of the losses. Rejected tokens keep their place in the loss
normaliser, so the loss stays micro-batch invariant (every level is per sequence).

With ``rollout_log_prob == old_log_prob`` every weight is exactly 1.0, so the loss and its
gradient are bit-identical to no correction (``cap >= 1`` and ``lo <= 1 <= hi`` are required for
that reason).

Left out: the correction of the KL and entropy terms (they are not importance-weighted, as in
verl), and per-batch normalisation of the weights (verl's ``rollout_is_batch_normalize``).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Optional, Sequence

import torch

from .kl import LOG_RATIO_CLAMP, kl_penalty

__all__ = ["CORRECTION_LEVELS", "RolloutCorrection", "rollout_correction_weights"]

#: The levels of ``rollout_is`` and ``rollout_rs``.
CORRECTION_LEVELS: tuple[str, ...] = ("none", "token", "sequence", "geometric")


@dataclass(frozen=True)
class RolloutCorrection:
    """The settings of the correction (``algorithm.rollout_correction`` in a run config)."""

    rollout_is: str = "none"
    rollout_is_cap: float = 2.0
    rollout_rs: str = "none"
    rollout_rs_bounds: tuple[float, float] = (0.5, 2.0)

    def __post_init__(self) -> None:
        for key in ("rollout_is", "rollout_rs"):
            level = getattr(self, key)
            if level not in CORRECTION_LEVELS:
                raise ValueError(f"{key} must be one of {list(CORRECTION_LEVELS)}, got {level!r}")
        cap = self.rollout_is_cap
        if isinstance(cap, bool) or not isinstance(cap, (int, float)) or not (math.isfinite(cap) and cap >= 1.0):
            raise ValueError(f"rollout_is_cap must be a finite number >= 1, got {cap!r}")
        bounds = self.rollout_rs_bounds
        if (not isinstance(bounds, Sequence) or isinstance(bounds, str) or len(bounds) != 2
                or any(isinstance(b, bool) or not isinstance(b, (int, float)) for b in bounds)
                or not (0.0 <= bounds[0] <= 1.0 <= bounds[1])):
            raise ValueError(f"rollout_rs_bounds must be (lo, hi) with 0 <= lo <= 1 <= hi, got {bounds!r}")
        object.__setattr__(self, "rollout_rs_bounds", (float(bounds[0]), float(bounds[1])))
        object.__setattr__(self, "rollout_is_cap", float(cap))

    @property
    def active(self) -> bool:
        return self.rollout_is != "none" or self.rollout_rs != "none"


def _level_log_ratio(d: torch.Tensor, mask: torch.Tensor, level: str) -> torch.Tensor:
    """``x`` of ``level`` as a ``[B, T]`` tensor (``d`` is 0 on padding), clamped to [-20, 20]."""
    if level == "token":
        x = d
    else:
        total = d.sum(dim=-1, keepdim=True)
        if level == "geometric":
            n = mask.sum(dim=-1, keepdim=True)
            total = total / torch.where(n > 0, n, torch.ones_like(n)).to(d.dtype)
        x = total.expand_as(d)
    return torch.clamp(x, -LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)


@torch.no_grad()
def rollout_correction_weights(
    old_log_prob: torch.Tensor,
    rollout_log_prob: torch.Tensor,
    mask: torch.Tensor,
    correction: RolloutCorrection,
) -> tuple[Optional[torch.Tensor], dict[str, Any]]:
    """The per-token weights ``[B, T]`` (None when the correction is off) and the values of its
    metrics, as ``[B, T]`` tensors whose masked mean is the metric:

    * ``rollout_is_weight``: the IS weight (1 where ``rollout_is`` is ``none``);
    * ``rollout_is_capped``: tokens whose ``exp(x)`` exceeded the cap;
    * ``rollout_rs_rejected``: tokens given weight 0 by rejection;
    * ``rollout_mismatch_kl``: k3 of the rollout policy against the old one,
      ``exp(d) - 1 - d`` (sampled from the rollout policy; always reported).

    ``old_log_prob``, ``rollout_log_prob`` are ``[B, T]`` in the loss's dtype, 0 on padding;
    ``mask`` is bool.
    """
    d = torch.where(mask, old_log_prob - rollout_log_prob, torch.zeros((), dtype=old_log_prob.dtype,
                                                                        device=old_log_prob.device))
    ones = torch.ones_like(d)
    no = torch.zeros_like(mask)
    values: dict[str, Any] = {
        "rollout_mismatch_kl": kl_penalty(rollout_log_prob, old_log_prob, "k3"),
        "rollout_is_weight": ones,
        "rollout_is_capped": no,
        "rollout_rs_rejected": no,
    }
    weight: Optional[torch.Tensor] = None
    if correction.rollout_is != "none":
        raw = torch.exp(_level_log_ratio(d, mask, correction.rollout_is))
        cap = correction.rollout_is_cap
        weight = torch.clamp(raw, max=cap)
        values["rollout_is_weight"] = weight
        values["rollout_is_capped"] = raw > cap
    if correction.rollout_rs != "none":
        lo, hi = correction.rollout_rs_bounds
        ratio = torch.exp(_level_log_ratio(d, mask, correction.rollout_rs))
        rejected = (ratio < lo) | (ratio > hi)
        values["rollout_rs_rejected"] = rejected
        keep = (~rejected).to(d.dtype)
        weight = keep if weight is None else weight * keep
    return weight, values
