"""The sampler's two-level inverse CDF draws exactly what a full float64 cumulative sum draws."""

import pytest
import torch

from slime.engines.builtin.sampling import inverse_cdf


@pytest.mark.parametrize("vocab", [7, 1024, 2503, 3000, 151936])
def test_inverse_cdf_equals_full_cumulative_sum(vocab):
    generator = torch.Generator().manual_seed(vocab)
    logits = torch.randn(64, vocab, generator=generator) * 3
    logits[:, ::3] = float("-inf")  # banned tokens (top-k / top-p / min_new_tokens) have probability 0
    probs = torch.softmax(logits, dim=1)
    uniforms = torch.rand(64, dtype=torch.float64, generator=generator)
    cdf = probs.double().cumsum(dim=1)
    expected = torch.searchsorted(cdf, (uniforms * cdf[:, -1]).unsqueeze(1), right=True).squeeze(1)
    drawn = inverse_cdf(probs, uniforms)
    assert torch.equal(drawn, expected)
    assert bool((probs.gather(1, drawn.unsqueeze(1)) > 0).all())


def test_block_size_divides_the_vocabulary_when_it_can():
    from slime.engines.builtin.sampling import _block_size

    assert _block_size(151936) == 1187 and _block_size(3000) == 1000 and _block_size(2048) == 1024
    assert _block_size(2503) == 1024 and _block_size(384) == 1024  # nothing divides: padded blocks


def test_inverse_cdf_edges_never_pick_a_zero_probability_token():
    probs = torch.zeros(3, 2503)  # prime: no block size divides it, so blocks of 1024 and padding
    probs[0, 5] = 1.0  # one possible token
    probs[1, [0, 2047]] = 0.5  # the last possible token sits at a block's end
    probs[2, [100, 2100]] = 0.5  # a trailing block with no mass, padded vocabulary
    for u in (0.0, 0.5, 1.0 - 1e-16):
        drawn = inverse_cdf(probs, torch.full((3,), u, dtype=torch.float64))
        assert bool((probs.gather(1, drawn.unsqueeze(1)) > 0).all()), (u, drawn)
    assert inverse_cdf(probs, torch.tensor([0.9, 0.9, 0.9], dtype=torch.float64)).tolist() == [5, 2047, 2100]
