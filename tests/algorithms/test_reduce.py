"""Per-sample-mean and per-token-mean reductions on unequal lengths."""

import math

import torch

from slime.algorithms.reduce import per_sample_mean, sample_mean, token_mean

NAN, INF = math.nan, math.inf

# sample 0: 3 tokens [1, 2, 3]; sample 1: 1 token [10], then garbage in masked positions
VALUES = torch.tensor([[1.0, 2.0, 3.0], [10.0, NAN, INF]])
MASK = torch.tensor([[1, 1, 1], [1, 0, 0]], dtype=torch.bool)


def test_per_sample_mean():
    # [ (1 + 2 + 3) / 3, 10 / 1 ] = [2, 10]
    torch.testing.assert_close(per_sample_mean(VALUES, MASK), torch.tensor([2.0, 10.0]))


def test_sample_mean_and_token_mean_differ_as_hand_computed():
    # sample mean: (2 + 10) / 2 = 6, every sample weighs the same
    # token mean: (1 + 2 + 3 + 10) / 4 = 4, every token weighs the same
    torch.testing.assert_close(sample_mean(VALUES, MASK), torch.tensor(6.0))
    torch.testing.assert_close(token_mean(VALUES, MASK), torch.tensor(4.0))


def test_explicit_step_totals():
    # sum of sample means 12 over 4 samples in the step -> 3; token sum 16 over 8 tokens -> 2
    torch.testing.assert_close(sample_mean(VALUES, MASK, num_samples=4), torch.tensor(3.0))
    torch.testing.assert_close(token_mean(VALUES, MASK, num_tokens=8), torch.tensor(2.0))


def test_rollout_denominators():
    # both samples belong to one rollout of 3 + 1 = 4 tokens: (6 / 4 + 10 / 4) / 2 = 2
    out = sample_mean(VALUES, MASK, denominators=torch.tensor([4, 4]))
    torch.testing.assert_close(out, torch.tensor(2.0))


def test_empty_sample():
    # sample 1 has no trained token: its mean is 0 and it still counts as a sample; in the token
    # mean it counts as one token like slime's clamp: sample mean (1.5 + 0) / 2 = 0.75, token mean 3 / 3 = 1
    values = torch.tensor([[1.0, 2.0], [5.0, 5.0]])
    mask = torch.tensor([[1, 1], [0, 0]], dtype=torch.bool)
    torch.testing.assert_close(per_sample_mean(values, mask), torch.tensor([1.5, 0.0]))
    torch.testing.assert_close(sample_mean(values, mask), torch.tensor(0.75))
    torch.testing.assert_close(token_mean(values, mask), torch.tensor(1.0))


def test_micro_batches_add_up_to_the_step():
    gen = torch.Generator().manual_seed(0)
    values = torch.randn(4, 6, generator=gen)
    mask = torch.rand(4, 6, generator=gen) > 0.3
    mask[:, 0] = True
    total_tokens = mask.sum()
    split_sample = sample_mean(values[:2], mask[:2], num_samples=4) + sample_mean(
        values[2:], mask[2:], num_samples=4
    )
    split_token = token_mean(values[:2], mask[:2], num_tokens=total_tokens) + token_mean(
        values[2:], mask[2:], num_tokens=total_tokens
    )
    torch.testing.assert_close(split_sample, sample_mean(values, mask))
    torch.testing.assert_close(split_token, token_mean(values, mask))


def test_gradient_ignores_masked_garbage():
    # d(sample_mean)/dx_it = 1 / (n_i * B): sample 0 -> 1 / 6, sample 1 -> 1 / 2; masked -> 0
    values = VALUES.clone().requires_grad_()
    sample_mean(values, MASK).backward()
    torch.testing.assert_close(values.grad, torch.tensor([[1 / 6, 1 / 6, 1 / 6], [0.5, 0.0, 0.0]]))
    # d(token_mean)/dx_it = 1 / 4 for every trained token
    values.grad = None
    token_mean(values, MASK).backward()
    torch.testing.assert_close(values.grad, torch.tensor([[0.25, 0.25, 0.25], [0.25, 0.0, 0.0]]))
