"""Colocated placement end to end on fake GPUs (CPU machine, `num_gpus=2` in the local Ray): train ranks
and engines share the same 2 bundles; each step goes generate -> release engine memory -> onload the
trainer -> train -> offload the trainer -> resume engine memory -> weight sync (`auto` picks the
tensor mode when colocated) -> the next rollout's log-probs match the trainer's."""

from __future__ import annotations

import pytest
from rl_setup import check_first_step, rl_config, started_manager

from slime.ray.placement import RayCluster, create_placement
from slime.ray.train_group import TrainGroup


@pytest.mark.slow
def test_colocated_steps_with_offload_and_tensor_sync(tiny_kit, tmp_path):
    import ray

    config = rl_config(tiny_kit, tmp_path, "ray-colocate", actor_num_gpus_per_node=2, colocate=True)
    cluster = RayCluster.connect(config.cluster, num_gpus=2)
    try:
        placement = create_placement(config.cluster)
        assert placement.plan.use_gpu and placement.plan.num_bundles == 2
        assert placement.engine_devices() == [[0], [1]]
        with started_manager(config, placement, tmp_path / "logs") as manager:
            group = TrainGroup(config, placement)
            try:
                assert group.init() == 0
                steps, syncs = [], []
                for rollout_id in range(2):
                    uri, _ = ray.get(manager.generate.remote(rollout_id))
                    ray.get(manager.offload.remote())
                    group.onload()
                    steps.append(group.train(rollout_id, uri))
                    group.offload()
                    ray.get(manager.onload.remote())
                    syncs.append(group.update_weights(ray.get(manager.worker_urls.remote()), rollout_id + 1))
            finally:
                group.shutdown()
    finally:
        cluster.shutdown()
    for metrics in steps:
        check_first_step(metrics)  # step 2 passes only if the sync reached the engines
    assert all(s["sync/bytes"] > 0 for s in syncs)
