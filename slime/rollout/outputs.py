"""What a rollout function returns (slime's `RolloutFnTrainOutput` / `RolloutFnEvalOutput`)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from slime.types import Sample


@dataclass
class RolloutFnTrainOutput:
    """`samples`: `rollout_batch_size` groups (a group is a list of samples; with a fan-out generate
    function each entry may itself be a list). `metrics`: flat `rollout/...` figures."""

    samples: list[list[Any]]
    metrics: dict[str, Any] = field(default_factory=dict)


@dataclass
class RolloutFnEvalOutput:
    """`data`: {dataset name: {"rewards": [...], "truncated": [...], "samples": [Sample, ...]}} as in
    slime; `metrics`: flat `eval/<name>/...` figures."""

    data: dict[str, dict[str, list[Any]]]
    metrics: dict[str, Any] = field(default_factory=dict)


def flatten(groups: list[Any]) -> list[Sample]:
    """Every Sample of a group, a list of groups, or fan-out lists, in order."""
    out: list[Sample] = []
    for item in groups:
        if isinstance(item, Sample):
            out.append(item)
        else:
            out.extend(flatten(item))
    return out
