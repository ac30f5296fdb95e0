"""KL estimators, TEPO's token-level KL mask and the entropy-change estimates it needs.

KL estimators (Schulman, "Approximating KL divergence"): tokens are sampled from ``q`` (the
rollout / current policy), ``l = log pi_theta(token)``, ``lr = log p_ref(token)`` where the
reference is pi_old or pi_ref, and they estimate ``KL(pi_theta || ref)``:

* ``k1``  = ``l - lr``
* ``k2``  = ``0.5 (l - lr)^2``
* ``k3``  = ``exp(d) - d - 1`` with ``d = clamp(lr - l, -20, 20)`` (GRPO / DeepSeekMath eq. 4,
  verl's ``low_var_kl``; always >= 0). The clamp keeps ``exp`` finite; unlike verl we do not
  additionally clamp the result to [-10, 10].
* ``abs`` = ``|l - lr|`` (KL-Cov's penalty).

KL masks (TEPO eq. 4 and Table 3 panels A/E) select the tokens on which the KL term acts:
``none``, ``all`` (undifferentiated KL), ``pos_adv_dec_entropy`` (``A > 0 and dH < 0``, TEPO's
default), ``neg_adv_inc_entropy`` (``A < 0 and dH > 0``) and ``either`` (their union).

Entropy change ``dH`` at a token, two ways:

* measured: ``H_theta - H_old`` (current minus rollout policy entropy at the same position);
* predicted: ``-A (log pi_a + H)``, the first-order entropy change caused by the policy-gradient
  step on the sampled token ``a`` (Cui et al. 2025: ``dH ~ -Cov(log pi, A)``; TEPO eq. 1 gives
  ``dH/dz_a = -pi_a (log pi_a + H)``). The issue text's ``sign(A (log pi + H))`` has the opposite
  sign; see docs/ALGORITHMS.md.
"""
from __future__ import annotations

import torch

__all__ = [
    "KL_ESTIMATORS",
    "KL_MASKS",
    "LOG_RATIO_CLAMP",
    "kl_penalty",
    "kl_mask",
    "kl_mask_needs_entropy_change",
    "predicted_entropy_change",
    "measured_entropy_change",
]

KL_ESTIMATORS: tuple[str, ...] = ("k1", "k2", "k3", "abs")
KL_MASKS: tuple[str, ...] = ("none", "all", "pos_adv_dec_entropy", "neg_adv_inc_entropy", "either")

#: Every log-ratio is clamped to [-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP] before ``exp``.
LOG_RATIO_CLAMP: float = 20.0


def _float(t: torch.Tensor) -> torch.Tensor:
    return t if t.dtype in (torch.float32, torch.float64) else t.float()


def kl_penalty(log_prob: torch.Tensor, ref_log_prob: torch.Tensor, estimator: str) -> torch.Tensor:
    """Element-wise KL estimate of ``KL(pi_theta || ref)``; see the module docstring.

    Computed in fp32 (fp64 kept); differentiable w.r.t. ``log_prob``. The caller masks padding.
    """
    if estimator not in KL_ESTIMATORS:
        raise ValueError(f"unknown KL estimator {estimator!r}; valid estimators: {list(KL_ESTIMATORS)}")
    if log_prob.shape != ref_log_prob.shape:
        raise ValueError(
            f"log_prob has shape {tuple(log_prob.shape)} but ref_log_prob has shape "
            f"{tuple(ref_log_prob.shape)}; they must match"
        )
    l, lr = _float(log_prob), _float(ref_log_prob)
    if l.dtype != lr.dtype:
        l, lr = l.double(), lr.double()
    diff = l - lr
    if estimator == "k1":
        return diff
    if estimator == "k2":
        return 0.5 * diff.square()
    if estimator == "abs":
        return diff.abs()
    d = torch.clamp(-diff, -LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    return torch.exp(d) - d - 1.0


def predicted_entropy_change(
    log_prob: torch.Tensor, entropy: torch.Tensor, advantages: torch.Tensor
) -> torch.Tensor:
    """First-order entropy change ``dH ~ -A (log pi_a + H)`` of a policy-gradient step (detached).

    For a softmax over logits ``z``, ``dH/dz_a = -pi_a (log pi_a + H)`` (TEPO eq. 1 with the
    sign of ``H = -sum pi log pi``); raising the sampled token's logit in proportion to ``A``
    changes the entropy by ``-eta A pi_a (log pi_a + H)``, whose sign is that of the return value.
    Example: pi = (0.9, 0.1), sampling the 0.9 token with A > 0 sharpens the distribution
    (dH < 0) while ``log 0.9 + H = +0.22``.
    """
    with torch.no_grad():
        return -advantages * (log_prob + entropy)


def measured_entropy_change(entropy: torch.Tensor, old_entropy: torch.Tensor) -> torch.Tensor:
    """``H_theta - H_old`` at each position (detached)."""
    with torch.no_grad():
        return entropy - old_entropy


def kl_mask_needs_entropy_change(kind: str) -> bool:
    """Whether mask ``kind`` depends on the entropy change ``dH``."""
    if kind not in KL_MASKS:
        raise ValueError(f"unknown KL mask {kind!r}; valid masks: {list(KL_MASKS)}")
    return kind not in ("none", "all")


def kl_mask(
    kind: str, advantages: torch.Tensor, mask: torch.Tensor, delta_entropy: torch.Tensor | None = None
) -> torch.Tensor:
    """Boolean KL mask ``M`` (always within ``mask``), computed without gradient.

    ``delta_entropy`` is required by the three entropy-dependent kinds.
    """
    needs = kl_mask_needs_entropy_change(kind)
    valid = mask if mask.dtype == torch.bool else mask != 0
    with torch.no_grad():
        if kind == "none":
            return torch.zeros_like(valid)
        if kind == "all":
            return valid.clone()
        if needs and delta_entropy is None:
            raise ValueError(f"KL mask {kind!r} needs the entropy change delta_entropy")
        pos_dec = (advantages > 0) & (delta_entropy < 0)
        neg_inc = (advantages < 0) & (delta_entropy > 0)
        selected = {"pos_adv_dec_entropy": pos_dec, "neg_adv_inc_entropy": neg_inc, "either": pos_dec | neg_inc}[kind]
        return selected & valid
