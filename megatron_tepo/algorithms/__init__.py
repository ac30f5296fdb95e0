"""Core RL losses of megatron_tepo: advantages, aggregation, KL, and the policy-loss registry.

Pure PyTorch: this package imports nothing from megatron, sglang or other megatron_tepo
subpackages. Formulas and every choice where the sources disagree: docs/ALGORITHMS.md.
"""
from . import advantages as _advantages
from . import aggregation as _aggregation
from . import correction as _correction
from . import kl as _kl
from . import losses as _losses
from .advantages import (
    GroupFilterResult,
    broadcast_to_tokens,
    compute_group_advantages,
    filter_groups,
    gpg_correction,
)
from .aggregation import AGG_MODES, aggregate, compute_dtype, count_for_normalizer, masked_mean
from .correction import CORRECTION_LEVELS, RolloutCorrection, rollout_correction_weights
from .drift import DriftCheck
from .kl import (
    KL_ESTIMATORS,
    KL_MASKS,
    LOG_RATIO_CLAMP,
    kl_mask,
    kl_mask_needs_entropy_change,
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

# the package's names: each module's own list (one list per name), and the drift check
__all__ = [*_advantages.__all__, *_aggregation.__all__, *_correction.__all__, "DriftCheck", *_kl.__all__,
           *_losses.__all__]
