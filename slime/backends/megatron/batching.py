"""Which samples go into which micro-batch: fixed count, or packed by tokens (`use_dynamic_batch_size`).

Samples are right-padded inside a micro-batch (`logprobs.pad_samples`), so what a micro-batch costs in
activation memory is its padded size, rows x longest sequence, not the sum of its lengths. Dynamic
batching therefore bounds the padded size by `max_tokens_per_gpu` (which also bounds the sum). It is
first-fit in sample order: each sample goes into the first open micro-batch that stays within the
limit with it, else opens a new one; a sample longer than the limit sits alone in its own micro-batch.
slime packs without padding (THD) and also first-fit (`slime/utils/seqlen_balancing.py`); the loss
normalisation does not depend on the partition, so any packing gives the same update up to rounding.

With expert parallelism every micro-batch's forward and backward exchange tokens with the other ranks of
the expert-parallel group (megatron's alltoall dispatcher), so those ranks must run as many micro-batches
as each other; `check_expert_parallel_counts` refuses a step where they would not (they would hang).
"""

from __future__ import annotations

import heapq
from collections.abc import Callable
from typing import Any

import torch

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
                  max_tokens_per_gpu: int | None = None,
                  workload: Callable[[int], float] | None = None) -> list[list[int]]:
    """The micro-batch partition the train step and forward-only passes use (indices into the samples).

    With `workload` (slime's --balance-by-flops: a sequence length's estimated cost) the dynamic path makes
    ceil(total tokens / max_tokens_per_gpu) micro-batches of even cost by Karmarkar-Karp instead of
    first-fit; as in slime, a micro-batch may then pass the token limit."""
    if use_dynamic_batch_size:
        if max_tokens_per_gpu is None:
            raise ConfigError("train.use_dynamic_batch_size needs train.max_tokens_per_gpu (tokens per micro-batch)")
        if workload is not None:
            count = max(1, -(-sum(lengths) // max_tokens_per_gpu))
            if count >= len(lengths):
                return [[i] for i in range(len(lengths))]
            return balanced_partition([workload(n) for n in lengths], count, equal_size=False)
        return dynamic_micro_batches(lengths, max_tokens_per_gpu)
    return fixed_micro_batches(len(lengths), micro_batch_size)


def forward_flops(length: int, hf_config: Any) -> float:
    """Estimated forward FLOPs of one sequence of `length` tokens under a dense decoder (`hf_config`'s
    shape): per layer 2·L·(attention and MLP weights) plus 4·L²·hidden for the scores and their
    weighted sum, then the output layer. slime's balance estimate (`calculate_fwd_flops`) has the same
    terms; the constant factors cancel in a partition."""
    hidden = hf_config.hidden_size
    heads = hf_config.num_attention_heads
    kv_heads = getattr(hf_config, "num_key_value_heads", None) or heads
    head_dim = getattr(hf_config, "head_dim", None) or hidden // heads
    mlp = getattr(hf_config, "intermediate_size", None) or 4 * hidden
    weights = hidden * head_dim * (2 * heads + 2 * kv_heads) + 3 * hidden * mlp  # q, o, k, v; gated MLP
    per_layer = 2 * length * weights + 4 * length * length * hidden
    return float(hf_config.num_hidden_layers * per_layer + 2 * length * hidden * hf_config.vocab_size)


def balanced_partition(workloads: list[float], parts: int, equal_size: bool = True) -> list[list[int]]:
    """Indices of `workloads` in `parts` groups whose sums are as even as Karmarkar-Karp's largest
    differencing method makes them (slime's --balance-data and --balance-by-flops partitions); with
    `equal_size` every group has the same count (`len(workloads)` must be a multiple of `parts`). Each group
    is returned in ascending index order.

    Partial partitions start as the sorted items taken `parts` at a time, one item per group (equal sizes),
    or one item each beside empty groups; the two partial partitions with the largest spread (max sum - min
    sum) are merged repeatedly, pairing the heaviest group of one with the lightest of the other."""
    if parts < 1 or (equal_size and len(workloads) % parts):
        raise ConfigError(f"cannot split {len(workloads)} samples into {parts} equal groups")
    order = sorted(range(len(workloads)), key=lambda i: (workloads[i], i))
    step = parts if equal_size else 1
    heap: list[tuple[float, int, list[tuple[float, list[int]]]]] = []
    for start in range(0, len(order), step):
        items = [(workloads[i], [i]) for i in order[start:start + step]]
        groups = sorted(items + [(0.0, [])] * (parts - len(items)), key=lambda g: -g[0])
        heapq.heappush(heap, (-(groups[0][0] - groups[-1][0]), start, groups))
    while len(heap) > 1:
        _, tie, a = heapq.heappop(heap)
        _, _, b = heapq.heappop(heap)
        merged = sorted(((a[j][0] + b[parts - 1 - j][0], a[j][1] + b[parts - 1 - j][1]) for j in range(parts)),
                        key=lambda g: -g[0])
        heapq.heappush(heap, (-(merged[0][0] - merged[-1][0]), tie, merged))
    return [sorted(members) for _, members in heap[0][2]] if heap else [[] for _ in range(parts)]


def check_expert_parallel_counts(count: int, device: torch.device | str) -> None:
    """Refuse, on every rank alike, `count` micro-batches when another rank of this rank's expert-parallel group
    has a different count: each MoE layer's token exchange is a collective of the whole group, so unequal
    counts would leave ranks waiting for each other until the process-group timeout."""
    import torch.distributed as dist
    from megatron.core import parallel_state

    if not parallel_state.model_parallel_is_initialized() or parallel_state.get_expert_model_parallel_world_size() <= 1:
        return
    bounds = torch.tensor([count, -count], dtype=torch.int64, device=device)  # max of -count is -min
    dist.all_reduce(bounds, op=dist.ReduceOp.MAX, group=parallel_state.get_expert_model_parallel_group())
    most, fewest = int(bounds[0]), -int(bounds[1])
    if most != fewest:
        raise ConfigError(f"expert parallelism: this rank has {count} micro-batches, others of its expert-parallel "
                          f"group between {fewest} and {most}; every rank must run as many (the experts exchange "
                          "tokens in each one): give each data-parallel rank as many samples with a fixed "
                          "micro_batch_size (dynamic batching is not yet balanced over ranks)")
