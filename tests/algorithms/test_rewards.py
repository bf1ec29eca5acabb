"""Group reward normalisation and the per-estimator normalisation table."""

import math

import pytest
import torch

from slime.algorithms.rewards import (
    GroupNormalization,
    custom_rewards,
    group_normalization_for,
    normalize_group_rewards,
)

# Two groups of 3: [1, 0, 0] and [2, 2, 2].
REWARDS = torch.tensor([1.0, 0.0, 0.0, 2.0, 2.0, 2.0])
INV_SQRT3 = 1 / math.sqrt(3)


def test_mean_and_std():
    # group 1: mean 1/3 -> [2/3, -1/3, -1/3]; unbiased var = (4/9 + 1/9 + 1/9) / 2 = 1/3, std = 1/sqrt(3)
    #          -> [2/sqrt(3), -1/sqrt(3), -1/sqrt(3)] = [1.1547005, -0.5773503, -0.5773503]
    # group 2: all equal -> centred to 0, std 0 -> 0 / 1e-6 = 0
    expected = torch.tensor([2 * INV_SQRT3, -INV_SQRT3, -INV_SQRT3, 0.0, 0.0, 0.0])
    torch.testing.assert_close(normalize_group_rewards(REWARDS, 3), expected, rtol=1e-5, atol=1e-5)


def test_mean_only():
    expected = torch.tensor([2 / 3, -1 / 3, -1 / 3, 0.0, 0.0, 0.0])
    torch.testing.assert_close(normalize_group_rewards(REWARDS, 3, divide_std=False), expected)


def test_eps_is_added_to_the_std():
    # [1, 0]: centred [0.5, -0.5], unbiased std = sqrt(0.5) = 0.7071068; eps = 0.2 -> 0.5 / 0.9071068
    out = normalize_group_rewards(torch.tensor([1.0, 0.0]), 2, eps=0.2)
    torch.testing.assert_close(out, torch.tensor([0.5512089, -0.5512089]))


def test_nothing_when_both_off():
    out = normalize_group_rewards(REWARDS, 3, subtract_mean=False, divide_std=False)
    torch.testing.assert_close(out, REWARDS)


def test_groups_get_zero_mean_unit_std():
    rewards = torch.randn(4 * 5, generator=torch.Generator().manual_seed(0)) * 3 + 7
    grouped = normalize_group_rewards(rewards, 5).reshape(4, 5)
    torch.testing.assert_close(grouped.mean(dim=1), torch.zeros(4), atol=1e-6, rtol=0)
    torch.testing.assert_close(grouped.std(dim=1), torch.ones(4), atol=1e-5, rtol=0)


def test_std_skipped_for_group_size_one():
    # the unbiased std of one sample is NaN; it must not be used
    rewards = torch.tensor([0.5, -1.0])
    torch.testing.assert_close(normalize_group_rewards(rewards, 1, subtract_mean=False), rewards)
    torch.testing.assert_close(normalize_group_rewards(rewards, 1), torch.zeros(2))


def test_bad_shapes_are_errors():
    with pytest.raises(ValueError, match="groups of 4"):
        normalize_group_rewards(REWARDS, 4)
    with pytest.raises(ValueError, match="1-D"):
        normalize_group_rewards(REWARDS.reshape(2, 3), 3)


@pytest.mark.parametrize(
    "estimator, kwargs, expected",
    [
        ("grpo", {}, (True, True)),
        ("gspo", {}, (True, True)),
        ("cispo", {}, (True, True)),
        ("grpo", {"disable_grpo_std_normalization": True}, (True, False)),
        ("grpo", {"disable_rewards_normalization": True}, (False, False)),
        ("reinforce_plus_plus_baseline", {}, (True, False)),
        ("reinforce_plus_plus", {}, (False, False)),
        ("ppo", {}, (False, False)),
    ],
)
def test_normalization_table(estimator, kwargs, expected):
    assert group_normalization_for(estimator, 8, **kwargs) == GroupNormalization(*expected)


def test_table_turns_std_off_for_group_size_one():
    assert group_normalization_for("grpo", 1) == GroupNormalization(subtract_mean=True, divide_std=False)


def test_table_rejects_unknown_estimator():
    with pytest.raises(ValueError, match="reinforce_plus_plus_baseline"):
        group_normalization_for("dapo", 8)


def test_custom_reward_post_process_replaces_the_normalisation_and_its_result_is_checked():
    samples = ["a", "b", "c"]
    seen = []

    def rank_rewards(args, batch):  # slime's signature: (args, samples) -> (raw_rewards, rewards)
        seen.append((args, list(batch)))
        return [1, 0, 1], torch.tensor([0.5, -1.0, 0.5])

    assert custom_rewards(rank_rewards, "args", samples, "mod.fn") == ([1.0, 0.0, 1.0], [0.5, -1.0, 0.5])
    assert seen == [("args", samples)]
    with pytest.raises(ValueError, match=r"mod.fn must return \(raw_rewards, rewards\), got list"):
        custom_rewards(lambda a, s: [1.0, 2.0, 3.0], None, samples, "mod.fn")
    with pytest.raises(ValueError, match="mod.fn returned rewards of 2 for 3 samples"):
        custom_rewards(lambda a, s: ([1, 2, 3], [1, 2]), None, samples, "mod.fn")
    with pytest.raises(ValueError, match="mod.fn returned raw_rewards that are not numbers"):
        custom_rewards(lambda a, s: (["x", 2, 3], [1, 2, 3]), None, samples, "mod.fn")
