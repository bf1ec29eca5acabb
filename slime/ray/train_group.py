"""The train actor group: one `TrainActor` (a Megatron rank) per train bundle, called all together.

Every method calls all ranks and waits for them (a collective on the trainer side); results are the
ranks' small dicts, and since train metrics are global values every rank returns the same, the group
returns rank 0's. Rank 0 chooses the torch.distributed address (`tcp://its-node-ip:free-port`).
"""

from __future__ import annotations

import contextlib
import logging
from typing import Any

from slime.config import Config
from slime.errors import SlimeError
from slime.ray.placement import Placement
from slime.ray.train_actor import TrainActor

logger = logging.getLogger(__name__)


class TrainGroupError(SlimeError, RuntimeError):
    """The ranks of a train group disagree (e.g. on the rollout id to start from)."""


class TrainGroup:
    """`world_size` train actors placed on the placement's train bundles (default: all of them)."""

    def __init__(self, config: Config, placement: Placement, world_size: int | None = None,
                 remote_fields: dict[str, str] | None = None) -> None:
        self.world_size = world_size or len(placement.plan.train_bundles)
        if self.world_size > len(placement.plan.train_bundles):
            raise TrainGroupError(f"{self.world_size} train ranks asked for, the placement has "
                                  f"{len(placement.plan.train_bundles)} train bundles")
        self.config, self.placement = config, placement
        # the checkpoint fields' remote URLs when ranks stage them on their own nodes (node_staging.py)
        self.remote_fields = remote_fields
        self.actors = self._spawn()

    def _spawn(self) -> list[Any]:
        import ray

        config, placement = self.config, self.placement
        remote = ray.remote(TrainActor)
        payload = config.model_dump(mode="json")
        env = {"runtime_env": {"env_vars": dict(config.train.train_env_vars)}} if config.train.train_env_vars else {}
        return [remote.options(**placement.train_options(rank), **env).remote(payload, rank, self.world_size,
                                                                              self.remote_fields)
                for rank in range(self.world_size)]

    def _all(self, method: str, *args: Any, **kwargs: Any) -> list[Any]:
        """Call `method` on every rank; the first rank to fail raises at once (the others may be
        blocked in a collective waiting for it, so waiting for all would hang)."""
        import ray

        refs = [getattr(actor, method).remote(*args, **kwargs) for actor in self.actors]
        pending = list(refs)
        while pending:
            done, pending = ray.wait(pending, num_returns=1)
            ray.get(done)
        return ray.get(refs)

    def init(self) -> int:
        """Initialise every rank; the rollout id to start from (0, or the resumed checkpoint's + 1)."""
        import ray

        init_method = ray.get(self.actors[0].init_method.remote())
        starts = self._all("init", init_method)
        if len(set(starts)) != 1:
            raise TrainGroupError(f"train ranks would start at different rollout ids {starts}")
        logger.info("train group of %d ranks ready (%s), start rollout %d", self.world_size, init_method, starts[0])
        return starts[0]

    def extra_state(self) -> dict[str, Any]:
        """The `extra_state` of the checkpoint the group resumed from (rank 0's; {} on a fresh start)."""
        import ray

        return ray.get(self.actors[0].extra_state.remote())

    def train(self, rollout_id: int, uri: str) -> dict[str, float]:
        """Train on the rollout shard set `uri`; the global metrics."""
        return self._all("train", rollout_id, uri)[0]

    def save(self, rollout_id: int, extra_state: dict[str, Any] | None = None, wait: bool = True) -> str:
        """Checkpoint `rollout_id` (with `extra_state`, e.g. the data-source state); its path. With --async-save
        and not `wait`, it is committed in the background (`TrainActor.save`)."""
        return self._all("save", rollout_id, extra_state, wait)[0]

    def offload(self) -> list[dict[str, Any]]:
        return self._all("offload")

    def onload(self) -> list[dict[str, Any]]:
        return self._all("onload")

    def update_weights(self, urls: list[str], weight_version: int | str) -> dict[str, Any]:
        """Sync the weights into the engines at `urls` (see `TrainActor.update_weights`); the metrics."""
        return self._all("update_weights", urls, weight_version)[0]

    @property
    def released(self) -> bool:
        return not self.actors

    def release(self) -> None:
        """slime's --release-train: end the rank processes (their memory with them) until `recreate`."""
        self.shutdown()
        logger.info("train group released")

    def recreate(self, rollout_id: int) -> None:
        """New ranks after `release`, resumed from the newest committed checkpoint under `save`, which must be
        rollout `rollout_id - 1`'s (saved every rollout with --release-train)."""
        self.actors = self._spawn()
        start = self.init()
        if start != rollout_id:
            raise TrainGroupError(f"release_train: the recreated train ranks resume at rollout {start}, not "
                                  f"{rollout_id}: checkpoint {rollout_id - 1} is not the newest under save")

    def shutdown(self) -> None:
        """Close the weight syncer, then kill the actors (their processes end with them)."""
        import ray

        with contextlib.suppress(ray.exceptions.RayError, TimeoutError):  # a rank may be dead or stuck
            ray.get([actor.close.remote() for actor in self.actors], timeout=60)
        for actor in self.actors:
            ray.kill(actor)
        self.actors = []
