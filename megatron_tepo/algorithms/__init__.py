"""Core RL losses of megatron_tepo: advantages, aggregation, KL, and the policy-loss registry.

Pure PyTorch: this package imports nothing from megatron, sglang or other megatron_tepo
subpackages. Formulas and every choice where the sources disagree: docs/ALGORITHMS.md.
"""
from .advantages import (
    GroupFilterResult,
    broadcast_to_tokens,
    compute_group_advantages,
    filter_groups,
    gpg_correction,
)
from .aggregation import AGG_MODES, aggregate, count_for_normalizer, masked_mean
from .correction import CORRECTION_LEVELS, RolloutCorrection, rollout_correction_weights
from .drift import DriftCheck
from .kl import (
    KL_ESTIMATORS,
    KL_MASKS,
    LOG_RATIO_CLAMP,
    kl_mask,
    kl_penalty,
    measured_entropy_change,
    predicted_entropy_change,
)
from .losses import (
    DELTA_ENTROPY_MODES,
    POLICY_LOSSES,
    SHARED_DEFAULTS,
    LossContext,
    LossTerms,
    PolicyLoss,
    PolicyLossSpec,
    clamp_log_ratio,
    compute_policy_loss,
    dual_clip,
    get_loss_defaults,
    ppo_clip,
    register_policy_loss,
    stale_sequence_ratio_warning,
)

__all__ = [
    # advantages
    "compute_group_advantages",
    "broadcast_to_tokens",
    "GroupFilterResult",
    "filter_groups",
    "gpg_correction",
    # aggregation
    "AGG_MODES",
    "aggregate",
    "count_for_normalizer",
    "masked_mean",
    # rollout correction
    "CORRECTION_LEVELS",
    "RolloutCorrection",
    "rollout_correction_weights",
    "DriftCheck",
    # kl
    "KL_ESTIMATORS",
    "KL_MASKS",
    "LOG_RATIO_CLAMP",
    "kl_penalty",
    "kl_mask",
    "predicted_entropy_change",
    "measured_entropy_change",
    # losses
    "POLICY_LOSSES",
    "SHARED_DEFAULTS",
    "DELTA_ENTROPY_MODES",
    "LossContext",
    "LossTerms",
    "PolicyLossSpec",
    "PolicyLoss",
    "register_policy_loss",
    "get_loss_defaults",
    "stale_sequence_ratio_warning",
    "compute_policy_loss",
    "clamp_log_ratio",
    "ppo_clip",
    "dual_clip",
]
