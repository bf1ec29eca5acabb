"""bench/soak.py's RSS criterion: the trough and crest (10% / 90% quantiles) of a process that swings in every
call stay put when only the calls' share of the time grows, and both rise with a leak; the median does neither."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))

import soak  # noqa: E402


def swinging(inside: float, kept: float, n: int = 200) -> list[float]:
    """Samples of a process at `kept` MB between calls and `kept + 300` inside one, `inside` of the time."""
    return [kept + 300 if (i * inside) % 1 + inside > 1 else kept for i in range(n)]


def test_longer_calls_move_the_median_not_the_trough_or_crest():
    early, late = swinging(0.3, 700), swinging(0.55, 700)
    assert soak.median(late) / soak.median(early) > 1.3  # what the old criterion saw: "x1.4"
    assert soak.quantile(late, 0.1) == soak.quantile(early, 0.1) == 700
    assert soak.quantile(late, 0.9) == soak.quantile(early, 0.9) == 1000


def test_a_leak_raises_both():
    early, late = swinging(0.3, 700), swinging(0.3, 900)
    assert soak.quantile(late, 0.1) / soak.quantile(early, 0.1) > 1.25
    assert soak.quantile(late, 0.9) / soak.quantile(early, 0.9) > 1.15
    assert soak.quantile([], 0.5) is None
