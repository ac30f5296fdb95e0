"""Policy-gradient losses of TEPO and its baselines, behind one registry and one entry point.

Notation (all tensors ``[batch, response_len]``): ``l = log pi_theta``, ``lo = log pi_old`` (the
rollout policy), ``A`` per-token advantages, ``m`` the response mask, ``sg`` = stop-gradient,
``n_i = sum_t m_{i,t}``. Every loss returns a per-token loss ``L`` (to be *minimised*, i.e.
``L = -objective``) that :func:`compute_policy_loss` aggregates with
:func:`~megatron_tepo.algorithms.aggregation.aggregate`.

Numerics shared by every loss:

* inputs may be bf16/fp16/fp32; everything is computed in fp32 (fp64 if ``log_prob`` or another
  input is fp64) and the loss is returned in that dtype (fp32 for every non-fp64 input);
* padding positions (``m == 0``) may hold garbage, nan/inf included: every input is passed
  through ``torch.where(m, x, 0)`` before any arithmetic, so padding never reaches a product;
* every log-ratio -- token-level ``l - lo``, sequence-level ``mean_t(l - lo)``, prefix-level --
  is clamped to ``[-20, 20]`` before ``exp`` (:data:`~megatron_tepo.algorithms.kl.LOG_RATIO_CLAMP`).
  Outside the clamp the gradient through that ratio is 0, so ``l - lo = +-1e4`` gives a finite
  loss and finite (zero) gradient.

Micro-batch invariance: with ``normalizer`` = the mini-batch count from
:func:`~megatron_tepo.algorithms.aggregation.count_for_normalizer`, summing the losses of
micro-batches equals the whole-batch loss for every loss except ``clip_cov`` and ``kl_cov``
(their token selection is per micro-batch by construction, as in the reference code) and
``steer`` with ``steer_omega_max=None`` (STEER normalises ``|Omega|`` by its micro-batch maximum;
pass ``steer_omega_max`` to make it invariant).
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field, fields
from types import MappingProxyType
from typing import Any, Callable, ClassVar, Mapping, Optional

import torch

from .aggregation import AGG_MODES, Normalizer, aggregate, compute_dtype, count_for_normalizer, masked_mean
from .correction import RolloutCorrection, rollout_correction_weights
from .kl import (
    KL_ESTIMATORS,
    KL_MASKS,
    LOG_RATIO_CLAMP,
    kl_mask as build_kl_mask,
    kl_mask_needs_entropy_change,
    kl_penalty,
    measured_entropy_change,
    predicted_entropy_change,
)

__all__ = [
    "stale_sequence_ratio_warning",
    "SHARED_DEFAULTS",
    "DELTA_ENTROPY_MODES",
    "LossContext",
    "LossTerms",
    "PolicyLossSpec",
    "PolicyLoss",
    "POLICY_LOSSES",
    "register_policy_loss",
    "get_loss_defaults",
    "compute_policy_loss",
    "clamp_log_ratio",
    "ppo_clip",
    "dual_clip",
]

#: Defaults every loss inherits unless its registration overrides them.
SHARED_DEFAULTS: Mapping[str, Any] = MappingProxyType({"clip_low": 0.2, "clip_high": 0.28, "agg": "token-mean"})
DELTA_ENTROPY_MODES: tuple[str, ...] = ("measured", "predicted")


# --------------------------------------------------------------------------------------------
# Registry
# --------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class LossContext:
    """What a registered loss function receives (all tensors ``[B, T]``, already sanitised).

    ``log_prob`` is differentiable; every tensor is 0 on padding; ``advantages`` already include
    the entropy-based shaping; ``options`` holds the resolved loss-specific settings.
    """

    log_prob: torch.Tensor
    old_log_prob: torch.Tensor
    advantages: torch.Tensor
    mask: torch.Tensor
    old_entropy: Optional[torch.Tensor]
    clip_low: Optional[float]
    clip_high: Optional[float]
    options: Mapping[str, Any]


@dataclass
class LossTerms:
    """What a registered loss function returns.

    Attributes:
        per_token: ``[B, T]`` loss to be aggregated (its padding values are ignored).
        clipped: bool ``[B, T]`` of tokens whose PPO term is clipped (``clip_frac``), or None.
        extra: loss-specific per-token values whose masked mean becomes a metric of that name.
    """

    per_token: torch.Tensor
    clipped: Optional[torch.Tensor] = None
    extra: dict[str, torch.Tensor] = field(default_factory=dict)


@dataclass(frozen=True)
class PolicyLossSpec:
    """A registered loss: its function and its defaults (shared keys + loss-specific keys)."""

    name: str
    fn: Callable[[LossContext], LossTerms]
    defaults: Mapping[str, Any]
    # its default clip range is the widest measured to train one step off as well as on-policy
    # (a sequence-level ratio): a wider range with rollout.max_staleness > 0 is warned about
    off_policy_range: bool = False

    @property
    def specific_keys(self) -> tuple[str, ...]:
        """The keys accepted as ``**loss_specific`` by :func:`compute_policy_loss`."""
        return tuple(k for k in self.defaults if k not in SHARED_DEFAULTS)


_REGISTRY: dict[str, PolicyLossSpec] = {}
#: Read-only view ``name -> PolicyLossSpec`` of every registered loss.
POLICY_LOSSES: Mapping[str, PolicyLossSpec] = MappingProxyType(_REGISTRY)


def register_policy_loss(
    name: str, *, defaults: Mapping[str, Any], off_policy_range: bool = False
) -> Callable[[Callable[[LossContext], LossTerms]], Callable[[LossContext], LossTerms]]:
    """Decorator registering ``fn(ctx: LossContext) -> LossTerms`` under ``name``.

    ``defaults`` may override the shared ``clip_low``/``clip_high``/``agg`` defaults
    (:data:`SHARED_DEFAULTS`); every other key is a loss-specific option with its default.
    ``off_policy_range``: the default clip range is the widest that was measured to train one step
    off (:func:`stale_sequence_ratio_warning`).
    """
    merged = {**SHARED_DEFAULTS, **dict(defaults)}
    if merged["agg"] not in AGG_MODES:
        raise ValueError(f"loss {name!r}: default agg {merged['agg']!r} is not one of {list(AGG_MODES)}")

    def decorator(fn: Callable[[LossContext], LossTerms]) -> Callable[[LossContext], LossTerms]:
        if name in _REGISTRY:
            raise ValueError(f"policy loss {name!r} is already registered")
        _REGISTRY[name] = PolicyLossSpec(name=name, fn=fn, defaults=MappingProxyType(merged),
                                         off_policy_range=off_policy_range)
        return fn

    return decorator


def _spec(name: str) -> PolicyLossSpec:
    if name not in _REGISTRY:
        raise ValueError(f"unknown policy loss {name!r}; valid losses: {sorted(_REGISTRY)}")
    return _REGISTRY[name]


def get_loss_defaults(name: str) -> dict[str, Any]:
    """A copy of the defaults of loss ``name`` (``clip_low``, ``clip_high``, ``agg`` + its own keys)."""
    return dict(_spec(name).defaults)


# Losses whose trust region is a sequence-level (geometric-mean) ratio (``off_policy_range``). The
# widest range at which they were measured to train one step off as well as on-policy is their
# default: TEPO learned worse one step off at 0.2/0.28 on the tiny benchmark, and as well as
# on-policy at 3e-4/4e-4 and at 0.01/0.014, its default (docs/BENCHMARKS.md, "One step off", "A
# range in between"); a run with a wider range says so. A default moved without a one-step-off
# measurement would need its own measured range here.
STALE_SEQUENCE_RATIO_WARNING = (
    "rollout.max_staleness={staleness} with algorithm.loss={loss} and clip {low}/{high}: on the tiny benchmark this "
    "loss learned worse one step off with its ratio clipped at 0.2/0.28, and as well as on-policy at {tight_low}/"
    "{tight_high} (docs/BENCHMARKS.md, 'One step off'); watch rollout_mismatch_kl and held-out accuracy")


def stale_sequence_ratio_warning(alg, max_staleness: int) -> Optional[str]:
    """The warning for a loss with ``off_policy_range`` trained off-policy (``max_staleness`` > 0)
    with a wider clip range than was measured to work, or None. ``alg``: the run config's
    ``algorithm`` section (``loss``, ``clip_low``, ``clip_high``)."""
    if not max_staleness or alg.loss not in _REGISTRY or not _REGISTRY[alg.loss].off_policy_range:
        return None
    defaults = get_loss_defaults(alg.loss)
    low = defaults["clip_low"] if alg.clip_low is None else alg.clip_low
    high = defaults["clip_high"] if alg.clip_high is None else alg.clip_high
    tight_low, tight_high = defaults["clip_low"], defaults["clip_high"]  # measured one step off (above)
    if low <= tight_low and high <= tight_high:
        return None
    return STALE_SEQUENCE_RATIO_WARNING.format(staleness=max_staleness, loss=alg.loss, low=low, high=high,
                                               tight_low=tight_low, tight_high=tight_high)


# --------------------------------------------------------------------------------------------
# Shared pieces
# --------------------------------------------------------------------------------------------
def clamp_log_ratio(log_ratio: torch.Tensor) -> torch.Tensor:
    """``clamp(log_ratio, -20, 20)``: applied before every ``exp`` of a log-ratio."""
    return torch.clamp(log_ratio, -LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)


def ppo_clip(
    weight: torch.Tensor, advantages: torch.Tensor, clip_low: float, clip_high: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """PPO clipped surrogate as a loss: ``max(-A w, -A clip(w, 1-clip_low, 1+clip_high))``.

    Returns the per-token loss and the bool mask of tokens where the clipped branch is strictly
    larger (verl's ``pg_clipfrac``: the clip removes the gradient there).
    """
    unclipped = -advantages * weight
    clipped = -advantages * torch.clamp(weight, 1.0 - clip_low, 1.0 + clip_high)
    return torch.maximum(unclipped, clipped), clipped > unclipped


def dual_clip(loss: torch.Tensor, advantages: torch.Tensor, clip_ratio_c: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Dual-clip PPO (Ye et al. 2020): for ``A < 0`` cap the loss at ``-A c``.

    Returns the new loss and the bool mask of tokens where the cap is active.
    """
    cap = -advantages * clip_ratio_c
    negative = advantages < 0
    return torch.where(negative, torch.minimum(loss, cap), loss), negative & (loss > cap)


def _token_ratio(ctx: LossContext) -> torch.Tensor:
    """``r = exp(clamp(l - lo))``."""
    return torch.exp(clamp_log_ratio(ctx.log_prob - ctx.old_log_prob))


def _seq_mean(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """``[B, 1]`` mean over each row's valid tokens (0 for an empty row); ``values`` is 0 on padding."""
    n = mask.sum(dim=-1, keepdim=True)
    return values.sum(dim=-1, keepdim=True) / torch.where(n > 0, n, torch.ones_like(n)).to(values.dtype)


def _check_dual_clip_constant(value: Any, loss: str, allow_none: bool) -> Optional[float]:
    if value is None and allow_none:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 1.0:
        raise ValueError(f"loss {loss!r}: clip_ratio_c must be a number > 1 (or None to disable), got {value!r}")
    return float(value)


def _check_fraction(value: Any, key: str, loss: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0.0 < value <= 1.0:
        raise ValueError(f"loss {loss!r}: {key} must be a number in (0, 1], got {value!r}")
    return float(value)


def _check_number(value: Any, key: str, loss: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise ValueError(f"loss {loss!r}: {key} must be a finite number, got {value!r}")
    return float(value)


# --------------------------------------------------------------------------------------------
# The losses
# --------------------------------------------------------------------------------------------
# docs/ALGORITHMS.md, "tepo": why this range; measured one step off (stale_sequence_ratio_warning)
@register_policy_loss("tepo", defaults={"clip_low": 0.01, "clip_high": 0.014}, off_policy_range=True)
def tepo_loss(ctx: LossContext) -> LossTerms:
    """TEPO (paper eq. 4): sequence-level likelihood ratio, token-level aggregation.

    ``log w_i = clamp(sum_t m (l - lo) / n_i, -20, 20)``, ``w_i = exp(log w_i)`` (differentiable:
    the gradient reaches every token of sequence ``i``), and per token
    ``L = -min(w_i A, clip(w_i, 1-clip_low, 1+clip_high) A)``. The KL term with TEPO's mask is
    added by :func:`compute_policy_loss`. In the unclipped region, with token-mean over ``N``
    tokens and ``A_i`` constant per sequence, ``dL/dl_{i,t} = -w_i A_i / N`` -- which is
    ``|y_i|`` times the gradient written in the paper's Algorithm 1, line 21.
    Micro-batch invariant.
    """
    log_w = clamp_log_ratio(_seq_mean(ctx.log_prob - ctx.old_log_prob, ctx.mask))
    weight = torch.exp(log_w).expand_as(ctx.log_prob)
    loss, clipped = ppo_clip(weight, ctx.advantages, ctx.clip_low, ctx.clip_high)
    return LossTerms(loss, clipped)


@register_policy_loss("grpo", defaults={"clip_ratio_c": 3.0})
def grpo_loss(ctx: LossContext) -> LossTerms:
    """GRPO/DAPO with clip-higher and dual-clip (verl ``compute_policy_loss_vanilla``).

    ``r = exp(clamp(l - lo))``, ``L1 = max(-A r, -A clip(r, 1-clip_low, 1+clip_high))``,
    ``L = min(L1, -A c)`` where ``A < 0`` (``c = clip_ratio_c`` > 1; None disables), else ``L1``.
    Micro-batch invariant.
    """
    c = _check_dual_clip_constant(ctx.options["clip_ratio_c"], "grpo", allow_none=True)
    loss, clipped = ppo_clip(_token_ratio(ctx), ctx.advantages, ctx.clip_low, ctx.clip_high)
    dual = torch.zeros_like(clipped)
    if c is not None:
        loss, dual = dual_clip(loss, ctx.advantages, c)
    return LossTerms(loss, clipped, {"dual_clip_frac": dual})


@register_policy_loss("gspo", defaults={"clip_low": 3e-4, "clip_high": 4e-4, "agg": "seq-mean-token-mean"})
def gspo_loss(ctx: LossContext) -> LossTerms:
    """GSPO-token (Zheng et al. 2025; verl's form), no dual clip.

    ``log s_{i,t} = clamp(l - sg(l) + sg(mean_t(l - lo)), -20, 20)``,
    ``L = max(-A s, -A clip(s, 1-clip_low, 1+clip_high))``. With ``A`` constant per sequence its
    value and gradient equal sequence-level GSPO ``s_i = exp(mean_t(l - lo))``. Default clip range
    3e-4/4e-4 (paper) and agg ``seq-mean-token-mean``; unlike verl an explicit ``agg`` is honoured.
    Micro-batch invariant.
    """
    seq_log_ratio = _seq_mean(ctx.log_prob - ctx.old_log_prob, ctx.mask).detach()
    log_s = clamp_log_ratio(ctx.log_prob - ctx.log_prob.detach() + seq_log_ratio)
    loss, clipped = ppo_clip(torch.exp(log_s), ctx.advantages, ctx.clip_low, ctx.clip_high)
    return LossTerms(loss, clipped)


@register_policy_loss("gpg", defaults={})
def gpg_loss(ctx: LossContext) -> LossTerms:
    """GPG (Chu et al. 2025): plain REINFORCE ``L = -l A``; no ratio, no clip (clip args unused).

    Micro-batch invariant.
    """
    return LossTerms(-ctx.log_prob * ctx.advantages, None)


@register_policy_loss("cispo", defaults={"clip_low": None, "clip_high": 4.0})
def cispo_loss(ctx: LossContext) -> LossTerms:
    """CISPO (MiniMax-M1): ``L = -sg(clip(r, 1-clip_low, 1+clip_high)) A l``.

    ``clip_low=None`` (default) means no lower bound; ``clip_high`` defaults to 4.0, i.e. the IS
    weight is capped at 5.0 (ScaleRL/TRL's recommended value; MiniMax published no number).
    ``clip_frac`` is the fraction of tokens whose weight was capped. Micro-batch invariant.
    """
    ratio = _token_ratio(ctx)
    lower = None if ctx.clip_low is None else 1.0 - ctx.clip_low
    upper = 1.0 + ctx.clip_high
    weight = torch.clamp(ratio, min=lower, max=upper).detach()
    capped = ratio > upper
    if lower is not None:
        capped = capped | (ratio < lower)
    return LossTerms(-weight * ctx.advantages * ctx.log_prob, capped)


@register_policy_loss(
    "clip_cov", defaults={"clip_cov_ratio": 2e-4, "clip_cov_lb": 1.0, "clip_cov_ub": 5.0, "generator": None}
)
def clip_cov_loss(ctx: LossContext) -> LossTerms:
    """Clip-Cov (Cui et al. 2025; verl/EM ``compute_policy_loss_clip_cov``), no dual clip.

    ``L = max(-A r, -A clip(r))`` except on a random subset of tokens, where ``L = 0`` (zero value
    and gradient, still counted in the denominator). Candidates: valid tokens not already
    PPO-clipped with ``lb < cov < ub``, ``cov = (A - mean A)(sg l - mean sg l)`` centred over all
    valid tokens of the micro-batch. ``min(max(int(ratio N), 1), #candidates)`` of them are drawn
    uniformly with ``torch.randperm`` (``generator``, default the global CPU RNG).
    NOT micro-batch invariant (selection per micro-batch, as in the reference). Unlike the
    reference the log-ratio is clamped to [-20, 20].
    """
    opts = ctx.options
    ratio_frac = _check_fraction(opts["clip_cov_ratio"], "clip_cov_ratio", "clip_cov")
    lb = _check_number(opts["clip_cov_lb"], "clip_cov_lb", "clip_cov")
    ub = _check_number(opts["clip_cov_ub"], "clip_cov_ub", "clip_cov")
    generator = opts["generator"]
    if generator is not None and not isinstance(generator, torch.Generator):
        raise ValueError(
            f"loss 'clip_cov': generator must be a torch.Generator or None, got {type(generator).__name__}"
        )
    loss, clipped = ppo_clip(_token_ratio(ctx), ctx.advantages, ctx.clip_low, ctx.clip_high)
    with torch.no_grad():
        mask = ctx.mask
        adv, logp = ctx.advantages, ctx.log_prob.detach()
        cov = (adv - masked_mean(adv, mask)) * (logp - masked_mean(logp, mask))
        candidates = torch.nonzero((mask & ~clipped & (cov > lb) & (cov < ub)).reshape(-1)).squeeze(1)
        num_valid = int(mask.sum())
        num_zero = min(max(int(ratio_frac * num_valid), 1), candidates.numel())
        perm_device = generator.device if generator is not None else torch.device("cpu")
        perm = torch.randperm(candidates.numel(), generator=generator, device=perm_device)
        chosen = candidates[perm[:num_zero].to(candidates.device)]
        zeroed = torch.zeros(mask.numel(), dtype=torch.bool, device=mask.device)
        zeroed[chosen] = True
        zeroed = zeroed.view_as(mask)
    loss = torch.where(zeroed, torch.zeros((), dtype=loss.dtype, device=loss.device), loss)
    return LossTerms(loss, clipped, {"clip_cov_frac": zeroed})


@register_policy_loss("kl_cov", defaults={"kl_cov_ratio": 2e-3, "kl_cov_coef": 1.0})
def kl_cov_loss(ctx: LossContext) -> LossTerms:
    """KL-Cov (Cui et al. 2025; verl/EM ``compute_policy_loss_kl_cov``): no PPO clip at all.

    ``L = -A r`` on every token, plus ``kl_cov_coef |l - lo|`` on the ``k = max(1, int(ratio N))``
    valid tokens with the largest ``cov = (A - mean A)(sg l - mean sg l)`` (``torch.topk``, over
    the micro-batch). ``kl_cov_ratio`` is a fraction (TEPO's k = 2e-3). NOT micro-batch invariant.
    """
    ratio_frac = _check_fraction(ctx.options["kl_cov_ratio"], "kl_cov_ratio", "kl_cov")
    coef = _check_number(ctx.options["kl_cov_coef"], "kl_cov_coef", "kl_cov")
    loss = -ctx.advantages * _token_ratio(ctx)
    with torch.no_grad():
        mask = ctx.mask
        flat_valid = torch.nonzero(mask.reshape(-1)).squeeze(1)
        selected = torch.zeros(mask.numel(), dtype=torch.bool, device=mask.device)
        if flat_valid.numel() > 0:
            adv = ctx.advantages.reshape(-1)[flat_valid]
            logp = ctx.log_prob.detach().reshape(-1)[flat_valid]
            cov = (adv - adv.mean()) * (logp - logp.mean())
            k = max(1, int(flat_valid.numel() * ratio_frac))
            selected[flat_valid[torch.topk(cov, k, largest=True).indices]] = True
        selected = selected.view_as(mask)
    penalty = coef * kl_penalty(ctx.log_prob, ctx.old_log_prob, "abs")
    loss = loss + torch.where(selected, penalty, torch.zeros((), dtype=loss.dtype, device=loss.device))
    return LossTerms(loss, None, {"kl_cov_frac": selected})


@register_policy_loss("prefix_is", defaults={})
def prefix_is_loss(ctx: LossContext) -> LossTerms:
    """Prefix importance sampling (TEPO Table 5 / Table 3 panel C), PPO clip, no dual clip.

    ``w_{i,t} = exp(clamp(mean_{j<=t, valid}(l_j - lo_j), -20, 20))`` (differentiable w.r.t. the
    whole prefix), ``L = max(-A w, -A clip(w, 1-clip_low, 1+clip_high))``. Micro-batch invariant.
    """
    prefix_sum = torch.cumsum(ctx.log_prob - ctx.old_log_prob, dim=-1)
    prefix_len = torch.cumsum(ctx.mask.to(torch.int64), dim=-1)
    prefix_len = torch.where(prefix_len > 0, prefix_len, torch.ones_like(prefix_len)).to(prefix_sum.dtype)
    weight = torch.exp(clamp_log_ratio(prefix_sum / prefix_len))
    loss, clipped = ppo_clip(weight, ctx.advantages, ctx.clip_low, ctx.clip_high)
    return LossTerms(loss, clipped)


@register_policy_loss("steer", defaults={"steer_w_min": 0.8, "clip_ratio_c": 10.0, "steer_omega_max": None})
def steer_loss(ctx: LossContext) -> LossTerms:
    """STEER (Hao et al. 2025; TEPO's "STEEL"): dual-clip GRPO loss reweighted per token.

    Under no_grad: ``p = clamp(exp(l), 1e-8, 1-1e-8)``, ``po = clamp(exp(lo), 1e-8, 1)``,
    ``Omega = (A / po) p (1 - p) (log p + H_old)`` with ``H_old = old_entropy`` (required),
    ``k = -ln(w_min) / max(Omega_max, 0.02)``, ``lambda = clamp(exp(-k |Omega|), w_min, 1)``;
    ``L = lambda * L_grpo(dual-clip c)``. ``Omega_max`` is the micro-batch's largest valid
    ``|Omega|`` (STEER's code, exponential mode as in its ``run_exp.sh``) unless
    ``steer_omega_max`` gives a fixed value, which makes the loss micro-batch invariant.
    """
    opts = ctx.options
    if ctx.old_entropy is None:
        raise ValueError("loss 'steer' requires old_entropy (the rollout policy's token entropy)")
    w_min = _check_fraction(opts["steer_w_min"], "steer_w_min", "steer")
    c = _check_dual_clip_constant(opts["clip_ratio_c"], "steer", allow_none=True)
    omega_max_opt = opts["steer_omega_max"]
    if omega_max_opt is not None and not _check_number(omega_max_opt, "steer_omega_max", "steer") >= 0:
        raise ValueError(f"loss 'steer': steer_omega_max must be >= 0 or None, got {omega_max_opt!r}")
    loss, clipped = ppo_clip(_token_ratio(ctx), ctx.advantages, ctx.clip_low, ctx.clip_high)
    dual = torch.zeros_like(clipped)
    if c is not None:
        loss, dual = dual_clip(loss, ctx.advantages, c)
    with torch.no_grad():
        zero = torch.zeros((), dtype=loss.dtype, device=loss.device)
        p = torch.clamp(torch.exp(ctx.log_prob.detach()), 1e-8, 1.0 - 1e-8)
        p_old = torch.clamp(torch.exp(ctx.old_log_prob), 1e-8, 1.0)
        omega = (ctx.advantages / p_old) * p * (1.0 - p) * (torch.log(p) + ctx.old_entropy)
        omega = torch.where(ctx.mask & torch.isfinite(omega), omega.abs(), zero)
        if omega_max_opt is None:
            omega_max = omega.max() if omega.numel() > 0 else zero
        else:
            omega_max = torch.tensor(float(omega_max_opt), dtype=loss.dtype, device=loss.device)
        k = -math.log(w_min) / torch.clamp(omega_max, min=0.02)
        lam = torch.clamp(torch.exp(-k * omega), w_min, 1.0)
    return LossTerms(loss * lam, clipped, {"dual_clip_frac": dual, "steer_weight_mean": lam})


# --------------------------------------------------------------------------------------------
# Entry point
# --------------------------------------------------------------------------------------------
def _check_shapes(log_prob: torch.Tensor, others: Mapping[str, Optional[torch.Tensor]]) -> None:
    if not isinstance(log_prob, torch.Tensor) or log_prob.dim() != 2:
        shape = tuple(log_prob.shape) if isinstance(log_prob, torch.Tensor) else type(log_prob).__name__
        raise ValueError(f"log_prob must be a 2-D tensor [batch, response_len], got {shape}")
    for name, t in others.items():
        if t is None:
            continue
        if not isinstance(t, torch.Tensor):
            raise ValueError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if t.shape != log_prob.shape:
            raise ValueError(
                f"{name} has shape {tuple(t.shape)} but log_prob has shape {tuple(log_prob.shape)}; "
                f"every input must be [batch, response_len]"
            )


def _clean(t: Optional[torch.Tensor], mask: torch.Tensor, dtype: torch.dtype) -> Optional[torch.Tensor]:
    """``where(mask, t, 0)`` in ``dtype``: padding garbage never reaches any arithmetic."""
    if t is None:
        return None
    return torch.where(mask, t.to(dtype), torch.zeros((), dtype=dtype, device=t.device))


def _resolve_options(spec: PolicyLossSpec, loss_specific: Mapping[str, Any]) -> dict[str, Any]:
    valid = spec.specific_keys
    for key in loss_specific:
        if key not in valid:
            raise ValueError(
                f"unknown option {key!r} for loss {spec.name!r}; valid loss-specific options: {list(valid)}"
            )
    return {k: loss_specific.get(k, spec.defaults[k]) for k in valid}


def _resolve_clip(value: Optional[float], default: Optional[float], name: str, loss: str) -> Optional[float]:
    value = default if value is None else value
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value < 0:
        raise ValueError(f"loss {loss!r}: {name} must be a finite number >= 0, got {value!r}")
    return float(value)


@dataclass(frozen=True)
class PolicyLoss:
    """A policy loss with every setting resolved and checked once: the object the trainer builds from
    the run config's ``algorithm`` section (:meth:`from_config`) and the actor calls per
    micro-batch. It also says how its normaliser is counted (:meth:`count`) and how each metric of
    a micro-batch reduces over micro-batches and data-parallel ranks (:meth:`metric_weight`,
    :meth:`is_summed`), so the actor knows nothing of loss semantics.

    Fields: ``name`` (a key of :data:`POLICY_LOSSES`), the shared settings of
    :func:`compute_policy_loss` (None = the loss's registered default), ``correction`` (the
    rollout correction) and ``options`` (the loss's own settings, defaults filled in). A shared
    setting is a field here and a field of ``AlgorithmConfig`` under the same name; nothing
    between the two copies it. Raises ValueError naming a bad setting.
    """

    name: str = "tepo"
    clip_low: Optional[float] = None
    clip_high: Optional[float] = None
    agg: Optional[str] = None
    kl_coef: float = 0.0
    kl_estimator: str = "k3"
    kl_mask: str = "pos_adv_dec_entropy"
    delta_entropy: str = "measured"
    entropy_coef: float = 0.0
    entropy_adv_alpha: float = 0.0
    entropy_adv_kappa: float = 2.0
    correction: RolloutCorrection = field(default_factory=RolloutCorrection)
    options: Mapping[str, Any] = field(default_factory=dict)

    #: metrics that are sums over the mini-batch (already divided by the global count), not token means
    SUMMED_METRICS: ClassVar[tuple[str, ...]] = ("pg_loss",)
    #: config fields read under another name (``algorithm.loss`` -> ``name`` ...)
    CONFIG_NAMES: ClassVar[Mapping[str, str]] = MappingProxyType(
        {"name": "loss", "options": "loss_args", "correction": "rollout_correction"})

    def __post_init__(self) -> None:
        name, kl_coef, kl_estimator, kl_mask = self.name, self.kl_coef, self.kl_estimator, self.kl_mask
        delta_entropy, entropy_coef = self.delta_entropy, self.entropy_coef
        entropy_adv_alpha, entropy_adv_kappa = self.entropy_adv_alpha, self.entropy_adv_kappa
        clip_low, clip_high, agg, loss_specific = self.clip_low, self.clip_high, self.agg, dict(self.options)
        spec = _spec(name)
        options = _resolve_options(spec, loss_specific)
        clip_low = _resolve_clip(clip_low, spec.defaults["clip_low"], "clip_low", name)
        clip_high = _resolve_clip(clip_high, spec.defaults["clip_high"], "clip_high", name)
        agg = spec.defaults["agg"] if agg is None else agg
        if agg not in AGG_MODES:
            raise ValueError(f"unknown aggregation mode agg={agg!r}; valid modes: {list(AGG_MODES)}")
        if kl_estimator not in KL_ESTIMATORS:
            raise ValueError(f"unknown KL estimator {kl_estimator!r}; valid estimators: {list(KL_ESTIMATORS)}")
        if kl_mask not in KL_MASKS:
            raise ValueError(f"unknown KL mask {kl_mask!r}; valid masks: {list(KL_MASKS)}")
        if delta_entropy not in DELTA_ENTROPY_MODES:
            raise ValueError(f"unknown delta_entropy {delta_entropy!r}; valid modes: {list(DELTA_ENTROPY_MODES)}")
        for key, value in (("kl_coef", kl_coef), ("entropy_coef", entropy_coef)):
            _check_number(value, key, name)
        if _check_number(entropy_adv_alpha, "entropy_adv_alpha", name) < 0:
            raise ValueError(f"entropy_adv_alpha must be >= 0, got {entropy_adv_alpha!r}")
        if not _check_number(entropy_adv_kappa, "entropy_adv_kappa", name) > 0:
            raise ValueError(f"entropy_adv_kappa must be > 0, got {entropy_adv_kappa!r}")
        if not isinstance(self.correction, RolloutCorrection):
            raise ValueError(f"correction must be a RolloutCorrection, got {type(self.correction).__name__}")
        for key, value in (("clip_low", clip_low), ("clip_high", clip_high), ("agg", agg),
                           ("options", MappingProxyType(options))):
            object.__setattr__(self, key, value)

    @classmethod
    def of(cls, name: str, *, rollout_is: str = "none", rollout_is_cap: float = 2.0, rollout_rs: str = "none",
           rollout_rs_bounds: tuple[float, float] = (0.5, 2.0), **settings: Any) -> "PolicyLoss":
        """From the flat keyword arguments of :func:`compute_policy_loss` (shared settings,
        ``rollout_*``, and the loss's own options)."""
        shared = {f.name for f in fields(cls)} - {"name", "correction", "options"}
        return cls(name=name, correction=RolloutCorrection(rollout_is, rollout_is_cap, rollout_rs, rollout_rs_bounds),
                   options={k: v for k, v in settings.items() if k not in shared},
                   **{k: v for k, v in settings.items() if k in shared})

    @classmethod
    def from_config(cls, section: Any) -> "PolicyLoss":
        """From a config section holding every field under its own name (or :attr:`CONFIG_NAMES`):
        the run config's ``algorithm``. Its ``rollout_correction`` may be any object with the
        fields of :class:`RolloutCorrection`."""
        values = {f.name: getattr(section, cls.CONFIG_NAMES.get(f.name, f.name)) for f in fields(cls)}
        rc = values["correction"]
        if not isinstance(rc, RolloutCorrection):
            values["correction"] = RolloutCorrection(**{f.name: getattr(rc, f.name) for f in fields(RolloutCorrection)})
        return cls(**values)

    def count(self, response_mask: torch.Tensor) -> torch.Tensor:
        """This batch's share of the normaliser (sum it over micro-batches and ranks, then pass it
        as ``normalizer``): :func:`~megatron_tepo.algorithms.aggregation.count_for_normalizer`."""
        return count_for_normalizer(response_mask, self.agg)

    @classmethod
    def is_summed(cls, key: str) -> bool:
        """A metric that adds up over micro-batches and ranks (``pg_loss``, ``num_*`` counts)."""
        return key in cls.SUMMED_METRICS or key.startswith("num_")

    def metric_weight(self, key: str, metrics: Mapping[str, Any], tokens: Any) -> Any:
        """The weight of a micro-batch's metric in its mini-batch value (the value is
        ``sum(metric * weight) / sum(weight)``, or the plain sum for :meth:`is_summed` ones):
        ``kl`` is a mean over the KL-mask tokens, every other mean is over valid tokens.
        ``tokens`` (the micro-batch's valid tokens) and the result may be tensors: no host sync."""
        if self.is_summed(key):
            return 1.0
        if key == "kl":
            return metrics.get("kl_mask_frac", 1.0) * tokens
        return tokens

    def __call__(self, log_prob: torch.Tensor, old_log_prob: torch.Tensor, advantages: torch.Tensor,
                 response_mask: torch.Tensor, *, entropy: Optional[torch.Tensor] = None,
                 old_entropy: Optional[torch.Tensor] = None, ref_log_prob: Optional[torch.Tensor] = None,
                 rollout_log_prob: Optional[torch.Tensor] = None,
                 normalizer: Normalizer = None) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """``(loss, metrics)`` of one (micro-)batch: see :func:`compute_policy_loss`."""
        correction = self.correction
        _check_shapes(
            log_prob,
            {
                "old_log_prob": old_log_prob,
                "advantages": advantages,
                "response_mask": response_mask,
                "entropy": entropy,
                "old_entropy": old_entropy,
                "ref_log_prob": ref_log_prob,
                "rollout_log_prob": rollout_log_prob,
            },
        )
        if correction.active and rollout_log_prob is None:
            raise ValueError(f"rollout_is={correction.rollout_is!r}, rollout_rs={correction.rollout_rs!r} "
                             f"(rollout correction) requires rollout_log_prob")
        if entropy is None and self.entropy_coef != 0:
            raise ValueError(f"entropy_coef={self.entropy_coef!r} (entropy regularisation) "
                             f"requires the `entropy` tensor")
        if entropy is None and self.entropy_adv_alpha > 0:
            raise ValueError(f"entropy_adv_alpha={self.entropy_adv_alpha!r} (entropy-based advantage) "
                             f"requires `entropy`")

        mask = response_mask if response_mask.dtype == torch.bool else response_mask != 0
        dtype = compute_dtype(log_prob, old_log_prob, advantages, entropy, old_entropy, ref_log_prob, rollout_log_prob)
        lp = _clean(log_prob, mask, dtype)
        old_lp = _clean(old_log_prob, mask, dtype).detach()
        adv = _clean(advantages, mask, dtype).detach()
        ent = _clean(entropy, mask, dtype)
        old_ent = _clean(old_entropy, mask, dtype)
        old_ent = None if old_ent is None else old_ent.detach()
        ref = old_lp if ref_log_prob is None else _clean(ref_log_prob, mask, dtype).detach()

        if self.entropy_adv_alpha > 0:  # Cheng et al. 2025: A' = A + min(alpha sg(H), |A| / kappa)
            adv = adv + torch.minimum(self.entropy_adv_alpha * ent.detach(), adv.abs() / self.entropy_adv_kappa)

        ctx = LossContext(lp, old_lp, adv, mask, old_ent, self.clip_low, self.clip_high, self.options)
        terms = _spec(self.name).fn(ctx)
        per_token = terms.per_token
        correction_values: dict[str, torch.Tensor] = {}
        if rollout_log_prob is not None:
            rollout_lp = _clean(rollout_log_prob, mask, dtype).detach()
            weight, correction_values = rollout_correction_weights(old_lp, rollout_lp, mask, correction)
            if weight is not None:
                per_token = per_token * weight
        pg_loss = aggregate(per_token, mask, self.agg, normalizer)
        total = pg_loss
        if self.entropy_coef != 0:
            total = total - self.entropy_coef * aggregate(ent, mask, self.agg, normalizer)

        # Entropy change dH (for the KL mask and the quadrant metrics).
        with torch.no_grad():
            d_h: Optional[torch.Tensor] = None
            if self.delta_entropy == "measured" and ent is not None and old_ent is not None:
                d_h = measured_entropy_change(ent, old_ent)
            elif self.delta_entropy == "predicted" and (ent is not None or old_ent is not None):
                d_h = predicted_entropy_change(lp, ent if ent is not None else old_ent, adv)
        needs_dh = kl_mask_needs_entropy_change(self.kl_mask)
        if self.kl_coef != 0 and needs_dh and d_h is None:
            missing = "entropy and old_entropy" if self.delta_entropy == "measured" else "entropy or old_entropy"
            raise ValueError(f"kl_mask={self.kl_mask!r} with delta_entropy={self.delta_entropy!r} needs {missing}")
        if needs_dh and d_h is None:  # KL off and dH unknown: the mask is reported as empty.
            m_kl = torch.zeros_like(mask)
        else:
            m_kl = build_kl_mask(self.kl_mask, adv, mask, d_h)

        zero = torch.zeros((), dtype=dtype, device=lp.device)
        kl_values = kl_penalty(lp, ref, self.kl_estimator)
        if self.kl_coef != 0:
            total = total + self.kl_coef * aggregate(torch.where(m_kl, kl_values, zero), mask, self.agg, normalizer)

        with torch.no_grad():

            def frac(x: torch.Tensor) -> torch.Tensor:
                return masked_mean(x.to(dtype), mask).float()

            no_clip = torch.zeros((), dtype=torch.float32, device=lp.device)
            metrics: dict[str, torch.Tensor] = {
                "pg_loss": pg_loss.detach().float(),
                "clip_frac": no_clip if terms.clipped is None else frac(terms.clipped),
                "approx_kl": frac(kl_penalty(lp, old_lp, "k3")),
                "kl_mask_frac": frac(m_kl),
                "kl": masked_mean(kl_values.detach(), m_kl).float(),
                "num_tokens": mask.sum().float(),
            }
            if ent is not None:
                metrics["entropy"] = frac(ent)
            if d_h is not None:
                pos, neg = adv > 0, adv < 0
                metrics["quad_pos_adv_inc_ent"] = frac(pos & (d_h > 0))
                metrics["quad_pos_adv_dec_ent"] = frac(pos & (d_h < 0))
                metrics["quad_neg_adv_inc_ent"] = frac(neg & (d_h > 0))
                metrics["quad_neg_adv_dec_ent"] = frac(neg & (d_h < 0))
            for key, values in (*terms.extra.items(), *correction_values.items()):
                metrics[key] = frac(values)
        return total, metrics


def compute_policy_loss(
    name: str,
    log_prob: torch.Tensor,
    old_log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    *,
    entropy: Optional[torch.Tensor] = None,
    old_entropy: Optional[torch.Tensor] = None,
    clip_low: Optional[float] = None,
    clip_high: Optional[float] = None,
    kl_coef: float = 0.0,
    kl_estimator: str = "k3",
    kl_mask: str = "pos_adv_dec_entropy",
    agg: Optional[str] = None,
    normalizer: Normalizer = None,
    ref_log_prob: Optional[torch.Tensor] = None,
    delta_entropy: str = "measured",
    entropy_coef: float = 0.0,
    entropy_adv_alpha: float = 0.0,
    entropy_adv_kappa: float = 2.0,
    rollout_log_prob: Optional[torch.Tensor] = None,
    rollout_is: str = "none",
    rollout_is_cap: float = 2.0,
    rollout_rs: str = "none",
    rollout_rs_bounds: tuple[float, float] = (0.5, 2.0),
    **loss_specific: Any,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Total policy loss of registered loss ``name`` plus the shared KL / entropy terms, and metrics.

    Args:
        name: a key of :data:`POLICY_LOSSES`.
        log_prob, old_log_prob, advantages, response_mask: ``[B, T]``; ``advantages`` per token,
            ``response_mask`` bool or float (non-zero = valid response token).
        entropy: current-policy token entropy ``[B, T]`` (differentiable; needed by the entropy
            bonus, the entropy-based advantage and the measured/predicted ``dH``).
        old_entropy: rollout-policy token entropy (``steer``; measured ``dH``).
        clip_low, clip_high, agg: None = the loss's registered default (:func:`get_loss_defaults`).
        kl_coef: ``beta``; the KL term is
            ``kl_coef * aggregate(kl_penalty(l, ref, kl_estimator) * M, mask, agg, normalizer)``
            with ``ref = ref_log_prob`` if given else ``old_log_prob`` and ``M`` the KL mask.
        kl_estimator: ``k1``/``k2``/``k3``/``abs`` (:func:`~megatron_tepo.algorithms.kl.kl_penalty`).
        kl_mask: ``none``/``all``/``pos_adv_dec_entropy``/``neg_adv_inc_entropy``/``either``.
        normalizer: global count replacing the local denominator of ``agg`` (see aggregation).
        delta_entropy: ``measured`` (``entropy - old_entropy``) or ``predicted``
            (``-A (log pi + H)``, ``H`` = ``entropy`` or, if None, ``old_entropy``).
        entropy_coef: total ``-= entropy_coef * aggregate(entropy)`` (positive maximises entropy).
        entropy_adv_alpha, entropy_adv_kappa: Cheng et al. 2025,
            ``A' = A + min(alpha * sg(H), |A| / kappa)`` when ``alpha > 0``.
        rollout_log_prob: ``[B, T]`` log-probs of the policy that sampled the tokens (the rollout
            engine's); needed by the rollout correction, and its mismatch metrics are reported
            whenever it is given.
        rollout_is, rollout_is_cap, rollout_rs, rollout_rs_bounds: the rollout correction
            (:mod:`~megatron_tepo.algorithms.correction`): IS weights ``min(exp(x), cap)`` and
            rejection outside ``[lo, hi]`` at level ``none``/``token``/``sequence``/``geometric``,
            multiplying each token's policy-loss term (not the KL or entropy terms).
        **loss_specific: options registered by the loss (e.g. ``clip_ratio_c`` for ``grpo``).

    Returns:
        ``(loss, metrics)``: ``loss`` a 0-d tensor (fp32; fp64 for fp64 inputs); ``metrics`` 0-d
        detached fp32 tensors: ``pg_loss`` (the aggregated policy term), ``clip_frac``,
        ``approx_kl`` (k3 of pi vs pi_old), ``kl_mask_frac``, ``kl`` (mean penalty where the mask
        is on), ``num_tokens``, ``entropy`` (if given), the four ``quad_*`` fractions (if ``dH``
        is available), loss-specific ones and, when ``rollout_log_prob`` is given,
        ``rollout_is_weight`` (mean IS weight), ``rollout_is_capped``, ``rollout_rs_rejected``
        (fractions) and ``rollout_mismatch_kl``. Fractions/means are over valid tokens.

    Raises:
        ValueError: unknown loss/agg/estimator/mask/delta_entropy or loss-specific key, shape
            mismatch, a missing tensor that an option needs, or an invalid numeric setting.
    """
    return PolicyLoss.of(
        name, clip_low=clip_low, clip_high=clip_high, kl_coef=kl_coef, kl_estimator=kl_estimator, kl_mask=kl_mask,
        agg=agg, delta_entropy=delta_entropy, entropy_coef=entropy_coef, entropy_adv_alpha=entropy_adv_alpha,
        entropy_adv_kappa=entropy_adv_kappa, rollout_is=rollout_is, rollout_is_cap=rollout_is_cap,
        rollout_rs=rollout_rs, rollout_rs_bounds=rollout_rs_bounds, **loss_specific,
    )(log_prob, old_log_prob, advantages, response_mask, entropy=entropy, old_entropy=old_entropy,
      ref_log_prob=ref_log_prob, rollout_log_prob=rollout_log_prob, normalizer=normalizer)
