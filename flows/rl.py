"""Flow `rl`: the RL loop from the run's SFT checkpoint into `{store}/{run_id}/rl/`, one task per step.

    python -m flows.rl --config deployments/tiny-cpu.yaml [--run-id ID] [--model CKPT] [--num-rollout 2]

Without `--model` it starts from the run's newest committed `sft` checkpoint (else `convert`). The
stage task `rl` (tasks/rl.py) is cached like every stage; inside it one RLLoop drives task runs named
`rollout-0003`, `train-0003`, `save-0003`, `sync-0003`, `eval-0003`, and a failed run resumes from the
newest committed RL checkpoint. Artifacts: `<run>-rl-progress` (progress), `<run>-rl-metrics` (table per
iteration), `<run>-rl-report` (markdown with the reward/eval curve, also written to
`{store}/{run_id}/rl/reward_curve.png`).
"""

from __future__ import annotations

import base64
import sys
from typing import Any

from prefect import flow

from flows._cli import DEFAULT_CONFIG, main
from flows._plot import COLORS, line_chart
from flows._stage import newest_model, output_uri, resolve_run, run_name, run_stage
from slime.config import Config
from slime.rl import read_metrics
from slime.storage.fs import open_fs
from tasks.rl import OUTPUT_NAME, rl

CURVE_NAME = "reward_curve.png"
MODEL_STAGES = ("sft", "convert")


def reward_curve(records: dict[int, dict[str, Any]]) -> tuple[bytes, str]:
    """The PNG of rollout reward mean (and every eval dataset's mean reward) per iteration, and its caption."""
    series = {"rollout reward mean": [(i, r.get("rl/reward_mean")) for i, r in sorted(records.items())]}
    for i, record in sorted(records.items()):
        for key, value in record.items():
            if key.startswith("eval/") and key.endswith("/mean_reward"):
                series.setdefault(f"eval {key.split('/')[1]} mean reward", []).append((i, value))
    names = list(series)
    values = [v for s in series.values() for _, v in s if isinstance(v, int | float)]
    span = f"y from {min(values):.4f} to {max(values):.4f}" if values else "no values yet"
    legend = ", ".join(f"{name} (rgb{COLORS[n % len(COLORS)]})" for n, name in enumerate(names))
    caption = f"x: iteration {min(records, default=0)}..{max(records, default=0)}; {span}; {legend}"
    return line_chart([series[name] for name in names]), caption


def add_curve(summary: dict[str, Any], config: Config) -> None:
    """Draw the curve from the run's metrics log into the store and put it in the stage report."""
    options = config.run.storage_options
    records = read_metrics(summary["metrics"]["metrics_uri"], options)
    png, caption = reward_curve(records)
    uri = output_uri(config, summary["run_id"], "rl", CURVE_NAME)
    fs, path = open_fs(uri, options)
    fs.pipe_file(path, png)
    summary["figures"] = [{"title": "Reward per iteration", "uri": uri, "caption": caption,
                           "embed": "data:image/png;base64," + base64.b64encode(png).decode()}]


@flow(name="rl", flow_run_name=run_name("rl"))
def rl_flow(config: str = DEFAULT_CONFIG, overrides: list[str] | None = None, store: str | None = None,
            run_id: str | None = None, model: str | None = None) -> dict[str, Any]:
    """RL (GRPO/PPO per config) from `model` (default: the run's newest SFT checkpoint)."""
    cfg, run_id = resolve_run(config, overrides, store, run_id)
    cfg.require("checkpoint.hf_checkpoint", "data.prompt_data", stage="rl")
    inputs = {"load": model or newest_model(cfg, run_id, MODEL_STAGES), "prompt_data": cfg.data.prompt_data,
              "hf_checkpoint": cfg.checkpoint.hf_checkpoint}
    return run_stage(rl, cfg, run_id, inputs, output_uri(cfg, run_id, "rl", OUTPUT_NAME), decorate=add_curve)


if __name__ == "__main__":
    sys.exit(main(rl_flow, takes_model=True))
