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


def test_balanced_partition_equal_counts_even_sums():
    from slime.backends.megatron.batching import balanced_partition

    costs = [100.0, 1.0, 2.0, 3.0, 50.0, 60.0, 7.0, 8.0, 9.0]
    groups = balanced_partition(costs, 3)
    assert sorted(i for g in groups for i in g) == list(range(9)) and all(len(g) == 3 for g in groups)
    sums = sorted(sum(costs[i] for i in g) for g in groups)
    assert sums[-1] - sums[0] < 110.0 - 59.0  # better than the strided split [110, 59, 71]
    with pytest.raises(ConfigError, match="cannot split 9 samples into 2 equal groups"):
        balanced_partition(costs, 2)


def test_forward_flops_grow_faster_than_length():
    from transformers import Qwen2Config

    from slime.backends.megatron.batching import forward_flops

    config = Qwen2Config(vocab_size=100, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, intermediate_size=128)
    assert forward_flops(200, config) > 2 * forward_flops(100, config) > 0  # the attention term is quadratic


def test_balance_by_flops_evens_micro_batch_costs():
    lengths = [90, 10, 10, 10, 50, 40]  # 210 tokens, limit 100: 3 micro-batches
    cost = lambda n: float(n * n)  # noqa: E731 - a quadratic cost, as attention's
    parts = micro_batches(lengths, micro_batch_size=1, use_dynamic_batch_size=True, max_tokens_per_gpu=100,
                          workload=cost)
    assert len(parts) == 3 and sorted(i for p in parts for i in p) == list(range(6))
    costs = sorted(sum(cost(lengths[i]) for i in p) for p in parts)
    first_fit = micro_batches(lengths, micro_batch_size=1, use_dynamic_batch_size=True, max_tokens_per_gpu=100)
    ff_costs = sorted(sum(cost(lengths[i]) for i in p) for p in first_fit)
    assert costs[-1] - costs[0] < ff_costs[-1] - ff_costs[0]  # more even than first-fit's
    assert all(parts)
    # as many micro-batches as samples: each alone
    assert micro_batches([5, 5], micro_batch_size=1, use_dynamic_batch_size=True, max_tokens_per_gpu=1,
                         workload=cost) == [[0], [1]]
