"""How far behind the trainer a sample is, and what to do when it is too far.

Version numbers: the engines' weights after the trainer has trained on rollouts 0..r-1 are version r
(the RL loop syncs them as `str(r)`); the trainer trains rollout r with version-r weights. A sample's lag
at rollout r is `r - v`, where v is the version of its oldest generated token
(`Sample.token_weight_versions`; -1 marks tokens no policy generated, and is left out). So sync mode has
lag 0, one-step-off (`--async`) lag 1, and `--max-policy-version-lag K` bounds it by K; a group is as
stale as its stalest sample, and it is trained whole or not at all.
"""

from __future__ import annotations

import statistics
from collections import Counter

from slime.types import Sample


def oldest_version(sample: Sample) -> int | None:
    """The weight version of the sample's oldest policy-generated token (None: none recorded)."""
    versions = [v for v in (sample.token_weight_versions or []) if v >= 0]
    return min(versions) if versions else None


def sample_lag(sample: Sample, trainer_version: int) -> int | None:
    """Versions between the oldest token and the weights being trained (None: unknown)."""
    oldest = oldest_version(sample)
    return None if oldest is None else trainer_version - oldest


def group_oldest_version(samples: list[Sample]) -> int | None:
    """The oldest token version over a group's samples (flattened; None when none is recorded)."""
    versions = [v for s in samples if (v := oldest_version(s)) is not None]
    return min(versions) if versions else None


def group_lag(samples: list[Sample], trainer_version: int) -> int | None:
    """The largest lag of a group's samples (flattened; None when no sample has a recorded version)."""
    oldest = group_oldest_version(samples)
    return None if oldest is None else trainer_version - oldest


def is_stale(samples: list[Sample], trainer_version: int, max_lag: int | None) -> bool:
    """Whether a group (its samples, flattened) breaks the bound at `trainer_version` (never without a
    bound or a recorded version)."""
    lag = group_lag(samples, trainer_version)
    return max_lag is not None and lag is not None and lag > max_lag


def staleness_metrics(samples: list[Sample], trainer_version: int) -> dict[str, float]:
    """`async/staleness/*`: how many samples are k versions behind (`lag_k`), their mean and max, and
    how many have no recorded version (`unknown`)."""
    lags = [sample_lag(s, trainer_version) for s in samples]
    known = [lag for lag in lags if lag is not None]
    out: dict[str, float] = {f"async/staleness/lag_{k}": n for k, n in sorted(Counter(known).items())}
    out["async/staleness/unknown"] = len(lags) - len(known)
    if known:
        out["async/staleness/mean"] = statistics.fmean(known)
        out["async/staleness/max"] = max(known)
    return out


def version_ranges(sample: Sample) -> list[tuple[int, int, int]]:
    """The response as (start, end, version) runs of equal `token_weight_versions` (end exclusive)."""
    versions = sample.token_weight_versions or []
    runs: list[tuple[int, int, int]] = []
    start = 0
    for i in range(1, len(versions) + 1):
        if i == len(versions) or versions[i] != versions[start]:
            runs.append((start, i, versions[start]))
            start = i
    return runs
