"""Rollout metrics slime logs on request: --log-passrate and --log-reward-category (hand-made groups)."""

from __future__ import annotations

import argparse

from slime.rollout.rollout import passrate_metrics, reward_category_metrics
from slime.types import Sample


def test_passrate_and_reward_category_metrics():
    args = argparse.Namespace(reward_key="score")

    def group(*scores):
        return [Sample(index=i, reward={"score": s, "why": "ok" if s else "wrong"}) for i, s in enumerate(scores)]

    kept = [group(1, 0, 0, 0), group(1, 1, 1, 1)]
    metrics = passrate_metrics(args, kept)
    # group 1: pass@1 = 1/4, pass@2 = 1 - C(3,2)/C(4,2) = 1/2, pass@4 = 1; group 2: all 1
    assert metrics == {"passrate/pass@1": (0.25 + 1) / 2, "passrate/pass@2": (0.5 + 1) / 2, "passrate/pass@4": 1.0}
    assert passrate_metrics(args, [group(1), group(0)]) == {}  # slime: nothing for groups of one
    samples = [s for g in kept for s in g]
    assert reward_category_metrics(samples, "why") == {"error_cat/ok": 5 / 8, "error_cat/wrong": 3 / 8}
