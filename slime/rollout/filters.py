"""Dynamic sampling filters (slime's `filter_hub`): decide per finished group whether it trains.

A filter is `fn(args, samples, **kwargs) -> DynamicFilterOutput | bool`, named by
`--dynamic-sampling-filter-path`. A dropped group is replaced by over-sampling more prompts, so a
rollout still returns `rollout_batch_size` groups (DAPO's dynamic sampling). A plain bool return is
accepted as `keep`, as slime does for older filters.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from slime.types import Sample

FILTER_PARAMS = ["args", "samples"]


@dataclass
class DynamicFilterOutput:
    """`keep`: train on the group. `reason`: why not (a metric key). `keep_when_insufficient`: keep it
    anyway when dropping it would leave too few groups in flight to fill the batch."""

    keep: bool
    reason: str | None = None
    keep_when_insufficient: bool = False


def _reward(args: Any, sample: Sample | list[Sample]) -> float:
    # a fan-out trajectory is a list of fragments sharing one reward
    return float((sample[0] if isinstance(sample, list) else sample).get_reward_value(args))


def check_reward_nonzero_std(args: Any, samples: list[Sample | list[Sample]], **kwargs: Any) -> DynamicFilterOutput:
    """Keep a group only if its rewards differ (std > 1e-6): a group where every sample got the
    same reward has zero GRPO advantage and teaches nothing."""
    rewards = [_reward(args, s) for s in samples]
    keep = len(rewards) > 1 and statistics.pstdev(rewards) > 1e-6
    return DynamicFilterOutput(keep=keep, reason=None if keep else f"zero_std_{round(rewards[0], 1)}")


def check_reward_nonzero_std_with_fallback(args: Any, samples: list[Sample | list[Sample]],
                                           **kwargs: Any) -> DynamicFilterOutput:
    """As `check_reward_nonzero_std`, but keep a zero-std group rather than sample another round."""
    output = check_reward_nonzero_std(args, samples, **kwargs)
    output.keep_when_insufficient = True
    return output


def call_dynamic_filter(fn: Callable[..., Any] | None, args: Any, group: list[Any]) -> DynamicFilterOutput:
    """Run the filter (None keeps everything) and normalise its answer."""
    if fn is None:
        return DynamicFilterOutput(keep=True)
    output = fn(args, group)
    return output if isinstance(output, DynamicFilterOutput) else DynamicFilterOutput(keep=bool(output))


def should_drop(output: DynamicFilterOutput, *, groups_live: int, target: int) -> bool:
    """Drop a rejected group unless it may be kept when insufficient and `groups_live` (kept + in
    flight + this one) would not reach `target` without it."""
    if output.keep:
        return False
    return not (output.keep_when_insufficient and groups_live <= target)
