"""One step's rollout (``generate_groups``): the kept samples' rewards come back as one tensor in
group order, and the reward's counts travel in the step's stats, summed over sampling rounds."""
import random

import pytest
import torch

from megatron_tepo.config import from_dict
from megatron_tepo.rewards import RewardBatchResult
from megatron_tepo.rollout.engine import RolloutEngine, Sample
from megatron_tepo.trainer.loop import Task, evaluate, generate_groups


class EchoEngine(RolloutEngine):
    """Every sample of prompt ``[p]`` is the response ``[p, j]`` (j: the sample's index)."""

    def generate(self, prompts, n=1, temperature=1.0, top_p=1.0, max_new_tokens=128, stop_token_ids=()):
        return [[Sample([p[0], j], [0.0, 0.0], "stop") for j in range(n)] for p in prompts]

    def update_weights(self, named_tensors):
        raise NotImplementedError


def counted(responses, answers):
    """Prompts 0 and 1: every sample right (a group with equal rewards, dropped by dynamic sampling);
    the others: sample 0 right; each wrong sample counted as having no answer."""
    rewards = [1.0 if r[0] < 2 or r[1] == 0 else 0.0 for r in responses]
    return RewardBatchResult(rewards, num_no_answer=rewards.count(0.0), num_timeouts=1)


def test_rewards_are_one_tensor_and_counts_join_the_stats():
    cfg = from_dict({"rollout": {"prompts_per_step": 3, "n_samples": 2, "max_sampling_rounds": 3},
                     "train": {"mini_batch_prompts": 1}})
    task = Task([[i] for i in range(6)], [""] * 6, counted, [])
    prompts, groups, rewards, stats = generate_groups(EchoEngine(), task, [0, 2, 1, 3], cfg, random.Random(0))
    # round 1 drew prompts 0, 2, 1 (0 and 1 dropped), round 2 prompts 3 and a random one
    assert [p[0] for p in prompts][:2] == [2, 3] and len(prompts) == 3 and len(groups) == 3
    assert isinstance(rewards, torch.Tensor) and rewards.tolist() == [1.0, 0.0] * 3
    assert stats["sampling_rounds"] == 2 and stats["groups_dropped"] == 2 and stats["groups_generated"] == 5
    assert stats["reward_no_answer"] == 3 and stats["reward_timeouts"] == 2 and stats["reward_errors"] == 0


def test_a_reward_of_plain_lists_adds_no_counts():
    cfg = from_dict({"rollout": {"prompts_per_step": 2, "n_samples": 2, "dynamic_sampling": False},
                     "train": {"mini_batch_prompts": 1}})
    task = Task([[i] for i in range(4)], [""] * 4, lambda rs, ans: [float(r[1]) for r in rs], [])
    _, _, rewards, stats = generate_groups(EchoEngine(), task, [0, 1], cfg, random.Random(0))
    assert rewards.tolist() == [0.0, 1.0, 0.0, 1.0] and not any(k.startswith("reward_") and k != "reward_mean_all"
                                                                 for k in stats)


def test_evaluate_reports_the_reward_counts():
    out = evaluate(EchoEngine(), [[2], [3]], ["", ""], counted, [], n=2)
    assert out == {"avg@2": pytest.approx(0.5), "pass@2": 1.0, "reward_timeouts": 1, "reward_errors": 0,
                   "reward_no_answer": 2}


def test_rows_reach_the_episode_engine_and_the_reward_and_a_sandbox_failure_drops_its_group():
    """#58: the task's rows go to an engine that takes them (an episode engine opens its episodes from
    them) and to a reward that takes them; the environment's reward replaces the task's; a group with
    an episode ended by a sandbox failure is not trained on (counted)."""
    seen = {}

    class Rows(EchoEngine):
        takes_rows = True

        def generate(self, prompts, n=1, temperature=1.0, top_p=1.0, max_new_tokens=128, stop_token_ids=(),
                     rows=None):
            seen["engine"] = rows
            end = {0: "sandbox_failure", 1: "answered", 2: "answered"}
            return [[Sample([p[0], j], [0.0, 0.0], "stop", meta={"episode": {
                "end": end[p[0]], "env": {"reward": 1.0} if p[0] == 2 and j == 0 else {}}}) for j in range(n)]
                    for p in prompts]

    def reward(responses, answers, rows=None, episodes=None):
        seen["reward"] = (rows, episodes)
        return [0.0 if r[1] else 0.5 for r in responses]
    reward.takes_rows = True

    cfg = from_dict({"rollout": {"prompts_per_step": 3, "n_samples": 2, "max_sampling_rounds": 1},
                     "train": {"mini_batch_prompts": 1}})
    rows = [{"id": i} for i in range(3)]
    task = Task([[i] for i in range(3)], [""] * 3, reward, [], train_rows=rows)
    prompts, groups, rewards, stats = generate_groups(Rows(), task, [0, 1, 2], cfg, random.Random(0))
    assert seen["engine"] == rows
    # (0: the sandbox failed, not scored; 2, 0: the environment's reward)
    assert seen["reward"][0] == [{"id": 1}, {"id": 1}, {"id": 2}]
    assert [p[0] for p in prompts] == [1, 2] and rewards.tolist() == [0.5, 0.0, 1.0, 0.0]
    assert stats["groups_sandbox_failed"] == 1 and stats["groups_dropped"] == 1
