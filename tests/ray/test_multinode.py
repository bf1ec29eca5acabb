"""Placement over several Ray nodes, on a simulated cluster (`sim_cluster.py`: a CPU-less head node for
the driver plus two one-CPU nodes): train ranks and engines land on different nodes, the rollout
manager stays on the driver's node, each remote engine gets an `EngineHost` on its own node; and what
`check_across_nodes` refuses (loopback engines seen from another IP, disk sync through a private
directory, tensor sync away from the trainer), checked on hand-made layouts."""

from __future__ import annotations

import sys
import time
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))

from sim_cluster import simulated_cluster  # noqa: E402

from slime.config import ClusterConfig, Config  # noqa: E402
from slime.ray.placement import (  # noqa: E402
    Bundle,
    Placement,
    PlacementError,
    PlacementPlan,
    check_across_nodes,
    create_placement,
)


@pytest.fixture(scope="module")
def cluster():
    with simulated_cluster([1, 1]) as sim:
        yield sim


def node_of(options: dict) -> str:
    """The node id an actor started with `options` runs on."""
    import ray

    @ray.remote
    class Where:
        def node(self) -> str:
            return ray.get_runtime_context().get_node_id()

    actor = Where.options(**options).remote()
    try:
        return ray.get(actor.node.remote(), timeout=120)
    finally:
        ray.kill(actor)


def test_decoupled_train_and_engines_on_different_nodes_manager_on_the_driver(cluster):
    import ray

    from slime.engines.host import EngineHost

    driver = ray.get_runtime_context().get_node_id()
    placement = create_placement(ClusterConfig(actor_num_gpus_per_node=1, rollout_num_gpus=1))
    try:
        train_node = placement.bundles[placement.plan.train_bundles[0]].node_id
        [engine_node] = placement.engine_nodes()
        assert len({driver, train_node, engine_node}) == 3  # the head has no CPU: no bundle there
        assert placement.remote_engines and placement.driver_node_id == driver
        assert node_of(placement.manager_options()) == driver  # rollout manager and router with the driver
        assert node_of(placement.train_options(0)) == train_node
        [host_options] = placement.engine_host_options()
        host = ray.remote(EngineHost).options(**host_options).remote(Config().model_dump(mode="json"))
        try:
            assert ray.get(host.node_id.remote(), timeout=120) == engine_node
        finally:
            ray.kill(host)
    finally:
        placement.remove()


def test_colocated_engines_one_per_node_with_their_train_rank(cluster):
    placement = create_placement(ClusterConfig(actor_num_gpus_per_node=2, colocate=True))
    try:
        train = [placement.bundles[b].node_id for b in placement.plan.train_bundles]
        assert len(set(train)) == 2  # one rank per node
        assert placement.engine_nodes() == train  # engine e shares rank e's bundle, so its node
        assert len(placement.engine_host_options()) == 2
    finally:
        placement.remove()


def test_an_engine_whose_bundles_span_nodes_is_refused(cluster):
    import ray

    with pytest.raises(PlacementError, match="engine 0's 2 bundles span nodes"):
        create_placement(ClusterConfig(actor_num_gpus_per_node=2, colocate=True, rollout_num_gpus_per_engine=2))
    deadline = time.monotonic() + 30  # the refused group is removed (Ray reports it freed a little later)
    while ray.available_resources().get("CPU") != 2 and time.monotonic() < deadline:
        time.sleep(0.2)
    assert ray.available_resources().get("CPU") == 2


def layout(train_ip: str, engine_ip: str, *, driver_ip: str = "10.0.0.1") -> Placement:
    """A decoupled one-rank, one-engine placement on two nodes, written out (no Ray)."""
    plan = PlacementPlan(colocate=False, use_gpu=True, num_bundles=2, train_bundles=[0], engine_bundles=[[1]])
    return Placement(plan=plan, group=None, bundles=[Bundle(0, train_ip, [0], "train-node"),
                                                     Bundle(1, engine_ip, [0], "engine-node")],
                     driver_node_id="train-node", driver_node_ip=driver_ip)


def rl(**sections) -> Config:
    return Config.model_validate(sections)


def test_engines_bound_to_loopback_on_another_ip_are_refused():
    with pytest.raises(PlacementError, match=r"engine 0 runs on node 10.0.0.2 but binds engine.engine_host "
                                             r"127.0.0.1.*set engine.engine_host 0.0.0.0"):
        check_across_nodes(rl(), layout("10.0.0.1", "10.0.0.2"))
    check_across_nodes(rl(engine={"engine_host": "0.0.0.0"}), layout("10.0.0.1", "10.0.0.2"))
    check_across_nodes(rl(), layout("10.0.0.1", "10.0.0.1"))  # simulated nodes: one IP, loopback reaches


def test_disk_sync_across_nodes_needs_a_shared_directory():
    across = layout("10.0.0.1", "10.0.0.2")
    wide = {"engine_host": "0.0.0.0"}
    with pytest.raises(PlacementError, match=r"disk: engines \[0\] are on other nodes than train rank 0.*"
                                             r"sync.update_weight_disk_dir"):
        check_across_nodes(rl(engine=wide, sync={"weight_sync_mode": "disk"}), across)
    check_across_nodes(rl(engine=wide, sync={"weight_sync_mode": "disk", "update_weight_disk_dir": "/shared/w"}),
                       across)
    check_across_nodes(rl(engine=wide), across)  # auto, decoupled: distributed crosses nodes


def test_tensor_sync_only_on_the_trainers_node():
    with pytest.raises(PlacementError, match="tensor: engines \\[0\\] are on other nodes.*use weight_sync_mode "
                                             "distributed"):
        check_across_nodes(rl(engine={"engine_host": "0.0.0.0"}, sync={"weight_sync_mode": "tensor"}),
                           layout("10.0.0.1", "10.0.0.2"))
    same = layout("10.0.0.1", "10.0.0.1")
    same.bundles[1] = same.bundles[1]._replace(node_id="train-node")
    check_across_nodes(rl(sync={"weight_sync_mode": "tensor"}), same)


def test_one_node_placements_are_not_checked():
    one = layout("", "")
    one.bundles = [Bundle(0, "", []), Bundle(1, "", [])]  # CPU, one node: not probed
    check_across_nodes(rl(sync={"weight_sync_mode": "tensor"}), one)


def test_checkpoints_staged_on_the_driver_need_node_staging_for_train_ranks_on_another_ip(tmp_path):
    staging = tmp_path / "staging"
    config = rl(engine={"engine_host": "0.0.0.0"},
                run={"staging_dir": str(staging)}, checkpoint={"save": str(staging / "ab12-checkpoint")})
    with pytest.raises(PlacementError, match=r"staged on the driver's machine \(10.0.0.1.*train ranks run on "
                                             r"\['10.0.0.3'\]: this caller does not stage them.*set checkpoint.save"):
        check_across_nodes(config, layout("10.0.0.3", "10.0.0.2"))
    check_across_nodes(config, layout("10.0.0.3", "10.0.0.2"), node_staging=True)  # ranks stage on their nodes
    check_across_nodes(config, layout("10.0.0.1", "10.0.0.2"))  # the train rank on the driver's machine
    lora = config.model_copy(update={"lora": config.lora.model_copy(update={"lora_rank": 4})})
    with pytest.raises(PlacementError, match=r"train ranks run on \['10.0.0.3'\]: LoRA stages on the driver only"):
        check_across_nodes(lora, layout("10.0.0.3", "10.0.0.2"))


def test_engines_on_another_ip_cannot_read_a_staged_hf_checkpoint(tmp_path):
    staging = tmp_path / "staging"
    config = rl(engine={"engine_host": "0.0.0.0"},
                run={"staging_dir": str(staging)}, checkpoint={"hf_checkpoint": str(staging / "cd34-hf")})
    with pytest.raises(PlacementError, match=r"hf_checkpoint of the remote store is staged on the driver's machine "
                                             r"\(10.0.0.1.*engines run on \['10.0.0.2'\]"):
        check_across_nodes(config, layout("10.0.0.1", "10.0.0.2"), node_staging=True)
    check_across_nodes(config, layout("10.0.0.2", "10.0.0.1"), node_staging=True)  # the train rank stages its own
