"""Group-relative advantages (GRPO / Dr.GRPO), DAPO dynamic-sampling filter, GPG correction.

Rewards are a 1-D tensor ``[num_groups * group_size]`` with each prompt's ``group_size``
responses stored contiguously.

* GRPO (TEPO eq. 9 / Table 5): ``A = (r - mean_g) / (std_g + eps)`` with the *unbiased* (N-1)
  group standard deviation, as verl (``torch.std``) and TRL (``nanstd``) do; ``eps`` = 1e-6 (verl).
* Dr.GRPO (``std_normalize=False``): ``A = r - mean_g``.
* A group whose rewards are all equal -- including every group when ``group_size == 1`` -- gets
  advantage exactly 0 (never NaN, never a rounding residue of ``r - mean``). verl instead uses
  mean 0 / std 1 for a single-response group (``A = r``); we do not, since a lone response
  carries no group-relative signal.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = [
    "compute_group_advantages",
    "broadcast_to_tokens",
    "GroupFilterResult",
    "filter_groups",
    "gpg_correction",
]


def _grouped(rewards: torch.Tensor, group_size: int) -> torch.Tensor:
    """Validate and view ``rewards`` as ``[num_groups, group_size]`` in fp32 (fp64 kept)."""
    if not isinstance(rewards, torch.Tensor):
        raise ValueError(f"rewards must be a torch.Tensor, got {type(rewards).__name__}")
    if isinstance(group_size, bool) or not isinstance(group_size, int) or group_size < 1:
        raise ValueError(f"group_size must be an int >= 1, got {group_size!r}")
    if rewards.dim() != 1:
        raise ValueError(f"rewards must be 1-D [num_groups * group_size], got shape {tuple(rewards.shape)}")
    if rewards.numel() % group_size != 0:
        raise ValueError(
            f"rewards has length {rewards.numel()}, which is not divisible by group_size={group_size}"
        )
    dtype = torch.float64 if rewards.dtype == torch.float64 else torch.float32
    r = rewards.detach().to(dtype)
    if not bool(torch.isfinite(r).all()):
        raise ValueError("rewards contain non-finite values (nan/inf)")
    return r.view(-1, group_size)


def _zero_spread(groups: torch.Tensor) -> torch.Tensor:
    """[num_groups] bool: True where every reward of the group is equal."""
    return groups.amax(dim=1) == groups.amin(dim=1)


def compute_group_advantages(
    rewards: torch.Tensor, group_size: int, std_normalize: bool = True, eps: float = 1e-6
) -> torch.Tensor:
    """Per-response group-relative advantages ``[num_responses]``.

    ``A_i = (r_i - mean_g) / (std_g + eps)`` (unbiased std) if ``std_normalize`` else
    ``r_i - mean_g`` (Dr.GRPO). Zero-spread groups (and ``group_size == 1``) give exactly 0.

    Raises:
        ValueError: non-1-D ``rewards``, ``group_size`` < 1, a length not divisible by
            ``group_size``, non-finite rewards, or a negative ``eps``.
    """
    if eps < 0:
        raise ValueError(f"eps must be >= 0, got {eps!r}")
    groups = _grouped(rewards, group_size)
    centred = groups - groups.mean(dim=1, keepdim=True)
    if std_normalize and group_size > 1:
        centred = centred / (groups.std(dim=1, unbiased=True, keepdim=True) + eps)
    flat = _zero_spread(groups).unsqueeze(1)
    return torch.where(flat, torch.zeros_like(centred), centred).reshape(-1)


def broadcast_to_tokens(advantages: torch.Tensor, response_mask: torch.Tensor) -> torch.Tensor:
    """Per-response advantages ``[B]`` -> per-token ``[B, T]``; 0 on padding (``response_mask == 0``)."""
    if advantages.dim() != 1:
        raise ValueError(f"advantages must be 1-D [batch], got shape {tuple(advantages.shape)}")
    if response_mask.dim() != 2 or response_mask.shape[0] != advantages.shape[0]:
        raise ValueError(
            f"response_mask must be [batch, response_len] with batch = {advantages.shape[0]} "
            f"(advantages shape {tuple(advantages.shape)}), got shape {tuple(response_mask.shape)}"
        )
    mask = response_mask if response_mask.dtype == torch.bool else response_mask != 0
    expanded = advantages.unsqueeze(1).expand(mask.shape)
    return torch.where(mask, expanded, torch.zeros((), dtype=advantages.dtype, device=advantages.device))


@dataclass(frozen=True)
class GroupFilterResult:
    """Outcome of DAPO dynamic sampling.

    Attributes:
        keep_groups: bool ``[num_groups]``, False for groups whose rewards are all equal.
        keep_responses: bool ``[num_responses]``, ``keep_groups`` repeated ``group_size`` times.
        num_dropped: number of dropped groups.
        num_groups: total number of groups.
    """

    keep_groups: torch.Tensor
    keep_responses: torch.Tensor
    num_dropped: int
    num_groups: int


def filter_groups(rewards: torch.Tensor, group_size: int) -> GroupFilterResult:
    """DAPO dynamic sampling: drop groups whose rewards are all equal (zero advantage everywhere)."""
    groups = _grouped(rewards, group_size)
    keep = ~_zero_spread(groups)
    return GroupFilterResult(
        keep_groups=keep,
        keep_responses=keep.repeat_interleave(group_size),
        num_dropped=int((~keep).sum()),
        num_groups=int(groups.shape[0]),
    )


def gpg_correction(rewards: torch.Tensor, group_size: int) -> float:
    """GPG's gradient correction ``alpha = B / (B - M)`` (Chu et al. 2025, ``--adjust_gd``).

    ``B`` = number of groups, ``M`` = groups with zero reward spread. The caller may multiply the
    advantages (or the loss) by it. When every group has zero spread (``B == M``) all advantages
    are 0 anyway and 1.0 is returned instead of inf. (verl's ``compute_gpg_outcome_advantage``
    uses responses / responses-with-nonzero-score, which is not the paper's factor.)
    """
    groups = _grouped(rewards, group_size)
    b = int(groups.shape[0])
    m = int(_zero_spread(groups).sum())
    return 1.0 if b == m else b / (b - m)
