"""Advantage estimators: hand values on 2 samples x 3 tokens, slime's loops, masking."""

import math

import pytest
import torch

from slime.algorithms.advantages import (
    ESTIMATORS,
    compute_advantages,
    gae_advantages,
    grpo_advantages,
    reinforce_plus_plus_baseline_advantages,
    reinforce_plus_plus_returns,
    whiten,
)

NAN, INF = math.nan, math.inf

# Sample 0 has 3 trained tokens, sample 1 has 2 (its third position is padding).
MASK = torch.tensor([[1, 1, 1], [1, 1, 0]], dtype=torch.bool)
REWARDS = torch.tensor([1.0, -1.0])
KL = torch.tensor([[0.1, 0.2, 0.3], [0.4, 0.5, NAN]])  # NaN in the padding must not leak
VALUES = torch.tensor([[0.5, 0.4, 0.3], [0.2, 0.1, INF]])


def test_grpo_broadcasts_the_reward():
    expected = torch.tensor([[1.0, 1.0, 1.0], [-1.0, -1.0, 0.0]])
    torch.testing.assert_close(grpo_advantages(REWARDS, MASK), expected)


def test_reinforce_plus_plus_hand_values():
    # kl_coef 0.5, gamma 0.5.  Token rewards c = -0.5 kl, plus r on the last trained token:
    #   row 0: c = [-0.05, -0.1, -0.15 + 1] = [-0.05, -0.1, 0.85]
    #          G2 = 0.85, G1 = -0.1 + 0.5 * 0.85 = 0.325, G0 = -0.05 + 0.5 * 0.325 = 0.1125
    #   row 1: c = [-0.2, -0.25 - 1] = [-0.2, -1.25]
    #          G1 = -1.25, G0 = -0.2 + 0.5 * -1.25 = -0.825
    expected = torch.tensor([[0.1125, 0.325, 0.85], [-0.825, -1.25, 0.0]])
    out = reinforce_plus_plus_returns(REWARDS, KL, MASK, kl_coef=0.5, gamma=0.5)
    torch.testing.assert_close(out, expected)


def _slime_reinforce_plus_plus(rewards, kl, lengths, kl_coef, gamma):
    """slime get_reinforce_plus_plus_returns, one sample at a time, responses of length L_i."""
    out = torch.zeros_like(kl)
    for i, length in enumerate(lengths):
        token_rewards = -kl_coef * kl[i, :length].clone()
        token_rewards[length - 1] += rewards[i]
        running = 0.0
        for t in reversed(range(length)):
            running = token_rewards[t] + gamma * running
            out[i, t] = running
    return out


def test_reinforce_plus_plus_equals_slime_loop():
    gen = torch.Generator().manual_seed(1)
    lengths = [5, 2, 7, 1]
    mask = torch.arange(7)[None, :] < torch.tensor(lengths)[:, None]
    rewards, kl = torch.randn(4, generator=gen), torch.randn(4, 7, generator=gen)
    expected = _slime_reinforce_plus_plus(rewards, kl, lengths, kl_coef=0.3, gamma=0.9)
    out = reinforce_plus_plus_returns(rewards, kl, mask, kl_coef=0.3, gamma=0.9)
    torch.testing.assert_close(out, expected)


def test_reinforce_plus_plus_skips_interior_masked_tokens():
    # mask [1, 0, 1], r = 1, no KL, gamma 0.5: G2 = 1; position 1 is skipped (output 0) and
    # G0 = 0 + 0.5 * G2 = 0.5 (slime would discount twice: 0.25).
    out = reinforce_plus_plus_returns(
        torch.tensor([1.0]), None, torch.tensor([[1, 0, 1]]), kl_coef=0.0, gamma=0.5
    )
    torch.testing.assert_close(out, torch.tensor([[0.5, 0.0, 1.0]]))


def test_reinforce_plus_plus_baseline_hand_values():
    # r already centred: [0.5, -0.5]; A = r - 0.5 kl
    #   row 0: [0.5 - 0.05, 0.5 - 0.1, 0.5 - 0.15] = [0.45, 0.4, 0.35]
    #   row 1: [-0.5 - 0.2, -0.5 - 0.25] = [-0.7, -0.75]
    expected = torch.tensor([[0.45, 0.4, 0.35], [-0.7, -0.75, 0.0]])
    out = reinforce_plus_plus_baseline_advantages(torch.tensor([0.5, -0.5]), KL, MASK, kl_coef=0.5)
    torch.testing.assert_close(out, expected)


def test_gae_hand_values():
    # kl_coef 0.5, gamma 0.5, lambd 0.5 (gamma * lambd = 0.25); c as in the reinforce++ test.
    #   row 0, V = [0.5, 0.4, 0.3]:
    #     t2: delta = 0.85 - 0.3 = 0.55                          A2 = 0.55
    #     t1: delta = -0.1 + 0.5 * 0.3 - 0.4 = -0.35              A1 = -0.35 + 0.25 * 0.55 = -0.2125
    #     t0: delta = -0.05 + 0.5 * 0.4 - 0.5 = -0.35             A0 = -0.35 + 0.25 * -0.2125 = -0.403125
    #     returns = A + V = [0.096875, 0.1875, 0.85]
    #   row 1, V = [0.2, 0.1]:
    #     t1: delta = -1.25 - 0.1 = -1.35                         A1 = -1.35
    #     t0: delta = -0.2 + 0.5 * 0.1 - 0.2 = -0.35              A0 = -0.35 + 0.25 * -1.35 = -0.6875
    #     returns = [-0.4875, -1.25]
    out = gae_advantages(REWARDS, KL, VALUES, MASK, kl_coef=0.5, gamma=0.5, lambd=0.5)
    torch.testing.assert_close(
        out.advantages, torch.tensor([[-0.403125, -0.2125, 0.55], [-0.6875, -1.35, 0.0]])
    )
    torch.testing.assert_close(out.returns, torch.tensor([[0.096875, 0.1875, 0.85], [-0.4875, -1.25, 0.0]]))


def _slime_vanilla_gae(token_rewards, values, gamma, lambd):
    """slime vanilla_gae on zero-padded [B, T] rows."""
    last, reversed_adv = 0.0, []
    for t in reversed(range(values.shape[1])):
        next_value = values[:, t + 1] if t < values.shape[1] - 1 else 0.0
        last = token_rewards[:, t] + gamma * next_value - values[:, t] + gamma * lambd * last
        reversed_adv.append(last)
    advantages = torch.stack(reversed_adv[::-1], dim=1)
    return advantages, advantages + values


def test_gae_equals_slime_on_right_padded_rows():
    gen = torch.Generator().manual_seed(2)
    lengths = torch.tensor([6, 3, 1])
    mask = torch.arange(6)[None, :] < lengths[:, None]
    rewards, kl = torch.randn(3, generator=gen), torch.randn(3, 6, generator=gen)
    values = torch.randn(3, 6, generator=gen)
    # slime's inputs: zeros after each response, reward on the last response token
    token_rewards = torch.where(mask, -0.1 * kl, 0.0)
    token_rewards[torch.arange(3), lengths - 1] += rewards
    expected_adv, expected_ret = _slime_vanilla_gae(token_rewards, torch.where(mask, values, 0.0), 0.9, 0.8)
    out = gae_advantages(rewards, kl, values, mask, kl_coef=0.1, gamma=0.9, lambd=0.8)
    torch.testing.assert_close(out.advantages, torch.where(mask, expected_adv, 0.0))
    torch.testing.assert_close(out.returns, torch.where(mask, expected_ret, 0.0))


def test_gae_with_unit_gamma_and_lambda_is_returns_minus_values():
    gen = torch.Generator().manual_seed(3)
    mask = torch.rand(4, 9, generator=gen) > 0.3
    mask[:, 0] = True
    rewards, kl, values = (
        torch.randn(4, generator=gen),
        torch.randn(4, 9, generator=gen),
        torch.randn(4, 9, generator=gen),
    )
    mc_returns = reinforce_plus_plus_returns(rewards, kl, mask, kl_coef=0.2, gamma=1.0)
    out = gae_advantages(rewards, kl, values, mask, kl_coef=0.2, gamma=1.0, lambd=1.0)
    torch.testing.assert_close(out.advantages, torch.where(mask, mc_returns - values, 0.0))
    torch.testing.assert_close(out.returns, mc_returns)


def test_whiten_hand_values():
    # trained values [1, 2, 3, 4, 5]: mean 3, unbiased var = (4 + 1 + 0 + 1 + 4) / 4 = 2.5
    # -> [-2, -1, 0, 1, 2] / sqrt(2.5) = [-1.2649111, -0.6324555, 0, 0.6324555, 1.2649111]
    out = whiten(torch.tensor([[1.0, 2.0, 3.0], [4.0, 5.0, NAN]]), MASK)
    s = 1 / math.sqrt(2.5)
    torch.testing.assert_close(out, torch.tensor([[-2 * s, -s, 0.0], [s, 2 * s, 0.0]]))


def test_whiten_gives_zero_mean_unit_std_over_trained_tokens():
    gen = torch.Generator().manual_seed(4)
    mask = torch.rand(5, 8, generator=gen) > 0.4
    out = whiten(torch.randn(5, 8, generator=gen) * 4 + 2, mask)
    trained = out[mask]
    torch.testing.assert_close(trained.mean(), torch.tensor(0.0), atol=1e-6, rtol=0)
    torch.testing.assert_close(trained.std(), torch.tensor(1.0), atol=1e-6, rtol=0)
    assert (out[~mask] == 0).all()


def test_whiten_rejects_an_empty_mask():
    with pytest.raises(ValueError, match="no token"):
        whiten(torch.ones(2, 3), torch.zeros(2, 3, dtype=torch.bool))


@pytest.mark.parametrize("estimator", ESTIMATORS)
def test_masked_garbage_never_leaks(estimator):
    clean_kl = torch.where(MASK, KL, 0.0)
    clean_values = torch.where(MASK, VALUES, 0.0)
    garbage_kl = torch.where(MASK, KL, torch.tensor([[INF, -INF, NAN], [NAN, INF, -INF]]))
    kwargs = {"kl_coef": 0.5, "gamma": 0.9, "lambd": 0.7}
    clean = compute_advantages(estimator, REWARDS, MASK, kl=clean_kl, values=clean_values, **kwargs)
    dirty = compute_advantages(estimator, REWARDS, MASK, kl=garbage_kl, values=VALUES, **kwargs)
    for a, b in zip(clean, dirty, strict=True):
        assert torch.isfinite(b).all()
        torch.testing.assert_close(a, b)
        assert (b[~MASK] == 0).all()


def test_dispatch():
    grpo = compute_advantages("grpo", REWARDS, MASK)
    for name in ("gspo", "cispo"):
        out = compute_advantages(name, REWARDS, MASK)
        torch.testing.assert_close(out.advantages, grpo.advantages)
        torch.testing.assert_close(out.returns, grpo.advantages)
    rpp = compute_advantages("reinforce_plus_plus", REWARDS, MASK, kl=KL, kl_coef=0.5, gamma=0.5)
    torch.testing.assert_close(
        rpp.advantages, reinforce_plus_plus_returns(REWARDS, KL, MASK, kl_coef=0.5, gamma=0.5)
    )
    ppo = compute_advantages("ppo", REWARDS, MASK, kl=KL, values=VALUES, kl_coef=0.5, gamma=0.5, lambd=0.5)
    torch.testing.assert_close(ppo.returns, torch.where(MASK, ppo.advantages + VALUES, 0.0))


def test_dispatch_errors():
    with pytest.raises(ValueError, match="critic values"):
        compute_advantages("ppo", REWARDS, MASK)
    with pytest.raises(ValueError, match="grpo, gspo, cispo"):
        compute_advantages("dapo", REWARDS, MASK)
    with pytest.raises(ValueError, match="rewards must be"):
        compute_advantages("grpo", torch.ones(3), MASK)


def test_outputs_carry_no_gradient():
    values = VALUES.clone().requires_grad_()
    out = gae_advantages(REWARDS, None, values, MASK, kl_coef=0.0, gamma=1.0, lambd=1.0)
    assert not out.advantages.requires_grad and not out.returns.requires_grad
