"""W&B tracking of an RL run as slime offers it (`--use-wandb`, `--wandb-*`), beside the metrics.jsonl log,
TensorBoard and the Prefect artifacts.

Each step record (`slime.rl.metrics`) is logged once, with slime's metric names (rollout/*, train/*, eval/*,
perf/*, as the trainer and rollout produce them) and slime's step axes: `rollout/step` (the rollout id) for
rollout/*, perf/* and eval/* (a background eval's line, logged when it ends: its own step's rollout id), and `train/step` (optimizer steps so far) for train/*; with
`--wandb-always-use-train-step` every axis is the train step. The run is named as slime names it: group
`{wandb_group}_{6-char id}` (no suffix with `--disable-wandb-random-suffix`), name `{group}-RANK_0`; the
group defaults to the run id. `--wandb-mode offline` (or `WANDB_MODE=offline`, read by wandb itself)
writes the run under `{wandb_dir}/wandb/offline-run-*` for a later `wandb sync`. `--wandb-run-id` continues
that W&B run (resume "allow"). Departure: slime logs from every rank; here the driver logs the merged step.
"""

from __future__ import annotations

import logging
import os
import secrets
import string
from typing import Any

from slime.config import Config
from slime.errors import ConfigError

logger = logging.getLogger(__name__)

_ID_CHARS = string.ascii_lowercase + string.digits

# slime's step axes (its _init_wandb_common): metric glob -> step metric
STEP_AXES = {"train/*": "train/step", "rollout/*": "rollout/step", "multi_turn/*": "rollout/step",
             "passrate/*": "rollout/step", "perf/*": "rollout/step", "eval/*": "eval/step"}


def check_wandb(config: Config) -> None:
    """Fail before anything starts when W&B is asked for but cannot work."""
    if not config.run.use_wandb:
        return
    try:
        import wandb  # noqa: F401
    except ImportError:
        raise ConfigError("run.use_wandb (--use-wandb) is set but the 'wandb' package is not installed: "
                          "pip install wandb, or turn use_wandb off") from None


class WandbLogger:
    """One W&B run for one RL run: `log(record)` per step, `finish()` at the end."""

    def __init__(self, config: Config) -> None:
        import wandb

        r = config.run
        self.always_train_step = r.wandb_always_use_train_step
        self._train_steps = 1  # optimizer steps per rollout, from the last step record
        if r.wandb_mode != "offline" and r.wandb_key:
            wandb.login(key=r.wandb_key, host=r.wandb_host)
        group = r.wandb_group or r.run_id or "slime"
        if not r.disable_wandb_random_suffix and not r.wandb_run_id:
            group = f"{group}_{''.join(secrets.choice(_ID_CHARS) for _ in range(6))}"
        kwargs: dict[str, Any] = {"entity": r.wandb_team, "project": r.wandb_project, "group": group,
                                  "name": f"{group}-RANK_0", "config": config.model_dump(mode="json")}
        if r.wandb_mode:
            kwargs["mode"] = r.wandb_mode
        if r.wandb_dir:
            os.makedirs(r.wandb_dir, exist_ok=True)
            kwargs["dir"] = r.wandb_dir
        if r.wandb_run_id:
            kwargs.update(id=r.wandb_run_id, resume="allow")
        self.run = wandb.init(**kwargs)
        for axis in ("train/step", "rollout/step", "eval/step"):
            self.run.define_metric(axis)
        for pattern, axis in STEP_AXES.items():
            self.run.define_metric(pattern, step_metric=axis)
        logger.info("W&B run %s (%s) in %s", self.run.id, self.run.settings.mode, self.run.dir)

    def log(self, record: dict[str, Any]) -> None:
        """Log one step record's numbers with slime's step axes."""
        rollout_id = int(record["rollout_id"])
        if record.get("train/steps"):
            self._train_steps = int(record["train/steps"])
        train_step = rollout_id * self._train_steps  # every rollout has the same step count
        rollout_axis = train_step if self.always_train_step else rollout_id
        data = {k: v for k, v in record.items()
                if "/" in k and isinstance(v, int | float) and not isinstance(v, bool)}
        if record.get("record") == "eval":  # a background eval, ended after its step: eval/* at that step
            data = {k: v for k, v in data.items() if k.startswith("eval/")}
            data["eval/step"] = rollout_axis
        else:
            data.update({"train/step": train_step, "rollout/step": rollout_axis, "eval/step": rollout_axis})
        self.run.log(data)

    def finish(self) -> None:
        self.run.finish()
