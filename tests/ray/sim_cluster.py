"""A simulated multi-node Ray cluster on this machine (Ray's own `ray.cluster_utils.Cluster`): one raylet
per node, each with its own node id and CPUs, all in one private temp dir that is removed after.

The head node has no CPU (it is the driver's node: rollout manager and router go there, outside the
placement group); every other node has `cpus` CPUs, so a placement group of one-CPU bundles spreads
over them. Ray's `Cluster` writes its address to /tmp/ray/ray_current_cluster, where any `ray.init()`
without an address on this machine would find it: the file goes to the private temp dir instead.
"""

from __future__ import annotations

import contextlib
import functools
import os
import shutil
import tempfile
from collections.abc import Iterator
from typing import Any


@contextlib.contextmanager
def simulated_cluster(worker_cpus: list[int], *, object_store_bytes: int = 150 * 1024**2,
                      worker_env: list[dict[str, str]] | None = None) -> Iterator[Any]:
    """Start the head (0 CPUs) and one node per entry of `worker_cpus` (with the environment of the same entry
    of `worker_env`, which its raylet's workers inherit), connect this process; yield the `Cluster`;
    disconnect and stop every process it started (by the cluster's own handles, not by name)."""
    import ray
    import ray._private.utils as ray_utils
    from ray.cluster_utils import Cluster

    temp_dir = tempfile.mkdtemp(prefix="slime-sim-", dir="/tmp")  # short: Ray's socket paths are limited
    auth = os.environ.get("RAY_AUTH_MODE")
    os.environ["RAY_AUTH_MODE"] = auth or "disabled"
    write_address = ray_utils.write_ray_address
    ray_utils.write_ray_address = functools.partial(write_address, temp_dir=temp_dir)
    cluster = None
    try:
        node = {"temp_dir": temp_dir, "object_store_memory": object_store_bytes, "include_dashboard": False}
        cluster = Cluster(initialize_head=True, head_node_args={**node, "num_cpus": 0})
        for i, cpus in enumerate(worker_cpus):
            cluster.add_node(**node, num_cpus=cpus, **({"env_vars": worker_env[i]} if worker_env else {}))
        cluster.wait_for_nodes()
        ray.init(address=cluster.address, log_to_driver=False, _temp_dir=temp_dir)
        yield cluster
    finally:
        ray.shutdown()
        if cluster is not None:
            cluster.shutdown()
        ray_utils.write_ray_address = write_address
        if auth is None:
            os.environ.pop("RAY_AUTH_MODE", None)
        shutil.rmtree(temp_dir, ignore_errors=True)
