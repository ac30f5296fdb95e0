"""Group advantages, DAPO dynamic sampling filter, GPG correction."""
import math

import pytest
import torch

from megatron_tepo.algorithms import (
    GroupFilterResult,
    broadcast_to_tokens,
    compute_group_advantages,
    filter_groups,
    gpg_correction,
)


def test_grpo_advantage_hand_values_unbiased_std():
    rewards = torch.tensor([1.0, 0.0, 0.0, 1.0, 3.0, 1.0, 2.0, 2.0])
    adv = compute_group_advantages(rewards, group_size=4)
    # group 1: mean 0.5, unbiased std sqrt(4 * 0.25 / 3)
    s1 = math.sqrt(1.0 / 3.0)
    # group 2: mean 2, unbiased std sqrt((1 + 1 + 0 + 0) / 3)
    s2 = math.sqrt(2.0 / 3.0)
    expected = [0.5 / (s1 + 1e-6), -0.5 / (s1 + 1e-6), -0.5 / (s1 + 1e-6), 0.5 / (s1 + 1e-6),
                1.0 / (s2 + 1e-6), -1.0 / (s2 + 1e-6), 0.0, 0.0]
    assert adv.shape == (8,)
    assert adv.dtype == torch.float32
    torch.testing.assert_close(adv, torch.tensor(expected), rtol=1e-6, atol=1e-6)


def test_eps_is_added_to_std():
    adv = compute_group_advantages(torch.tensor([0.0, 2.0]), 2, eps=1.0)
    s = math.sqrt(2.0)  # unbiased std of (0, 2)
    torch.testing.assert_close(adv, torch.tensor([-1.0 / (s + 1.0), 1.0 / (s + 1.0)]))


def test_dr_grpo_no_std():
    adv = compute_group_advantages(torch.tensor([1.0, 0.0, 0.0, 5.0, 1.0, 3.0]), 3, std_normalize=False)
    torch.testing.assert_close(adv, torch.tensor([2.0 / 3, -1.0 / 3, -1.0 / 3, 2.0, -2.0, 0.0]))


@pytest.mark.parametrize("std_normalize", [True, False])
def test_equal_reward_groups_are_exactly_zero(std_normalize):
    # 0.1 is not exactly representable: r - mean could leave a rounding residue.
    rewards = torch.tensor([0.1, 0.1, 0.1, 0.7, 0.7, 0.7, 0.3, 0.9, 0.3])
    adv = compute_group_advantages(rewards, 3, std_normalize=std_normalize)
    assert torch.equal(adv[:6], torch.zeros(6))
    assert (adv[6:] != 0).all()
    assert torch.isfinite(adv).all()


def test_group_size_one_gives_zero_not_nan():
    adv = compute_group_advantages(torch.tensor([1.0, 0.0, 5.0]), 1)
    assert torch.equal(adv, torch.zeros(3))


def test_float64_kept_and_int_rewards_accepted():
    assert compute_group_advantages(torch.tensor([0.0, 1.0], dtype=torch.float64), 2).dtype == torch.float64
    adv = compute_group_advantages(torch.tensor([0, 1, 1, 1]), 2)
    assert adv.dtype == torch.float32 and torch.equal(adv[2:], torch.zeros(2))


@pytest.mark.parametrize(
    "rewards,group_size,word",
    [
        (torch.zeros(5), 2, "group_size"),
        (torch.zeros(4), 0, "group_size"),
        (torch.zeros(2, 2), 2, "rewards"),
        (torch.tensor([0.0, float("nan")]), 2, "rewards"),
    ],
)
def test_advantage_errors_name_the_argument(rewards, group_size, word):
    with pytest.raises(ValueError, match=word):
        compute_group_advantages(rewards, group_size)


def test_broadcast_to_tokens_zero_on_padding():
    mask = torch.tensor([[1, 1, 0], [0, 0, 0], [1, 0, 1]])
    out = broadcast_to_tokens(torch.tensor([2.0, -1.0, 0.5]), mask)
    assert torch.equal(out, torch.tensor([[2.0, 2.0, 0.0], [0.0, 0.0, 0.0], [0.5, 0.0, 0.5]]))
    with pytest.raises(ValueError, match="response_mask"):
        broadcast_to_tokens(torch.zeros(2), mask)


def test_filter_groups_drops_all_equal_groups():
    rewards = torch.tensor([1.0, 1.0, 0.0, 1.0, 0.0, 0.0, 1.0, 0.0])
    res = filter_groups(rewards, 2)
    assert isinstance(res, GroupFilterResult)
    assert res.keep_groups.tolist() == [False, True, False, True]
    assert res.keep_responses.tolist() == [False, False, True, True, False, False, True, True]
    assert res.num_dropped == 2 and res.num_groups == 4


def test_gpg_correction():
    # B = 4 groups, M = 1 with zero spread -> 4/3
    rewards = torch.tensor([1.0, 1.0, 0.0, 1.0, 1.0, 0.0, 0.0, 1.0])
    assert gpg_correction(rewards, 2) == pytest.approx(4.0 / 3.0)
    assert gpg_correction(torch.tensor([0.0, 1.0, 1.0, 0.0]), 2) == 1.0
    assert gpg_correction(torch.tensor([1.0, 1.0, 0.0, 0.0]), 2) == 1.0  # B == M: 1.0, not inf
