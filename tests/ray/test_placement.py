"""Placement: the bundle layout per mode (pure logic), then the real placement group on a local Ray
cluster with 4 fake GPUs (one cluster for the module): which GPU each train rank and engine gets, and a
request the cluster cannot hold."""

from __future__ import annotations

import subprocess
import sys

import pytest

from slime.config import ClusterConfig
from slime.errors import ConfigError
from slime.ray.placement import (
    PlacementError,
    RayCluster,
    _kill_processes_of,
    create_placement,
    plan_placement,
)


def test_plan_decoupled_puts_engines_after_the_train_bundles():
    plan = plan_placement(ClusterConfig(actor_num_gpus_per_node=2, rollout_num_gpus=4,
                                        rollout_num_gpus_per_engine=2), use_gpu=True)
    assert plan.num_bundles == 6
    assert plan.train_bundles == [0, 1]
    assert plan.engine_bundles == [[2, 3], [4, 5]]
    assert plan.bundle == {"GPU": 1.0, "CPU": 1.0}


def test_plan_colocate_shares_bundles_from_zero():
    plan = plan_placement(ClusterConfig(actor_num_nodes=2, actor_num_gpus_per_node=2, colocate=True),
                          use_gpu=True)
    assert plan.num_bundles == 4  # rollout_num_gpus defaults to the train count
    assert plan.train_bundles == [0, 1, 2, 3]
    assert plan.engine_bundles == [[0], [1], [2], [3]]
    bigger = plan_placement(ClusterConfig(actor_num_gpus_per_node=2, rollout_num_gpus=4, colocate=True),
                            use_gpu=True)
    assert bigger.num_bundles == 4 and bigger.train_bundles == [0, 1]


def test_plan_cpu_mode_and_defaults():
    plan = plan_placement(ClusterConfig(actor_num_gpus_per_node=2), use_gpu=False)
    assert plan.bundle == {"CPU": 1.0}
    assert plan.num_bundles == 3  # decoupled, rollout_num_gpus unset: one engine
    assert plan.engine_bundles == [[2]]


def test_plan_share_gpu_puts_engine_e_beside_rank_e_with_fractions():
    plan = plan_placement(ClusterConfig(actor_num_gpus_per_node=2, share_gpu=True, rollout_gpu_fraction=0.3),
                          use_gpu=True)
    assert plan.num_bundles == 2 and not plan.colocate  # rollout_num_gpus defaults to the train count
    assert plan.train_bundles == [0, 1] and plan.engine_bundles == [[0], [1]]
    assert (plan.train_gpu, plan.engine_gpu) == (0.5, 0.3)
    assert plan.describe().startswith("shared GPUs, 2 GPU bundles")
    with pytest.raises(ConfigError, match=r"rollout_num_gpus 4 is more than the 2 train GPUs"):
        plan_placement(ClusterConfig(actor_num_gpus_per_node=2, rollout_num_gpus=4, share_gpu=True), use_gpu=True)


def test_plan_refuses_engines_that_do_not_divide():
    with pytest.raises(ConfigError, match="rollout_num_gpus 3 is not a multiple of rollout_num_gpus_per_engine 2"):
        plan_placement(ClusterConfig(rollout_num_gpus=3, rollout_num_gpus_per_engine=2), use_gpu=True)


def test_a_failed_local_start_leaves_no_process_behind(tmp_path):
    """The clean-up before a retry kills exactly the processes naming the private temp dir."""
    temp_dir = str(tmp_path / "slime-ray-x")
    ours = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)", temp_dir])
    other = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)",
                              str(tmp_path / "unrelated")])
    try:
        _kill_processes_of(temp_dir)
        assert ours.wait(timeout=30) != 0
        assert other.poll() is None
    finally:
        for proc in (ours, other):
            proc.kill()
            proc.wait()


@pytest.fixture(scope="module")
def fake_gpu_ray():
    cluster = RayCluster.connect(ClusterConfig(), num_cpus=8, num_gpus=4)
    try:
        yield cluster
    finally:
        cluster.shutdown()


def _gpu_of_actors(options: list[dict]) -> list[list[int]]:
    """GPU ids Ray gives an actor started with each of `options`."""
    import ray

    @ray.remote
    class Probe:
        def gpus(self) -> list[int]:
            return [int(g) for g in ray.get_gpu_ids()]

    actors = [Probe.options(**o).remote() for o in options]
    try:
        return ray.get([a.gpus.remote() for a in actors], timeout=120)
    finally:
        for a in actors:
            ray.kill(a)


def test_decoupled_ranks_and_engines_get_distinct_gpus(fake_gpu_ray):
    placement = create_placement(ClusterConfig(actor_num_gpus_per_node=2, rollout_num_gpus=2))
    try:
        train = _gpu_of_actors([placement.train_options(r) for r in range(2)])
        engines = placement.engine_devices()
        assert all(len(g) == 1 for g in train)
        assert engines == [[2], [3]]  # bundles sorted by GPU id: train on 0,1, engines after
        assert sorted(g for row in train + engines for g in row) == [0, 1, 2, 3]
        assert placement.manager_options()["num_gpus"] == 0
    finally:
        placement.remove()


def test_colocated_engines_share_the_train_gpus(fake_gpu_ray):
    placement = create_placement(ClusterConfig(actor_num_gpus_per_node=2, colocate=True))
    try:
        train = _gpu_of_actors([placement.train_options(r) for r in range(2)])
        assert placement.engine_devices() == train  # engine e shares rank e's GPU
        assert placement.train_options(0)["num_gpus"] < 1
    finally:
        placement.remove()


def test_shared_gpu_train_rank_and_engine_hold_parts_of_one_gpu(fake_gpu_ray):
    """share_gpu: train rank e and engine e's host ask Ray for 0.5 of the same bundle and get the same GPU id,
    both at once (resident side by side); Ray accounts both halves, so a third half of that GPU waits."""
    import ray

    placement = create_placement(ClusterConfig(actor_num_gpus_per_node=2, share_gpu=True))
    try:
        train_options = [placement.train_options(r) for r in range(2)]
        hosts = placement.engine_host_options()
        assert [o["num_gpus"] for o in train_options + hosts] == [0.5] * 4
        gpus = _gpu_of_actors(train_options + hosts)  # all four alive together
        assert gpus[:2] == gpus[2:] == placement.engine_devices()
        assert len({g[0] for g in gpus[:2]}) == 2  # two GPUs, one train rank and one engine on each
        assert placement.manager_options()["num_gpus"] == 0

        @ray.remote
        def third() -> list[int]:
            return [int(g) for g in ray.get_gpu_ids()]

        holders = [ray.remote(_Hold).options(**o).remote() for o in (train_options[0], hosts[0])]
        ray.get([h.ready.remote() for h in holders], timeout=120)
        extra = third.options(num_cpus=0.01, num_gpus=0.5, scheduling_strategy=train_options[0]["scheduling_strategy"])
        ref = extra.remote()
        assert ray.wait([ref], timeout=5)[1] == [ref]  # bundle 0's GPU is fully held
        for h in holders:
            ray.kill(h)
        assert ray.get(ref, timeout=60) == gpus[0]  # and it runs there once a holder is gone
    finally:
        placement.remove()


class _Hold:
    """An actor that only holds its resources."""

    def ready(self) -> bool:
        return True


def test_a_placement_that_does_not_fit_names_the_numbers(fake_gpu_ray):
    with pytest.raises(PlacementError, match=r"needs 6 GPU but the Ray cluster has 4"):
        create_placement(ClusterConfig(actor_num_gpus_per_node=4, rollout_num_gpus=2))
