"""`cluster.ray_address`: join a Ray cluster this test starts with `ray start --head` (its own process
group, stopped by PID), place CPU bundles there, and leave the cluster running on shutdown."""

from __future__ import annotations

import shutil
import sys
import tempfile
import time
from pathlib import Path

import pytest

from slime.config import ClusterConfig
from slime.engines.process import ServerProcess
from slime.net import find_free_port
from slime.ray.placement import PlacementError, RayCluster, create_placement

HEAD_CPUS = 3


@pytest.fixture
def head(tmp_path, monkeypatch):
    """A one-node Ray cluster (3 CPUs, no GPU, auth off on both sides): its address. The head stops at once on
    SIGTERM: Ray's default first drains the node for up to 30 s (for Serve replicas), and the stop below would
    wait its whole timeout before the SIGKILL."""
    monkeypatch.setenv("RAY_AUTH_MODE", "disabled")
    port = find_free_port()
    temp_dir = tempfile.mkdtemp(prefix="slime-rayhead-", dir="/tmp")
    ray_cli = Path(sys.executable).parent / "ray"
    process = ServerProcess([ray_cli, "start", "--head", "--port", str(port), "--num-cpus", str(HEAD_CPUS),
                             "--num-gpus", "0", "--temp-dir", temp_dir, "--include-dashboard=false", "--block"],
                            log_path=tmp_path / "head.log", name="ray-head",
                            env={"RAY_AUTH_MODE": "disabled", "RAY_GRACEFUL_SHUTDOWN_DRAIN_TIMEOUT_S": "0"})
    process.start()
    try:
        deadline = time.monotonic() + 180
        while "will now block" not in process.log_tail(50):
            assert process.alive, process.log_tail()
            assert time.monotonic() < deadline, f"ray head not up after 180 s:\n{process.log_tail()}"
            time.sleep(1)
        yield process, f"127.0.0.1:{port}"
    finally:
        process.stop(timeout_s=20)
        shutil.rmtree(temp_dir, ignore_errors=True)
    assert not process.alive


def test_join_place_and_leave_the_cluster_running(head):
    import ray

    process, address = head
    cluster = RayCluster.connect(ClusterConfig(ray_address=address))
    try:
        assert not cluster.started
        assert ray.cluster_resources()["CPU"] == HEAD_CPUS and "GPU" not in ray.cluster_resources()
        placement = create_placement(ClusterConfig(actor_num_gpus_per_node=1, rollout_num_gpus=1))
        assert placement.plan.bundle == {"CPU": 1.0} and placement.plan.num_bundles == 2
        placement.remove()
        with pytest.raises(PlacementError, match=f"needs 5 CPU but the Ray cluster has {HEAD_CPUS}"):
            create_placement(ClusterConfig(actor_num_gpus_per_node=4, rollout_num_gpus=1))
    finally:
        cluster.shutdown()
    assert not ray.is_initialized()
    time.sleep(2)
    assert process.alive  # disconnecting does not stop a cluster we joined
