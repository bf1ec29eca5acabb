"""Plugins named by dotted path in the Ray tests (importable in the actors: same sys.path as the driver)."""

from slime.types import Sample


async def rm_by_index(args, sample: Sample) -> float:
    """Rewards 0 and 1 alternating within every group: GRPO advantages are non-zero whatever the
    random tiny model writes."""
    return float(sample.index % 2)
