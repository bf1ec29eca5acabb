"""The eval fleet of a fully async run (`cluster.eval_num_gpus`): evals that run beside training and
generation, on engines of their own, each pinned to one weight version.

    fleet = EvalFleet(config, placement.eval_fleet(), log_dir)   # a second RolloutManager actor
    ray.get(fleet.start())                                       # its engines and router
    ...the sync of an eval step pushes version v to fleet.begin_weight_update()'s URLs too...
    fleet.launch(rollout_id, v, checkpoint)                      # returns at once
    fleet.poll()            # each step: the evals that finished, as metrics lines (below)
    fleet.wait()            # before the next sync of the fleet, and at the last step

Why a fleet and weight sync, not the rollout engines: in fully async mode the rollout engines change
weights at every sync, so an eval on them is either pinned to a version by holding the next sync back
(the trainer waits for the eval: what `eval_num_gpus 0` does) or reads a mix of versions. miles runs its
evals on a fleet of their own against snapshots of the policy; slime's fully async rollout refuses eval
mode outright (THUDM/slime#2339). The fleet gets the weights through the same sync call as the rollout
engines (the trainer exports them once; no checkpoint needs committing at eval steps), and keeps them until
its eval ends: an eval still running when the next one is due is waited for before the fleet's weights
change (`perf/eval_fleet_wait_s`), so every due eval runs on exactly its version.

A result is a line of its own in metrics.jsonl, `{"rollout_id": r, "record": "eval", "eval/rollout_id": r,
"eval/weight_version": v, "eval/checkpoint": uri or None, "eval/<dataset>/...": ...}`, written when the eval
ends (after its step's line; `read_metrics` merges it into step r's record); an eval that ends before its
own step's line is merged into that line directly.
"""

from __future__ import annotations

import contextlib
import logging
import time
from pathlib import Path
from typing import Any

from slime.config import Config
from slime.ray.rollout_manager import RolloutManager

logger = logging.getLogger(__name__)

EVAL_RECORD = "eval"  # the "record" field of an eval line in metrics.jsonl
DISPOSE_TIMEOUT_S = 600.0


class EvalFleet:
    """A second rollout manager (engines and router of its own) that runs one eval at a time, in the
    background. Every method is called from the RL loop's thread."""

    def __init__(self, config: Config, placement: Any, log_dir: str) -> None:
        import ray

        # max_concurrency 2: `dispose` after an error must not queue behind a running eval
        self.actor = ray.remote(RolloutManager).options(**placement.manager_options(), max_concurrency=2).remote(
            config.model_dump(mode="json"), placement.engine_devices(), str(Path(log_dir) / "eval"),
            placement.engine_host_options(), gc_freeze=True)
        self.num_engines = len(placement.plan.engine_bundles)
        self.version: int | None = None  # of the weights the fleet holds (None: its HF checkpoint)
        self._running: dict[str, Any] | None = None  # the eval in flight: its key, ref and start

    def start(self) -> Any:
        """The ref of the actor's `start` (engines and router), to wait on beside the rollout manager's."""
        return self.actor.start.remote()

    @property
    def busy(self) -> bool:
        return self._running is not None

    def begin_weight_update(self) -> list[str]:
        """The fleet's engine URLs for a weight sync; only while no eval runs (`wait` first)."""
        import ray

        if self.busy:
            raise RuntimeError("EvalFleet: weights would change under a running eval (call wait first)")
        return ray.get(self.actor.begin_weight_update.remote())

    def end_weight_update(self, version: int | None) -> None:
        """After the sync (None: it failed): the fleet holds `version`."""
        import ray

        ray.get(self.actor.end_weight_update.remote(None if version is None else str(version)))
        if version is not None:
            self.version = version

    def launch(self, rollout_id: int, version: int, checkpoint: str | None) -> None:
        """Start the eval of weight `version` (synced to the fleet) and return; stored as eval step `version`."""
        if self.busy:
            raise RuntimeError("EvalFleet.launch: an eval is running already")
        if version != self.version:
            raise RuntimeError(f"EvalFleet.launch: the fleet holds weight version {self.version}, not {version}")
        self._running = {"key": {"rollout_id": rollout_id, "record": EVAL_RECORD, "eval/rollout_id": rollout_id,
                                 "eval/weight_version": version, "eval/checkpoint": checkpoint},
                         "ref": self.actor.eval.remote(version), "t0": time.monotonic()}
        logger.info("eval of weight version %d (rollout %d) launched on the eval fleet", version, rollout_id)

    def poll(self) -> list[dict[str, Any]]:
        """The finished eval's line ([] when none finished)."""
        import ray

        if not self.busy or not ray.wait([self._running["ref"]], timeout=0)[0]:
            return []
        return [self._collect()]

    def wait(self) -> tuple[list[dict[str, Any]], float]:
        """Block until the running eval ends: ([its line] or [], seconds waited)."""
        if not self.busy:
            return [], 0.0
        t0 = time.monotonic()
        line = self._collect()
        return [line], time.monotonic() - t0

    def _collect(self) -> dict[str, Any]:
        import ray

        running, self._running = self._running, None
        metrics = ray.get(running["ref"])  # raises the eval's error here
        metrics["perf/eval_wall_s"] = time.monotonic() - running["t0"]  # launch to collection
        logger.info("eval of weight version %d done", running["key"]["eval/weight_version"])
        return {**running["key"], "time": time.time(), **metrics}

    def dispose(self) -> None:
        """Stop the fleet's engines and router (a running eval is abandoned), then the actor."""
        import ray

        self._running = None
        try:
            ray.get(self.actor.dispose.remote(), timeout=DISPOSE_TIMEOUT_S)
        except Exception as exc:  # noqa: BLE001 - shutting down: report, go on
            logger.warning("eval fleet dispose failed (%s): engine processes may be left", exc)
        with contextlib.suppress(Exception):
            ray.kill(self.actor)
