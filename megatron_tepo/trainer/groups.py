"""The one group producer of every schedule: the prompts a run draws, how it samples them, how a
group is scored and judged, and what a step's rollout reports.

* :class:`Task` -- tokenized prompts with answers (and, per prompt, an optional data row: every
  field of it), the reward, how responses end.
* :class:`PromptStream` -- the prompts' order and its RNG, one per run (the run state saves it in
  each checkpoint: :mod:`megatron_tepo.trainer.run_state`).
* :class:`GroupProducer` -- built once per run from the task and the config: the sampling
  parameters (:attr:`GroupProducer.params`), the reward and DAPO's dynamic-sampling verdict on
  groups (:meth:`GroupProducer.judge`, the one place the filter is applied), a step's groups
  generated now in rounds (:meth:`GroupProducer.step`, :meth:`GroupProducer.rounds`) and the step's
  rollout with its statistics merged once (:meth:`GroupProducer.generated`).
* :class:`Generated` -- what one step's rollout hands on.

The schedules (:mod:`megatron_tepo.trainer.sources`) differ only in when they ask it for groups:
the synchronous one and one step off call :meth:`GroupProducer.step` (now, or in the background
while the previous step trains); partial rollout's buffer (:mod:`megatron_tepo.trainer.partial`)
draws one prompt at a time (:meth:`PromptStream.next`), submits its group with the same
parameters, judges each group as it completes and hands a step its groups through the same
:meth:`GroupProducer.generated`.

The stream is read in two ways. A step at a time (synchronous, one step off): each step a new pass
over the shuffled prompts and its first ``prompts_per_step``; a group dropped by dynamic sampling is
replaced by a prompt drawn at random. A prompt at a time (partial rollout): the pass is read to its
end, then a new one starts. Both are the draws the two schedules made before they shared a producer,
so a run's prompts, and its metrics, stay what they were.

A prompt's data row (:attr:`Task.train_rows`) travels with its group: to the engine (an episode
engine opens each episode from it: :attr:`~megatron_tepo.rollout.engine.RolloutEngine.takes_rows`),
to the reward (:func:`~megatron_tepo.trainer.scoring.score_samples`: a ``reward.function`` reads it)
and into the step's rollout (:attr:`Generated.records`, one per group).

A multi-turn engine (:class:`~megatron_tepo.rollout.episode.EpisodeEngine`) returns whole episodes:
the environment's reward is an episode's where it gives one, else the task's reward reads its final
turn (:func:`~megatron_tepo.rollout.episode.final_turn`); a group with an episode ended by a sandbox
failure is never trained on (``groups_sandbox_failed``); the step's statistics add the engine's own
(:meth:`~megatron_tepo.rollout.engine.RolloutEngine.step_metrics`,
:meth:`~megatron_tepo.rollout.engine.RolloutEngine.health_metrics`).

Left out: reward models, the schedules' timing (:mod:`.sources`) and the partial buffer's requests
(:mod:`.partial`).
"""
from __future__ import annotations

import dataclasses
import random
from dataclasses import dataclass
from typing import Any, Dict, List, NamedTuple, Optional, Sequence, Tuple

import torch

from megatron_tepo.algorithms import filter_groups
from megatron_tepo.config import RunConfig
from megatron_tepo.rewards import RewardFn
from megatron_tepo.rollout.engine import RolloutEngine, SamplingParams
from megatron_tepo.trainer.scoring import sandbox_failed, score_samples

__all__ = ["Task", "Generated", "PromptStream", "GroupProducer", "generate_groups", "add_counts", "rows_for"]


@dataclass
class Task:
    """What to train on: tokenized prompts with answers, a reward, and how responses end.
    ``train_rows`` / ``eval_rows``: one per prompt, the data row, every field
    (:class:`~megatron_tepo.data.prompts.PromptRecord`'s ``row``; None: none kept): what a
    ``reward.function`` and an environment's episodes read."""
    train_prompts: List[List[int]]
    train_answers: List[str]
    reward_fn: RewardFn  # (response token ids per sample, answer per sample) -> rewards (and counts)
    stop_token_ids: Sequence[int]
    pad_token_id: int = 0
    eval_prompts: Optional[List[List[int]]] = None
    eval_answers: Optional[List[str]] = None
    train_rows: Optional[List[Dict[str, Any]]] = None
    eval_rows: Optional[List[Dict[str, Any]]] = None

    def __post_init__(self):
        if self.train_rows is not None and len(self.train_rows) != len(self.train_prompts):
            raise ValueError(f"Task.train_rows: {len(self.train_rows)} rows for "
                             f"{len(self.train_prompts)} prompts (one per prompt)")

    def record(self, index: int) -> Optional[Dict[str, Any]]:
        """Training prompt ``index``'s data row (None without rows)."""
        return None if self.train_rows is None else self.train_rows[index]

    def rows(self, indices: List[int]) -> Optional[List[Dict[str, Any]]]:
        """The data rows of the training prompts ``indices`` (None without rows)."""
        return None if self.train_rows is None else [self.train_rows[i] for i in indices]

    def score(self, samples: list, indices: List[int]):
        """(rewards, the reward's counts) of ``samples``; ``indices``: each sample's prompt, whose
        answer and row go with it (:func:`~megatron_tepo.trainer.scoring.score_samples`)."""
        return score_samples(self.reward_fn, samples, [self.train_answers[i] for i in indices], self.rows(indices))


class Generated(NamedTuple):
    """One step's rollout: kept prompts, their groups, their rewards (one tensor, group after group),
    the sampling statistics (the reward's counts and the engine's metrics included), the weights
    that generated it (``weights_version`` k: the weights step k started from), and each group's
    prompt record (None where the task keeps none)."""
    prompts: List[List[int]]
    groups: list
    rewards: torch.Tensor
    stats: Dict
    weights_version: int
    records: Optional[List[Optional[Dict[str, Any]]]] = None


def _rng_state(rng: random.Random) -> list:
    version, internal, gauss = rng.getstate()
    return [version, list(internal), gauss]


class PromptStream:
    """The order a run draws its training prompts in and the RNG that shuffles it (see the module
    docstring for its two readings). ``cursor``: where the current pass stands (a new stream starts
    a pass at its first draw)."""

    def __init__(self, n_prompts: int, rng: random.Random):
        self.rng, self.order, self.cursor = rng, list(range(n_prompts)), n_prompts

    @classmethod
    def seeded(cls, n_prompts: int, seed: int) -> "PromptStream":
        return cls(n_prompts, random.Random(seed))

    def step_prompts(self, want: int) -> List[int]:
        """A step's first prompts: a new pass, its first ``want`` (all of them when fewer)."""
        self.rng.shuffle(self.order)
        first = self.order[:want]
        self.cursor = len(first)
        return first

    def any(self) -> int:
        """A prompt drawn at random (in place of a group dynamic sampling dropped)."""
        return self.rng.randrange(len(self.order))

    def next(self) -> int:
        """The pass's next prompt (a new pass once it is read to its end)."""
        if self.cursor >= len(self.order):
            self.rng.shuffle(self.order)
            self.cursor = 0
        self.cursor += 1
        return self.order[self.cursor - 1]

    def state(self) -> Dict:
        """JSON: the RNG's state, the order and the cursor."""
        return {"rng": _rng_state(self.rng), "order": list(self.order), "cursor": self.cursor}

    def restore(self, state: Dict) -> None:
        """:meth:`state` read back (one saved without a cursor: a pass read to its end)."""
        version, internal, gauss = state["rng"]
        self.rng.setstate((version, tuple(internal), gauss))
        self.order[:] = state["order"]
        self.cursor = int(state.get("cursor", len(self.order)))


def add_counts(stats: Dict, counts: Dict) -> None:
    """The reward's counts (or any other counts) added into ``stats``."""
    for k, v in counts.items():
        stats[k] = stats.get(k, 0) + v


class GroupProducer:
    """A run's groups (see the module docstring): ``task``, the run config's ``rollout`` section, and
    the prompt ``stream`` (default: a new one seeded with ``train.seed``)."""

    def __init__(self, task: Task, cfg: RunConfig, stream: Optional[PromptStream] = None):
        r = cfg.rollout
        self.task, self.cfg, self.n, self.want = task, cfg, r.n_samples, r.prompts_per_step
        self.max_rounds, self.dynamic_sampling = r.max_sampling_rounds, r.dynamic_sampling
        self.params = SamplingParams(n=r.n_samples, temperature=r.temperature, top_p=r.top_p,
                                     max_new_tokens=r.max_new_tokens, stop_token_ids=task.stop_token_ids)
        self.stream = stream if stream is not None else PromptStream.seeded(len(task.train_prompts), cfg.train.seed)

    def judge(self, indices: List[int], groups: list) -> Tuple[torch.Tensor, Dict, List[bool]]:
        """The groups of the prompts ``indices`` (in order), scored: the rewards (one tensor, group
        after group), the reward's counts, and which groups to keep (dynamic sampling drops those
        whose rewards are all equal: the one place it is applied; a group with an episode ended by a
        sandbox failure is never kept, counted in ``groups_sandbox_failed``)."""
        scores, counts = self.task.score([s for g in groups for s in g], [i for i in indices for _ in range(self.n)])
        rewards = torch.tensor(scores, dtype=torch.float32)
        keep = filter_groups(rewards, self.n).keep_groups.tolist() if self.dynamic_sampling else [True] * len(groups)
        failed = [sandbox_failed(g) for g in groups]  # (the sandbox's failure, not the model's: never trained on)
        if any(failed):
            counts = {**counts, "groups_sandbox_failed": counts.get("groups_sandbox_failed", 0) + sum(failed)}
            keep = [k and not f for k, f in zip(keep, failed)]
        return rewards, counts, keep

    def rounds(self, engine: RolloutEngine, first: List[int]) -> Tuple[List[int], list, torch.Tensor, Dict]:
        """Groups for ``prompts_per_step`` prompts, the prompts ``first`` first, with DAPO dynamic
        sampling: groups whose rewards are all equal are dropped and prompts drawn at random in their
        place, for at most ``max_sampling_rounds`` rounds (counted). Returns (the kept prompts'
        indices, their samples per group, their rewards as one tensor in group order, stats: the
        sampling's and the reward's counts over every round)."""
        kept_idx, kept_groups, kept_rewards = [], [], []  # kept_rewards: one tensor per round
        stats = {"sampling_rounds": 0, "groups_dropped": 0, "groups_generated": 0}
        queue, p = list(first), self.params
        while len(kept_idx) < self.want and stats["sampling_rounds"] < self.max_rounds:
            stats["sampling_rounds"] += 1
            need = self.want - len(kept_idx)
            batch_idx = [queue.pop(0) if queue else self.stream.any() for _ in range(need)]
            groups = engine.generate([self.task.train_prompts[i] for i in batch_idx], n=p.n,
                                     temperature=p.temperature, top_p=p.top_p, max_new_tokens=p.max_new_tokens,
                                     stop_token_ids=p.stop_token_ids, **rows_for(engine, self.task.rows(batch_idx)))
            rewards, counts, keep = self.judge(batch_idx, groups)
            add_counts(stats, counts)
            stats["groups_generated"] += len(groups)
            kept = [g for g in range(len(groups)) if keep[g]]  # at most `need`: the round drew that many
            stats["groups_dropped"] += len(groups) - len(kept)
            kept_idx += [batch_idx[g] for g in kept]
            kept_groups += [groups[g] for g in kept]
            kept_rewards.append(rewards.view(len(groups), self.n)[kept].flatten())
            stats.setdefault("reward_mean_all", float(rewards.mean()))
        return kept_idx, kept_groups, torch.cat(kept_rewards), stats

    def step(self, engine: RolloutEngine, version: int) -> Generated:
        """A step's rollout generated now with the weights ``version``: the stream's next step
        (:meth:`PromptStream.step_prompts`) in :meth:`rounds`."""
        indices, groups, rewards, stats = self.rounds(engine, self.stream.step_prompts(self.want))
        return self.generated(engine, indices, groups, rewards, stats, version)

    def generated(self, engine: RolloutEngine, indices: List[int], groups: list, rewards: torch.Tensor, stats: Dict,
                  version: int) -> Generated:
        """The step's rollout of the groups of the prompts ``indices``: its statistics with the
        engine's (the episodes' counts, the fleet's health since the last step) and each group's
        record."""
        prompts = [self.task.train_prompts[i] for i in indices]
        stats = {**stats, **engine.step_metrics(prompts, groups), **engine.health_metrics()}
        return Generated(prompts, groups, rewards, stats, version, [self.task.record(i) for i in indices])

    def partial_params(self) -> SamplingParams:
        """The parameters of one request of a group (:meth:`~megatron_tepo.rollout.engine.RolloutEngine.submit`:
        one sample each)."""
        return dataclasses.replace(self.params, n=1)


def generate_groups(engine: RolloutEngine, task: Task, indices: List[int], cfg: RunConfig, rng: random.Random):
    """:meth:`GroupProducer.rounds` with the prompts ``indices`` first and ``rng`` drawing the others;
    the kept prompts' token ids in place of their indices: (prompt ids, samples per group, rewards,
    stats)."""
    idx, groups, rewards, stats = GroupProducer(task, cfg, PromptStream(len(task.train_prompts), rng)).rounds(
        engine, indices)
    return [task.train_prompts[i] for i in idx], groups, rewards, stats


def rows_for(engine: RolloutEngine, rows: Optional[List[Dict[str, Any]]]) -> Dict:
    """``generate``'s ``rows`` argument for an engine that takes them (an episode engine: its
    environment opens each episode from its row); none for the others."""
    return {"rows": rows} if rows is not None and engine.takes_rows else {}
