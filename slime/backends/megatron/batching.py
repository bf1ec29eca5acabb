"""Which samples go into which micro-batch: fixed count, or packed by tokens (`use_dynamic_batch_size`).

Samples are right-padded inside a micro-batch (`logprobs.pad_samples`), so what a micro-batch costs in
activation memory is its padded size, rows x longest sequence, not the sum of its lengths. Dynamic
batching therefore bounds the padded size by `max_tokens_per_gpu` (which also bounds the sum). It is
first-fit in sample order: each sample goes into the first open micro-batch that stays within the
limit with it, else opens a new one; a sample longer than the limit sits alone in its own micro-batch.
slime packs without padding (THD) and also first-fit (`slime/utils/seqlen_balancing.py`); the loss
normalisation does not depend on the partition, so any packing gives the same update up to rounding.
"""

from __future__ import annotations

from slime.errors import ConfigError


def fixed_micro_batches(num_samples: int, micro_batch_size: int) -> list[list[int]]:
    """Consecutive groups of `micro_batch_size` sample indices (the last one may be shorter)."""
    if micro_batch_size < 1:
        raise ConfigError(f"micro_batch_size must be >= 1, got {micro_batch_size}")
    return [list(range(start, min(start + micro_batch_size, num_samples)))
            for start in range(0, num_samples, micro_batch_size)]


def dynamic_micro_batches(lengths: list[int], max_tokens_per_gpu: int) -> list[list[int]]:
    """First-fit packing of samples (by token count `lengths`) into micro-batches whose padded size,
    rows x longest row, is at most `max_tokens_per_gpu`; over-long samples go alone."""
    if max_tokens_per_gpu < 1:
        raise ConfigError(f"max_tokens_per_gpu must be >= 1, got {max_tokens_per_gpu}")
    bins: list[list[int]] = []
    longest: list[int] = []  # longest sample of each bin
    for index, length in enumerate(lengths):
        for b, members in enumerate(bins):
            width = max(longest[b], length)
            if (len(members) + 1) * width <= max_tokens_per_gpu:
                members.append(index)
                longest[b] = width
                break
        else:
            bins.append([index])
            longest.append(length)
    return bins


def micro_batches(lengths: list[int], *, micro_batch_size: int, use_dynamic_batch_size: bool = False,
                  max_tokens_per_gpu: int | None = None) -> list[list[int]]:
    """The micro-batch partition the train step and forward-only passes use (indices into the samples)."""
    if use_dynamic_batch_size:
        if max_tokens_per_gpu is None:
            raise ConfigError("train.use_dynamic_batch_size needs train.max_tokens_per_gpu (tokens per micro-batch)")
        return dynamic_micro_batches(lengths, max_tokens_per_gpu)
    return fixed_micro_batches(len(lengths), micro_batch_size)
