"""The log-prob drift check: how far the rollout engine's log-probs of its sampled tokens are from
the actor's score of the same tokens (``pi_rollout`` against ``pi_old``, the mismatch that the
rollout correction, :mod:`megatron_tepo.algorithms.correction`, weights away).

:class:`DriftCheck` gives the mean and max ``|engine log-prob - actor log-prob|`` over the valid
tokens as metrics and warns when either is over its threshold: a large drift means the engine
runs other weights than the actor (a weight sync gone wrong) or a numerically different model.

Left out: combining the metrics over data-parallel ranks (the trainer's driver does it and calls
:meth:`DriftCheck.report` with the totals) and acting on a drift (the correction does that).
Pure PyTorch, like the rest of the package.
"""
from __future__ import annotations

import logging
import warnings
from dataclasses import dataclass
from typing import Dict

import torch

log = logging.getLogger(__name__)


@dataclass
class DriftCheck:
    """Mean / max |engine log-prob - actor log-prob| over the same tokens; warns over a threshold."""
    mean_threshold: float = 0.05
    max_threshold: float = 1.0
    prefix: str = "rollout/logprob_drift"

    def __call__(self, engine_log_probs, actor_log_probs, mask=None, warn: bool = True) -> Dict[str, float]:
        e = _as_flat(engine_log_probs)
        a = _as_flat(actor_log_probs)
        if e.shape != a.shape:
            raise ValueError(f"drift check: {tuple(e.shape)} engine log-probs vs {tuple(a.shape)} actor's")
        diff = (e.double() - a.double()).abs()
        if mask is not None:
            diff = diff[_as_flat(mask).bool()]
        if diff.numel() == 0:
            return self.report(0.0, 0.0, 0, warn=False)
        return self.report(float(diff.mean()), float(diff.max()), int(diff.numel()), warn=warn)

    def report(self, mean: float, max_: float, tokens: int, warn: bool = True) -> Dict[str, float]:
        """The metrics for drift already measured (e.g. combined over ranks); warns (``warn``)
        when the mean or the max is over its threshold."""
        if warn and (mean > self.mean_threshold or max_ > self.max_threshold):
            msg = (f"log-prob drift between rollout engine and actor: mean {mean:.4g} "
                   f"(threshold {self.mean_threshold}), max {max_:.4g} "
                   f"(threshold {self.max_threshold}) over {tokens} tokens")
            warnings.warn(msg, RuntimeWarning, stacklevel=3)
            log.warning(msg)
        return {f"{self.prefix}_mean": mean, f"{self.prefix}_max": max_, f"{self.prefix}_tokens": tokens}


def _as_flat(x) -> torch.Tensor:
    if isinstance(x, torch.Tensor):
        return x.reshape(-1)
    if len(x) and isinstance(x[0], (list, tuple, torch.Tensor)):
        return torch.cat([torch.as_tensor(list(r) if not isinstance(r, torch.Tensor) else r,
                                          dtype=torch.float64).reshape(-1) for r in x]) if len(x) else torch.zeros(0)
    return torch.as_tensor(list(x), dtype=torch.float64)
