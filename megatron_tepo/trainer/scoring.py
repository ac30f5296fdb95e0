"""A group's rewards from its samples: the environment's reward where it gave one, else the task's
reward on the final turn (:func:`score_samples`), with the data rows and the episodes' records handed
to a ``reward.function``; which groups a sandbox failure keeps out of training
(:func:`sandbox_failed`).

Left out: the order and resampling of groups (the schedules': trainer/rollouts.py, trainer/partial.py).
"""
from __future__ import annotations

from typing import Dict, List, Optional, Sequence, Tuple

from megatron_tepo.rewards import RewardFn, call_reward, scores_and_counts
from megatron_tepo.rollout.episode import environment_reward, final_turn

__all__ = ["score_samples", "sandbox_failed", "episode_record"]


def episode_record(sample) -> Dict:
    """A sample's episode record (``meta["episode"]``), ``{}`` for one turn."""
    meta = getattr(sample, "meta", None)
    return dict(meta.get("episode", {})) if isinstance(meta, dict) else {}


def score_samples(reward_fn: RewardFn, samples: Sequence, answers: Sequence[str],
                  rows: Optional[Sequence[Dict]] = None) -> Tuple[List[float], Dict[str, int]]:
    """(rewards, the reward's counts) of ``samples``: an episode's environment reward
    (:func:`~megatron_tepo.rollout.episode.environment_reward`) where it gave one; the others scored
    by ``reward_fn`` on their final turns (with ``rows`` and the episodes' records where it takes
    them); an episode ended by a sandbox failure 0, unscored (its group is not trained on).
    ``reward_fn`` is not called when no sample is left to it."""
    env = [environment_reward(s) for s in samples]
    failed = [episode_record(s).get("end") == "sandbox_failure" for s in samples]  # (not trained on: not scored)
    todo = [i for i, r in enumerate(env) if r is None and not failed[i]]
    scores: List[float] = [0.0 if r is None else r for r in env]
    counts: Dict[str, int] = {}
    if todo:
        got, counts = scores_and_counts(call_reward(
            reward_fn, [final_turn(samples[i]) for i in todo], [answers[i] for i in todo],
            [rows[i] for i in todo] if rows is not None else None, [episode_record(samples[i]) for i in todo]))
        for i, r in zip(todo, got):
            scores[i] = float(r)
    return scores, counts


def sandbox_failed(group: Sequence) -> bool:
    """Whether an episode of ``group`` ended on a failure of the sandbox (not the model's doing: the
    group is not trained on, ``environment.on_sandbox_failure: drop_group``)."""
    return any(episode_record(s).get("end") == "sandbox_failure" for s in group)
