"""Shared GPUs end to end on one fake GPU (CPU machine, `num_gpus=1` in the local Ray): the train rank and
the engine (started by an `EngineHost` that holds its half) sit on the same bundle, both resident, and
`RLLoop` runs fully async generation beside training with tensor weight sync (`auto` with share_gpu)."""

from __future__ import annotations

import pytest
import ray
from rl_setup import rl_config

from slime.rl import RLLoop


@pytest.mark.slow
def test_fully_async_on_one_shared_gpu(tiny_kit, tmp_path):
    config = rl_config(tiny_kit, tmp_path, "share-gpu", share_gpu=True)
    config.rollout.num_rollout = 3
    config.sync.async_mode = "fully"
    config.sync.max_policy_version_lag = 0  # every trained sample from the synced weights: the gap shows a sync
    loop = RLLoop(config, num_gpus=1)
    records = []
    try:
        loop.setup()
        plan = loop.placement.plan
        assert plan.share_gpu and plan.num_bundles == 1 and plan.engine_bundles == [plan.train_bundles]
        engines = ray.get(loop.manager.engines.remote())
        assert [e["devices"] for e in engines] == [[0]] and engines[0]["pid"]  # started by its EngineHost
        for rollout_id in range(loop.num_rollout):
            uri = loop.rollout(rollout_id)["uri"]
            loop.train(rollout_id, uri)
            loop.sync(rollout_id)
            records.append(loop.log_step(rollout_id))
    finally:
        loop.close()
    assert [r["weight_version"] for r in records] == [1, 2, 3]
    for r in records:
        assert r["async/staleness/max"] == 0 and r["sync/bytes"] > 0
        assert r["rl/logprob_abs_diff"] < 1e-4  # the engine sampled with the trainer's weights (tensor sync)
