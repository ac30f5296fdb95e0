"""A step's rollout on the driver, besides its groups: the held-out evaluation and the weight sync
into the engine.

* :func:`evaluate` -- avg@n and pass@n over held-out prompts (each episode opened from its data row
  where the task keeps rows); :func:`sync_weights` -- the actor's weights into the engine (collective;
  with ``actor.lora.sync: adapters`` its LoRA adapters, ``MegatronActor.export_adapters``).
* The task and the groups a step trains on (:class:`Task`, :class:`Generated`,
  :func:`generate_groups`) are the group producer's (:mod:`megatron_tepo.trainer.groups`), named
  here too.

Left out: reward models (the rewards are functions of the final turn, the answer and the row, or the
environment's: :mod:`megatron_tepo.trainer.scoring`).
"""
from __future__ import annotations

import time
from typing import Dict, List, Optional

import torch

from megatron_tepo.rewards import RewardFn
from megatron_tepo.rollout.episode import episode_metrics
from megatron_tepo.trainer.groups import Generated, Task, generate_groups, rows_for
from megatron_tepo.trainer.scoring import score_samples

__all__ = ["Task", "Generated", "generate_groups", "evaluate", "sync_weights"]


def sync_weights(actor, engine) -> float:
    """The actor's weights into the engine (its update flushes its cache); returns seconds.
    Collective: the export gathers over the actor's groups, so every rank calls it; ranks other
    than the driver pass a :class:`FollowerEngine`."""
    t = time.time()
    engine.update_weights(actor.export_adapters() if lora_adapters_sync(actor) else actor.export_hf_state())
    return time.time() - t


def _lora_of(actor):
    """The actor's ``actor.lora`` settings, None without LoRA (or for a policy without settings)."""
    return getattr(getattr(actor, "settings", None), "lora", None)


def lora_adapters_sync(actor) -> bool:
    """Whether the policy reaches the engine as LoRA adapters (``actor.lora.sync: adapters``)."""
    lora = _lora_of(actor)
    return lora is not None and lora.sync == "adapters"


def starts_from_adapter(actor) -> bool:
    """Whether a fresh run's policy is not the engine's base model: it starts from a PEFT adapter
    (``actor.lora.init_from``), so the engine needs a sync before the first generation."""
    lora = _lora_of(actor)
    return lora is not None and bool(lora.init_from)


def evaluate(engine, prompts, answers, reward_fn: RewardFn, stop_token_ids, *, n: int = 1,
             temperature: float = 1e-5, top_p: float = 1.0, max_new_tokens: int = 16,
             rows: Optional[List[Dict]] = None) -> Dict[str, float]:
    """avg@n (mean reward) and pass@n (any sample correct) over held-out prompts, the reward's
    counts when it gives them (:data:`~megatron_tepo.rewards.COUNT_NAMES`), and with an environment
    the episodes' counts (:func:`~megatron_tepo.rollout.episode.episode_metrics`: tool calls, errors,
    turns). ``rows``: each prompt's data row (the reward and the episodes read them)."""
    groups = engine.generate(prompts, n=n, temperature=temperature, top_p=top_p, max_new_tokens=max_new_tokens,
                             stop_token_ids=stop_token_ids, **rows_for(engine, rows))
    samples = [s for g in groups for s in g]
    scores, counts = score_samples(reward_fn, samples, [a for a in answers for _ in range(n)],
                                   [x for x in rows for _ in range(n)] if rows is not None else None)
    rewards = torch.tensor(scores).view(len(prompts), n)
    return {f"avg@{n}": float(rewards.mean()), f"pass@{n}": float((rewards.max(1).values > 0).float().mean()),
            **counts, **episode_metrics(samples)}
