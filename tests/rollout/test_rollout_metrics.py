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


def test_multi_turn_metrics():
    from slime.rollout.rollout import multi_turn_metrics

    samples = [Sample(index=0, response_length=6, loss_mask=[1, 1, 0, 0, 1, 1], metadata={"turns": 2}),
               Sample(index=1, response_length=4, loss_mask=None, metadata={"round_number": 1})]
    m = multi_turn_metrics(samples, max_response_len=6)
    assert m["multi_turn/raw_response_length/response_length_mean"] == 5.0
    assert m["multi_turn/raw_response_length/response_length_clip_ratio"] == 0.5
    assert (m["multi_turn/wo_obs_response_length/response_length_min"],
            m["multi_turn/wo_obs_response_length/response_length_max"]) == (4, 4)  # 4 model tokens each
    assert (m["multi_turn/multi_turn_metric/round_number_mean"],
            m["multi_turn/multi_turn_metric/round_number_max"]) == (1.5, 2)
