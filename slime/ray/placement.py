"""One Ray placement group for the whole RL run, and which bundle each train rank and engine gets.

Layout (slime's `slime/ray/placement_group.py`, re-derived): one bundle per GPU, `{"GPU": 1, "CPU": 1}`,
or `{"CPU": 1}` when the Ray cluster has no GPU at all (CPU mode: same layout, CPU bundles).

    decoupled   bundles = train + rollout; train ranks on bundles [0, train), engines after them
    colocate    bundles = max(train, rollout); train ranks and engines both start at bundle 0
    share_gpu   bundles = train; engine e on bundle e, beside train rank e, both resident
    eval fleet  cluster.eval_num_gpus more bundles after all of the above, for the eval engines (fully async)

with train = actor_num_nodes x actor_num_gpus_per_node and rollout = rollout_num_gpus (None: the train
count when colocated, one engine's worth otherwise), cut into engines of rollout_num_gpus_per_engine.
Train actors take 0.4 of their bundle (so a colocated engine and the rollout manager fit beside them);
the rollout manager takes 0.1 CPU of the first engine's bundle and starts the engine servers itself,
with `CUDA_VISIBLE_DEVICES` set to the GPUs of each engine's bundles (found by probing the bundles, in
(node, GPU id) order as slime sorts them).

Shared GPUs (`cluster.share_gpu`, on GPUs): a train actor asks Ray for `train_gpu_fraction` of its bundle's
GPU, and each engine is started by an `EngineHost` actor in its first bundle that asks for
`rollout_gpu_fraction` of it (Ray then accounts both halves and refuses a third claimant), so the two
share the GPU id; their memory is capped to the same fractions (the train rank's torch allocator, the
engine's `--mem-fraction-static`, `engine_memory_args`).

Several nodes: bundles are probed on the CPU too and sorted by (node IP, node id, GPU id), so train
ranks fill the first nodes and engines the following ones (colocated: the same bundles, per node).
When every engine is on the driver's node the rollout manager sits in the first engine's bundle and
starts the engines itself (the one-node layout). Otherwise it runs on the driver's node (with the
router, as slime's), and each engine is started by an `EngineHost` actor in that engine's first bundle
(`engine_host_options`); an engine's own bundles must share a node. `check_across_nodes` refuses what
cannot work across nodes: engines bound to 127.0.0.1 on another IP than the router, disk weight sync
to another node through a private directory, tensor sync outside the trainer's node.

`RayCluster` joins `cluster.ray_address` or starts a private local Ray (own temp dir, dashboard off,
`RAY_AUTH_MODE=disabled` unless the environment says otherwise; its workers get the driver's `sys.path`
so dotted plugin paths resolve in actors as in the driver) and shuts down only what it started.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import shutil
import sys
import tempfile
import time
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import psutil

from slime.errors import ConfigError

logger = logging.getLogger(__name__)

TRAIN_SHARE = 0.4  # of a bundle's GPU and CPU, per train actor
MANAGER_CPU = 0.1  # of the first engine's bundle, for the rollout manager
PROBE_SHARE = 0.01
HOST_CPU = 0.05  # of an engine's first bundle, for the EngineHost that starts it on another node
LOOPBACK = ("127.0.0.1", "localhost", "::1")
LOCAL_OBJECT_STORE_BYTES = 256 * 1024**2  # only URIs and small dicts travel through Ray
LOCAL_START_ATTEMPTS = 3


class PlacementError(ConfigError):
    """The Ray cluster cannot hold the requested placement; the message names the numbers."""


@dataclass(frozen=True)
class PlacementPlan:
    """Which logical bundle serves which train rank and which engine (pure logic, no Ray)."""

    colocate: bool
    use_gpu: bool
    num_bundles: int
    train_bundles: list[int]
    engine_bundles: list[list[int]]
    share_gpu: bool = False
    train_gpu: float = TRAIN_SHARE  # of its bundle's GPU, per train actor
    engine_gpu: float = 0.0  # of its first bundle's GPU, claimed for each engine by its EngineHost (share_gpu)
    eval_engine_bundles: list[list[int]] = field(default_factory=list)  # the eval fleet's (cluster.eval_num_gpus)

    @property
    def bundle(self) -> dict[str, float]:
        return {"GPU": 1.0, "CPU": 1.0} if self.use_gpu else {"CPU": 1.0}

    def describe(self) -> str:
        mode = "colocate" if self.colocate else "shared GPUs" if self.share_gpu else "decoupled"
        kind = "GPU" if self.use_gpu else "CPU"
        evals = f", {len(self.eval_engine_bundles)} eval engines" if self.eval_engine_bundles else ""
        return (f"{mode}, {self.num_bundles} {kind} bundles: {len(self.train_bundles)} train ranks, "
                f"{len(self.engine_bundles)} engines of {len(self.engine_bundles[0]) if self.engine_bundles else 0}"
                f"{evals}")


def plan_placement(cluster: Any, use_gpu: bool) -> PlacementPlan:
    """The bundle layout that `cluster` (a `ClusterConfig`) asks for (see the module docstring)."""
    train, rollout = cluster.train_gpus, cluster.rollout_gpus
    per_engine = cluster.rollout_num_gpus_per_engine
    if rollout % per_engine:
        raise ConfigError(f"cluster.rollout_num_gpus {rollout} is not a multiple of rollout_num_gpus_per_engine "
                          f"{per_engine}")
    if cluster.share_gpu and rollout > train:
        raise ConfigError(f"cluster.share_gpu puts every engine on a train rank's GPU, but rollout_num_gpus {rollout} "
                          f"is more than the {train} train GPUs (actor_num_nodes x actor_num_gpus_per_node): lower "
                          "rollout_num_gpus or add train ranks")
    if cluster.same_gpus:
        num_bundles, offset = max(train, rollout), 0
    else:
        num_bundles, offset = train + rollout, train
    engines = [list(range(offset + e * per_engine, offset + (e + 1) * per_engine)) for e in range(rollout // per_engine)]
    # the eval fleet: bundles of its own after every other (never shared: its weights differ from the rollout's)
    evals = [list(range(num_bundles + e * per_engine, num_bundles + (e + 1) * per_engine))
             for e in range(cluster.eval_num_gpus // per_engine)]
    num_bundles += cluster.eval_num_gpus
    shares: dict[str, float] = {}
    if cluster.share_gpu:
        train_gpu, engine_gpu = cluster.gpu_fractions()
        shares = {"share_gpu": True, "train_gpu": train_gpu, "engine_gpu": engine_gpu}
    return PlacementPlan(colocate=cluster.colocate, use_gpu=use_gpu, num_bundles=num_bundles,
                         train_bundles=list(range(train)), engine_bundles=engines, eval_engine_bundles=evals,
                         **shares)


# ----------------------------------------------------------------------------- cluster


@dataclass
class RayCluster:
    """A connection to Ray: a joined cluster (`address`) or a local one this process started."""

    address: str | None = None
    started: bool = False
    temp_dir: str | None = None

    @classmethod
    def connect(cls, cluster: Any, *, num_cpus: int | None = None, num_gpus: int | None = None) -> RayCluster:
        """Join `cluster.ray_address` (a `ClusterConfig`), or start a private local cluster with `num_gpus`
        (default: this machine's; fake GPUs work for placement tests) and `num_cpus` (default: enough
        logical CPUs for the placement plus the rollout manager, at least this machine's cores)."""
        import ray

        if ray.is_initialized():
            raise ConfigError("Ray is already initialised in this process; call RayCluster.connect once "
                              "(and shutdown() the previous one)")
        address = cluster.ray_address
        t0 = time.monotonic()
        if address:
            ray.init(address=address, log_to_driver=False)
            logger.info("joined the Ray cluster at %s in %.1f s", address, time.monotonic() - t0)
            return cls(address=address)
        os.environ.setdefault("RAY_AUTH_MODE", "disabled")  # a private dev cluster (research/prefect.md)
        if num_gpus is None:
            import torch

            num_gpus = torch.cuda.device_count()
        if num_cpus is None:
            num_cpus = max(os.cpu_count() or 1, plan_placement(cluster, use_gpu=num_gpus > 0).num_bundles + 1)
        for attempt in range(1, LOCAL_START_ATTEMPTS + 1):
            temp_dir = tempfile.mkdtemp(prefix="slime-ray-", dir="/tmp")  # short: Ray's socket paths are limited
            try:
                # actors import what this driver can (plugins given as dotted paths): same sys.path
                path = os.pathsep.join(p for p in sys.path if p)
                ray.init(num_cpus=num_cpus, num_gpus=num_gpus, _temp_dir=temp_dir, include_dashboard=False,
                         object_store_memory=LOCAL_OBJECT_STORE_BYTES, log_to_driver=False,
                         runtime_env={"env_vars": {"PYTHONPATH": path}})
                break
            except Exception as exc:
                # Ray gives its raylet a hard-coded 30 s to register; an overloaded machine misses that
                ray.shutdown()
                _kill_processes_of(temp_dir)
                shutil.rmtree(temp_dir, ignore_errors=True)
                if attempt == LOCAL_START_ATTEMPTS:
                    raise
                logger.warning("local Ray start %d/%d failed (%s); retrying", attempt, LOCAL_START_ATTEMPTS, exc)
        logger.info("started a local Ray cluster (%s CPUs, %s GPUs, temp dir %s) in %.1f s", num_cpus, num_gpus,
                    temp_dir, time.monotonic() - t0)
        return cls(started=True, temp_dir=temp_dir)

    def shutdown(self) -> None:
        """Disconnect; a local cluster this process started is stopped and its temp dir removed."""
        import ray

        if ray.is_initialized():
            ray.shutdown()  # stops only the processes of the cluster this driver started
        if self.started and self.temp_dir:
            shutil.rmtree(self.temp_dir, ignore_errors=True)


def _kill_processes_of(temp_dir: str) -> None:
    """Kill, by PID, the Ray processes a failed start left behind: they name our private temp dir."""

    for proc in psutil.process_iter(["pid", "cmdline"]):
        try:
            if any(temp_dir in arg for arg in proc.info["cmdline"] or []):
                proc.kill()
        except psutil.Error:
            continue


# ----------------------------------------------------------------------------- placement group


class Bundle(NamedTuple):
    """Where one logical bundle is: its index in the placement group, node IP, GPU ids, node id."""

    index: int
    node_ip: str
    gpus: list[int]
    node_id: str = ""


@dataclass
class Placement:
    """The created placement group, per logical bundle its `Bundle`, and the driver's node."""

    plan: PlacementPlan
    group: Any
    bundles: list[Bundle] = field(default_factory=list)
    driver_node_id: str = ""
    driver_node_ip: str = ""

    def _strategy(self, logical: int) -> Any:
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        return PlacementGroupSchedulingStrategy(placement_group=self.group,
                                                placement_group_bundle_index=self.bundles[logical].index)

    def train_options(self, rank: int) -> dict[str, Any]:
        """Ray actor options of train rank `rank`: its share of its bundle."""
        gpus = self.plan.train_gpu if self.plan.use_gpu else 0
        return {"num_cpus": TRAIN_SHARE, "num_gpus": gpus,
                "scheduling_strategy": self._strategy(self.plan.train_bundles[rank])}

    def engine_nodes(self) -> list[str]:
        """Node id of each engine ("" when not probed: one node)."""
        return [self.bundles[engine[0]].node_id for engine in self.plan.engine_bundles]

    @property
    def remote_engines(self) -> bool:
        """True when some engine is on another node than the driver (the rollout manager stays with the driver)."""
        return any(node and node != self.driver_node_id for node in self.engine_nodes())

    @property
    def remote_train(self) -> bool:
        """True when some train rank is on another node than the driver (it cannot read the driver's staged
        checkpoints: it stages its own, slime/storage/node_staging.py)."""
        return any(node and node != self.driver_node_id
                   for node in (self.bundles[b].node_id for b in self.plan.train_bundles))

    def manager_options(self) -> dict[str, Any]:
        """Ray actor options of the rollout manager: a little CPU in the first engine's bundle, or, when
        engines are on other nodes, the driver's node (no CPU claimed: it waits on HTTP, and the driver's
        node may have none left outside the placement group)."""
        if self.remote_engines:
            from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

            return {"num_cpus": 0, "num_gpus": 0,
                    "scheduling_strategy": NodeAffinitySchedulingStrategy(self.driver_node_id, soft=False)}
        logical = self.plan.engine_bundles[0][0] if self.plan.engine_bundles else 0
        return {"num_cpus": MANAGER_CPU, "num_gpus": 0, "scheduling_strategy": self._strategy(logical)}

    def engine_host_options(self) -> list[dict[str, Any] | None] | None:
        """Per engine, the Ray actor options of the `EngineHost` that starts it on its node (and, sharing GPUs,
        holds the engine's part of its GPU); None when the rollout manager starts every engine itself."""
        claim = self.plan.engine_gpu if self.plan.use_gpu else 0.0
        if not self.remote_engines and not claim:
            return None
        return [{"num_cpus": HOST_CPU, "num_gpus": claim, "scheduling_strategy": self._strategy(engine[0])}
                for engine in self.plan.engine_bundles]

    def engine_devices(self) -> list[list[int]]:
        """GPU ids (as the node numbers them) of each engine; empty lists in CPU mode."""
        return [[gpu for b in engine for gpu in self.bundles[b].gpus] for engine in self.plan.engine_bundles]

    def eval_fleet(self) -> Placement:
        """The same placement seen from the eval fleet: its engines are `eval_engine_bundles`, whole bundles
        (no GPU sharing), so `manager_options`, `engine_host_options` and `engine_devices` place a second
        rollout manager and its engines there. Do not `remove` it: the group is the run's."""
        plan = dataclasses.replace(self.plan, engine_bundles=self.plan.eval_engine_bundles, eval_engine_bundles=[],
                                   share_gpu=False, engine_gpu=0.0)
        return dataclasses.replace(self, plan=plan)

    def remove(self) -> None:
        from ray.util.placement_group import remove_placement_group

        remove_placement_group(self.group)


def _check_fits(plan: PlacementPlan) -> None:
    """Refuse, naming the numbers, a plan that the cluster's totals cannot hold."""
    import ray

    total, free = ray.cluster_resources(), ray.available_resources()
    for resource, need in plan.bundle.items():
        need_total = need * plan.num_bundles
        if total.get(resource, 0) < need_total:
            raise PlacementError(
                f"placement ({plan.describe()}) needs {need_total:g} {resource} but the Ray cluster has "
                f"{total.get(resource, 0):g} ({free.get(resource, 0):g} free); lower actor_num_nodes x "
                "actor_num_gpus_per_node / rollout_num_gpus, use colocate, or add nodes")


def _probe(placement: Placement, timeout_s: float) -> list[Bundle]:
    """Where every bundle is, sorted by node (IP, then id: simulated nodes share an IP) and first GPU id."""
    import ray
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    @ray.remote
    def where() -> tuple[str, list[int], str]:
        return (ray.util.get_node_ip_address(), [int(g) for g in ray.get_gpu_ids()],
                ray.get_runtime_context().get_node_id())

    extra = {"num_gpus": PROBE_SHARE} if placement.plan.use_gpu else {}
    refs = [where.options(num_cpus=PROBE_SHARE, **extra, scheduling_strategy=PlacementGroupSchedulingStrategy(
        placement_group=placement.group, placement_group_bundle_index=i)).remote()
        for i in range(placement.plan.num_bundles)]
    found = ray.get(refs, timeout=timeout_s)
    rows = [Bundle(i, ip, gpus, node) for i, (ip, gpus, node) in enumerate(found)]
    return sorted(rows, key=lambda b: (b.node_ip, b.node_id, b.gpus[0] if b.gpus else b.index))


def create_placement(cluster: Any, *, timeout_s: float = 120.0) -> Placement:
    """Create the placement group for `cluster` (a `ClusterConfig`) in the connected Ray cluster.

    Raises `PlacementError` when the cluster is too small, or the group is not ready in `timeout_s`
    (e.g. the GPUs exist but are held by others), naming requested and available resources.
    """
    import ray
    from ray.util.placement_group import placement_group, remove_placement_group

    plan = plan_placement(cluster, use_gpu=ray.cluster_resources().get("GPU", 0) > 0)
    _check_fits(plan)
    group = placement_group([plan.bundle] * plan.num_bundles, strategy="PACK")
    try:
        ray.get(group.ready(), timeout=timeout_s)
    except ray.exceptions.GetTimeoutError:
        remove_placement_group(group)
        raise PlacementError(f"placement ({plan.describe()}) was not granted within {timeout_s:.0f} s; free "
                             f"resources now: {ray.available_resources()}") from None
    context = ray.get_runtime_context()
    placement = Placement(plan=plan, group=group, driver_node_id=context.get_node_id(),
                          driver_node_ip=ray.util.get_node_ip_address())
    if plan.use_gpu or len([n for n in ray.nodes() if n["Alive"]]) > 1:
        placement.bundles = _probe(placement, timeout_s)
    else:  # CPU bundles of one node are interchangeable: no probe
        placement.bundles = [Bundle(i, "", []) for i in range(plan.num_bundles)]
    for e, engine in enumerate(plan.engine_bundles + plan.eval_engine_bundles):
        nodes = {placement.bundles[b].node_id for b in engine}
        if len(nodes) > 1:
            placement.remove()
            raise PlacementError(f"engine {e}'s {len(engine)} bundles span nodes {sorted(nodes)}; one engine "
                                 "runs on one node: lower rollout_num_gpus_per_engine to at most the GPUs per node")
    nodes = sorted({b.node_id for b in placement.bundles if b.node_id})
    logger.info("placement group ready: %s%s", plan.describe(),
                f", over {len(nodes)} nodes" + (" (engines on other nodes than the driver)"
                                                if placement.remote_engines else "") if len(nodes) > 1 else "")
    return placement


def _check_staged_checkpoints(config: Any, placement: Placement, node_staging: bool) -> None:
    """Checkpoints of a remote store are staged on the driver's machine (slime/storage/staging.py). Train
    ranks on other machines stage their own copies and upload their saves from there when the loop hands
    them the remote URLs (`node_staging`: slime/storage/node_staging.py, not for LoRA); what still reads
    the driver's copies cannot run elsewhere: engines given a staged `hf_checkpoint`, and LoRA."""
    from slime.storage.staging import staging_root

    root = os.path.abspath(staging_root(config))
    ck = config.checkpoint

    def is_staged(path: str | None) -> bool:
        return bool(path) and "://" not in path and os.path.abspath(path).startswith(root + os.sep)

    engines_away = sorted({placement.bundles[e[0]].node_ip for e in placement.plan.engine_bundles}
                          - {placement.driver_node_ip})
    if is_staged(ck.hf_checkpoint) and engines_away:
        raise PlacementError(f"checkpoint.hf_checkpoint of the remote store is staged on the driver's machine "
                             f"({placement.driver_node_ip}, {root}), but engines run on {engines_away} and read it "
                             "there: give --hf-checkpoint as a directory every engine node has (a local copy or a "
                             "shared file system)")
    staged = [p for p in (ck.save, ck.load, ck.ref_load, ck.opd_teacher_load, ck.hf_checkpoint) if is_staged(p)]
    away = sorted({placement.bundles[b].node_ip for b in placement.plan.train_bundles} - {placement.driver_node_ip})
    if not staged or not away:
        return
    if not node_staging:
        why = ("LoRA stages on the driver only (a LoRA checkpoint records its base as a local path of the machine "
               "that saved it)" if config.lora.lora_rank > 0 else
               "this caller does not stage them on the train ranks' nodes (`slime rl` and the rl task do)")
        raise PlacementError(f"checkpoints of the remote store are staged on the driver's machine "
                             f"({placement.driver_node_ip}, {root}), but train ranks run on {away}: {why}; set "
                             "checkpoint.save (--save) and --load to a file system every node mounts")


def check_across_nodes(config: Any, placement: Placement, node_staging: bool = False) -> None:
    """Refuse, before anything starts, a layout that cannot work across nodes (`config` a `Config`):

    * engines bound to a loopback address on another IP than the driver's (the router there cannot
      reach them): set `engine.engine_host` 0.0.0.0;
    * disk weight sync from trainer rank 0 to an engine on another node through a directory the run
      made itself (a private temporary directory): name a shared one in `sync.update_weight_disk_dir`
      (and, for delta sync, `update_weight_local_checkpoint_dir`), or sync `distributed`;
    * tensor sync to an engine on another node than trainer rank 0 (it hands over shared-memory or
      CUDA IPC handles, which only that node can open): use `distributed`.
    """
    from slime.sync.syncer import resolve_mode

    engine_nodes = placement.engine_nodes()
    if not placement.plan.engine_bundles or not any(engine_nodes):
        return  # one node, or nothing to reach
    host = config.engine.engine_host
    for e, engine in enumerate(placement.plan.engine_bundles):
        ip = placement.bundles[engine[0]].node_ip
        if host in LOOPBACK and ip != placement.driver_node_ip:
            raise PlacementError(f"engine {e} runs on node {ip} but binds engine.engine_host {host}, which the router "
                                 f"on the driver's node {placement.driver_node_ip} cannot reach: set engine.engine_host "
                                 "0.0.0.0 (--engine-host)")
    _check_staged_checkpoints(config, placement, node_staging)
    if config.run.debug_rollout_only or config.run.debug_train_only:
        return  # no weight sync
    trainer = placement.bundles[placement.plan.train_bundles[0]].node_id
    away = [e for e, node in enumerate(engine_nodes) if node != trainer]
    if not away:
        return
    mode = resolve_mode(config.sync, config.cluster.same_gpus)
    where = f"engines {away} are on other nodes than train rank 0"
    if mode == "tensor":
        raise PlacementError(f"sync.weight_sync_mode tensor: {where}; tensor sync hands over shared-memory or CUDA "
                             "IPC handles that only the trainer's node can open: use weight_sync_mode distributed")
    if mode == "adapter" and config.sync.update_weight_disk_dir is None:
        raise PlacementError(f"sync.lora_sync adapter: {where}, and the adapters would go to a temporary directory "
                             "of the trainer's node that they cannot read: set sync.update_weight_disk_dir to a "
                             "directory every node mounts (a shared file system), or use lora_sync merged")
    if mode == "disk" and config.sync.update_weight_disk_dir is None:
        raise PlacementError(f"sync.weight_sync_mode disk: {where}, and the weights would go to a temporary "
                             "directory of the trainer's node that they cannot read: set sync.update_weight_disk_dir "
                             "to a directory every node mounts (a shared file system), or use weight_sync_mode "
                             "distributed")
