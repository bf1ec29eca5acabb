"""`slime rl`: the RL loop on Ray, without Prefect (the Prefect flow wraps `RLLoop`'s steps).

    slime rl --config deployments/tiny-cpu.yaml [--async] [--update-weights-interval 2]
    python -m slime.rl --config ...

`run_rl` sets up the Ray cluster, placement, rollout manager and train group once, then runs
`RLLoop`'s steps for every rollout id from the start id (0, or the newest committed checkpoint's
id + 1 with its data-source state, so a rerun of the same config draws the same next batch) to
`num_rollout - 1`, and always stops what it started (errors, Ctrl-C and SIGTERM included).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from slime.config import Config
from slime.rl.loop import RLLoop
from slime.rl.metrics import read_metrics
from slime.signals import sigterm_as_exit
from slime.storage.staging import staged

__all__ = ["RLLoop", "read_metrics", "run_rl"]


def run_rl(config: Config, **loop_options: Any) -> dict[str, Any]:
    """Run (or resume) the RL loop to `num_rollout`; a summary with each step's record. Checkpoints in a
    remote store are staged locally and uploaded after each save (slime/storage/staging.py)."""
    with staged(config) as (local, staging):
        result = _run_rl(local, staging.publish, staging=staging, **loop_options)
    if result["last_checkpoint"]:
        result["last_checkpoint"] = staging.to_remote(result["last_checkpoint"])
    return result


def _run_rl(config: Config, after_save: Callable[[], Any], **loop_options: Any) -> dict[str, Any]:
    loop = RLLoop(config, **loop_options)
    steps: list[dict[str, Any]] = []
    with sigterm_as_exit():  # RLLoop.connect keeps it across ray.init
        try:
            setup = loop.setup()
            for rollout_id in range(loop.start_rollout_id, loop.num_rollout):
                loop.maybe_eval(rollout_id, before_train=True)
                rollout = loop.rollout(rollout_id)
                loop.train(rollout_id, rollout["uri"])
                if loop.maybe_save(rollout_id)["saved"]:
                    after_save()
                loop.sync(rollout_id)
                loop.maybe_eval(rollout_id)
                steps.append(loop.log_step(rollout_id))
        finally:
            loop.close()
    return {"run_id": config.run.run_id, "start_rollout_id": setup["start_rollout_id"],
            "num_rollout": loop.num_rollout, "resumed": setup["resumed"], "setup_s": setup["setup_s"],
            "worker_urls": setup["worker_urls"], "router_url": setup["router_url"],
            "last_checkpoint": loop.last_checkpoint, "metrics_uri": loop.metrics_uri, "steps": steps}
