"""Micro-batch partitions: fixed size, and first-fit packing under max_tokens_per_gpu."""

import random

import pytest

from slime.backends.megatron.batching import dynamic_micro_batches, fixed_micro_batches, micro_batches
from slime.errors import ConfigError


def test_fixed_micro_batches_cover_samples_in_order():
    assert fixed_micro_batches(5, 2) == [[0, 1], [2, 3], [4]]
    assert fixed_micro_batches(4, 4) == [[0, 1, 2, 3]]


def test_dynamic_packing_first_fit_by_padded_size():
    # padded size = rows x longest row: [10, 11] costs 22 <= 24, adding an 11 would cost 33
    assert dynamic_micro_batches([10, 11, 11, 11, 5, 14], 24) == [[0, 1], [2, 3], [4], [5]]
    # a sample longer than the limit sits alone; shorter ones still fill earlier bins
    assert dynamic_micro_batches([3, 50, 4, 3], 12) == [[0, 2, 3], [1]]


@pytest.mark.parametrize("seed", range(5))
def test_dynamic_packing_respects_the_limit(seed):
    rng = random.Random(seed)
    lengths = [rng.randint(1, 120) for _ in range(200)]
    limit = 256
    bins = dynamic_micro_batches(lengths, limit)
    assert sorted(i for b in bins for i in b) == list(range(len(lengths)))  # every sample exactly once
    for b in bins:
        padded = len(b) * max(lengths[i] for i in b)
        assert padded <= limit or len(b) == 1
        assert sum(lengths[i] for i in b) <= limit
    # packing actually packs: far fewer micro-batches than samples
    assert len(bins) < len(lengths) / 2


def test_dynamic_needs_a_token_limit():
    with pytest.raises(ConfigError, match="max_tokens_per_gpu"):
        micro_batches([3, 4], micro_batch_size=1, use_dynamic_batch_size=True)
    with pytest.raises(ConfigError, match="micro_batch_size"):
        fixed_micro_batches(3, 0)
