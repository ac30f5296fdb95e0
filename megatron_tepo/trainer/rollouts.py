"""A step's rollout on the driver: the task, the groups it generates and scores with DAPO dynamic
sampling, the held-out evaluation and the weight sync into the engine.

* :class:`Task` -- tokenized prompts with answers, the reward, how responses end.
* :func:`generate_groups` -- ``prompts_per_step`` groups of ``n_samples``: generate, score, drop the
  groups whose rewards are all equal and draw fresh prompts, for at most ``max_sampling_rounds``
  rounds; :class:`Generated` is what one step's rollout hands on.
* :func:`evaluate` -- avg@n and pass@n over held-out prompts; :func:`sync_weights` -- the actor's
  weights into the engine (collective).

A multi-turn engine (:class:`~megatron_tepo.rollout.episode.EpisodeEngine`) returns whole episodes,
each opened from its data row (``Task.train_rows``); the environment's reward is the episode's where
it gives one (:mod:`~megatron_tepo.trainer.scoring`), else the reward reads each one's final turn (:func:`~megatron_tepo.rollout.episode.final_turn`), and the
step's statistics add the engine's own (:meth:`~megatron_tepo.rollout.engine.RolloutEngine.step_metrics`).

Left out: reward models (the rewards are functions of the final turn's tokens and the answer).
"""
from __future__ import annotations

import random
import time
from dataclasses import dataclass
from typing import Dict, List, NamedTuple, Optional, Sequence

import torch

from megatron_tepo.algorithms import filter_groups
from megatron_tepo.config import RunConfig
from megatron_tepo.rewards import RewardFn
from megatron_tepo.rollout.episode import episode_metrics
from megatron_tepo.trainer.scoring import sandbox_failed, score_samples

__all__ = ["Task", "Generated", "generate_groups", "evaluate", "sync_weights"]


@dataclass
class Task:
    """What to train on: tokenized prompts with answers, a reward, and how responses end."""
    train_prompts: List[List[int]]
    train_answers: List[str]
    reward_fn: RewardFn  # (response token ids per sample, answer per sample) -> rewards (and counts)
    stop_token_ids: Sequence[int]
    pad_token_id: int = 0
    eval_prompts: Optional[List[List[int]]] = None
    eval_answers: Optional[List[str]] = None
    # each prompt's data row, every field (data/prompts.py: PromptRecord.row): what a reward.function and an
    # environment's episodes read; None: the task has none (the reward sees the answers only)
    train_rows: Optional[List[Dict]] = None
    eval_rows: Optional[List[Dict]] = None


class Generated(NamedTuple):
    """One step's rollout: kept prompts, their groups, their rewards (one tensor, group after group),
    the sampling statistics (the reward's counts included), and the weights that generated it
    (``weights_version`` k: the weights step k started from)."""
    prompts: List[List[int]]
    groups: list
    rewards: torch.Tensor
    stats: Dict
    weights_version: int


def generate_groups(engine, task: Task, indices: List[int], cfg: RunConfig, rng: random.Random):
    """Groups for ``prompts_per_step`` prompts, with DAPO dynamic sampling: groups whose rewards
    are all equal are dropped and fresh prompts drawn, for at most ``max_sampling_rounds`` rounds
    (counted). Returns (prompt ids, samples per group, the kept samples' rewards as one tensor in
    group order, stats: the sampling's and the reward's counts over every round)."""
    r = cfg.rollout
    want = r.prompts_per_step
    kept_prompts, kept_groups, kept_rewards = [], [], []  # kept_rewards: one tensor per round
    stats = {"sampling_rounds": 0, "groups_dropped": 0, "groups_generated": 0}
    queue = list(indices)
    while len(kept_prompts) < want and stats["sampling_rounds"] < r.max_sampling_rounds:
        stats["sampling_rounds"] += 1
        need = want - len(kept_prompts)
        batch_idx = [queue.pop(0) if queue else rng.randrange(len(task.train_prompts)) for _ in range(need)]
        prompts = [task.train_prompts[i] for i in batch_idx]
        rows = [task.train_rows[i] for i in batch_idx] if task.train_rows is not None else None
        groups = engine.generate(prompts, n=r.n_samples, temperature=r.temperature, top_p=r.top_p,
                                 max_new_tokens=r.max_new_tokens, stop_token_ids=task.stop_token_ids,
                                 **rows_for(engine, rows))
        answers = [task.train_answers[i] for i in batch_idx for _ in range(r.n_samples)]
        scores, counts = score_samples(task.reward_fn, [s for g in groups for s in g], answers,
                                       [x for x in rows for _ in range(r.n_samples)] if rows is not None else None)
        rewards = torch.tensor(scores, dtype=torch.float32)
        for k, v in counts.items():
            stats[k] = stats.get(k, 0) + v
        stats["groups_generated"] += len(groups)
        keep = filter_groups(rewards, r.n_samples).keep_groups.tolist() if r.dynamic_sampling else [True] * len(groups)
        failed = [sandbox_failed(g) for g in groups]  # (the sandbox's failure: never trained on)
        keep = [k and not f for k, f in zip(keep, failed)]
        if any(failed):
            stats["groups_sandbox_failed"] = stats.get("groups_sandbox_failed", 0) + sum(failed)
        kept = [g for g in range(len(groups)) if keep[g]]  # at most `need`: the round drew that many
        stats["groups_dropped"] += len(groups) - len(kept)
        kept_prompts += [task.train_prompts[batch_idx[g]] for g in kept]
        kept_groups += [groups[g] for g in kept]
        kept_rewards.append(rewards.view(len(groups), r.n_samples)[kept].flatten())
        stats.setdefault("reward_mean_all", float(rewards.mean()))
    return kept_prompts, kept_groups, torch.cat(kept_rewards), stats


def sync_weights(actor, engine) -> float:
    """The actor's weights into the engine (its update flushes its cache); returns seconds.
    Collective: the export gathers over the actor's groups, so every rank calls it; ranks other
    than the driver pass a :class:`FollowerEngine`."""
    t = time.time()
    engine.update_weights(actor.export_hf_state())
    return time.time() - t


def rows_for(engine, rows: Optional[List[Dict]]) -> Dict:
    """``generate``'s ``rows`` argument for an engine that takes them (an episode engine: its
    environment opens each episode from its row); none for the others."""
    return {"rows": rows} if rows is not None and getattr(engine, "takes_rows", False) else {}


def evaluate(engine, prompts, answers, reward_fn: RewardFn, stop_token_ids, *, n: int = 1,
             temperature: float = 1e-5, top_p: float = 1.0, max_new_tokens: int = 16,
             rows: Optional[List[Dict]] = None) -> Dict[str, float]:
    """avg@n (mean reward) and pass@n (any sample correct) over held-out prompts, the reward's
    counts when it gives them (:data:`~megatron_tepo.rewards.COUNT_NAMES`), and with an environment
    the episodes' counts (:func:`~megatron_tepo.rollout.episode.episode_metrics`: tool calls, errors,
    turns)."""
    groups = engine.generate(prompts, n=n, temperature=temperature, top_p=top_p, max_new_tokens=max_new_tokens,
                             stop_token_ids=stop_token_ids, **rows_for(engine, rows))
    samples = [s for g in groups for s in g]
    scores, counts = score_samples(reward_fn, samples, [a for a in answers for _ in range(n)],
                                   [x for x in rows for _ in range(n)] if rows is not None else None)
    rewards = torch.tensor(scores).view(len(prompts), n)
    return {f"avg@{n}": float(rewards.mean()), f"pass@{n}": float((rewards.max(1).values > 0).float().mean()),
            **counts, **episode_metrics(samples)}
