"""The main job's synchronous RL loop written out plainly, as the reference that ``train()`` is
checked against on the same machine (tests/trainer/test_loop.py::test_main_job_short_run).

It builds what ``examples/tiny_tepo/run.py`` builds (the same config and overrides, seed, warm-up,
task, actor and embedded engine, the same held-out evaluation before training, which draws from
the engine's sampling RNG) and then runs the textbook step, with none of the loop's own code
(``megatron_tepo.trainer``'s ``train``, ``Run``, ``Step`` and phases, ``RunState``, the group
producer of ``trainer/groups.py``, checkpoints):
shuffle the prompt order, generate and score with dynamic sampling, group advantages, the batch,
the actor's old log-probs and the drift against the engine's, one optimizer step per mini-batch,
the weight sync. It writes one JSON line of metrics per step (the keys the loop logs that do not
depend on timing), to compare with the loop's ``metrics.jsonl``.

Left out: checkpoints, evaluation during training, one-step-off generation, colocated mode,
several processes (the comparison runs the main job's one-process setup).

    python tests/trainer/reference_loop_worker.py OUT.jsonl [--eval-size N] [override ...]
"""
from __future__ import annotations

import argparse
import json
import math
import os
import random
import sys
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")
REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "examples/tiny_tepo"))

import torch  # noqa: E402

import addition  # noqa: E402 -- the main job's task


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("out")
    ap.add_argument("--eval-size", type=int, default=200)
    ap.add_argument("overrides", nargs="*")
    args = ap.parse_args(argv)

    from megatron_tepo.algorithms import PolicyLoss, compute_group_advantages
    from megatron_tepo.algorithms.drift import DriftCheck
    from megatron_tepo.batch import RolloutBatch
    from megatron_tepo.config import load_config
    from megatron_tepo.trainer.main import build_actor_and_engine
    from megatron_tepo.trainer.rollouts import Task, evaluate

    cfg = load_config([REPO / "examples/tiny_tepo/config.yaml"], args.overrides)
    assert not cfg.rollout.max_staleness and not cfg.rollout.colocated and not cfg.advantage.gpg_correction
    assert cfg.algorithm.old_log_prob != "rollout" and not 0 < cfg.train.eval_every <= cfg.train.steps
    torch.manual_seed(cfg.train.seed)
    sft_dir = addition.warm_up(REPO / ".cache" / "tiny_tepo")
    actor, engine = build_actor_and_engine(cfg, str(sft_dir), addition.PAD)
    train_items, eval_items = addition.problems(5000, seed=1), addition.problems(args.eval_size, seed=2)
    task = Task([p for p, _ in train_items], [a for _, a in train_items], addition.reward_fn,
                stop_token_ids=[addition.EOS], pad_token_id=addition.PAD)
    # run.py's accuracy before training: it samples (near-greedy) from the engine's RNG
    evaluate(engine, [p for p, _ in eval_items], [a for _, a in eval_items], addition.reward_fn, [addition.EOS],
             max_new_tokens=cfg.rollout.max_new_tokens)

    loss = PolicyLoss.from_config(cfg.algorithm)
    drift = DriftCheck(mean_threshold=cfg.rollout.drift_warn_mean, max_threshold=cfg.rollout.drift_warn_max,
                       prefix="drift")
    rng, order = random.Random(cfg.train.seed), list(range(len(task.train_prompts)))
    r, rows_per_update = cfg.rollout, cfg.train.mini_batch_prompts * cfg.rollout.n_samples
    with open(args.out, "w") as f:
        for step in range(1, cfg.train.steps + 1):
            rng.shuffle(order)
            prompts, groups, rewards, stats = _dapo_rounds(engine, task, order[:r.prompts_per_step], cfg, rng)
            assert prompts, f"step {step}: every group dropped (the comparison needs updates)"
            adv = compute_group_advantages(rewards, r.n_samples, std_normalize=cfg.advantage.std_normalize,
                                           eps=cfg.advantage.eps)
            batch = RolloutBatch.from_groups(prompts, groups, task.pad_token_id, advantages=adv,
                                             temperature=r.temperature)
            batch.old_log_probs, batch.old_entropy = actor.compute_log_probs(batch)
            metrics = drift(batch.rollout_log_probs, batch.old_log_probs, batch.response_mask, warn=False)
            updates = []
            for _ in range(cfg.train.epochs_per_step):
                for first in range(0, batch.batch_size, rows_per_update):
                    mb = batch.select(range(first, min(first + rows_per_update, batch.batch_size)))
                    u = actor.forward_backward(mb, loss)
                    assert math.isfinite(u["loss"]), (step, u)
                    updates.append({**u, **actor.optimizer_step()})
            engine.update_weights(actor.export_hf_state())
            metrics.update({k: sum(u[k] for u in updates) / len(updates) for k in updates[0]
                            if isinstance(updates[0][k], float)})
            metrics.update(stats, step=step, updates=float(len(updates)), reward_mean=float(rewards.mean()),
                           response_length_mean=float(batch.response_mask.sum(1).mean()))
            f.write(json.dumps(metrics) + "\n")
    import torch.distributed as dist

    if dist.is_initialized():
        dist.destroy_process_group()


def _dapo_rounds(engine, task, indices, cfg, rng):
    """A step's groups with DAPO dynamic sampling, written out: generate ``prompts_per_step`` groups
    (``indices`` first, then prompts drawn with ``rng``), drop those whose rewards are all equal and
    draw again, for at most ``max_sampling_rounds`` rounds."""
    from megatron_tepo.algorithms import filter_groups
    from megatron_tepo.rewards import scores_and_counts
    from megatron_tepo.rollout.episode import final_turn

    r = cfg.rollout
    kept_prompts, kept_groups, kept_rewards = [], [], []
    stats = {"sampling_rounds": 0, "groups_dropped": 0, "groups_generated": 0}
    queue = list(indices)
    while len(kept_prompts) < r.prompts_per_step and stats["sampling_rounds"] < r.max_sampling_rounds:
        stats["sampling_rounds"] += 1
        batch_idx = [queue.pop(0) if queue else rng.randrange(len(task.train_prompts))
                     for _ in range(r.prompts_per_step - len(kept_prompts))]
        groups = engine.generate([task.train_prompts[i] for i in batch_idx], n=r.n_samples, temperature=r.temperature,
                                 top_p=r.top_p, max_new_tokens=r.max_new_tokens, stop_token_ids=task.stop_token_ids)
        scores, counts = scores_and_counts(task.reward_fn([final_turn(s) for g in groups for s in g],
                                                          [task.train_answers[i] for i in batch_idx
                                                           for _ in range(r.n_samples)]))
        rewards = torch.tensor(scores, dtype=torch.float32)
        for k, v in counts.items():
            stats[k] = stats.get(k, 0) + v
        stats["groups_generated"] += len(groups)
        keep = filter_groups(rewards, r.n_samples).keep_groups.tolist() if r.dynamic_sampling else [True] * len(groups)
        kept = [g for g in range(len(groups)) if keep[g]]
        stats["groups_dropped"] += len(groups) - len(kept)
        kept_prompts += [task.train_prompts[batch_idx[g]] for g in kept]
        kept_groups += [groups[g] for g in kept]
        kept_rewards.append(rewards.view(len(groups), r.n_samples)[kept].flatten())
        stats.setdefault("reward_mean_all", float(rewards.mean()))
    return kept_prompts, kept_groups, torch.cat(kept_rewards), stats


if __name__ == "__main__":
    main()
