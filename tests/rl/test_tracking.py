"""W&B (offline) and TensorBoard tracking of an RL run, with slime's metric names and step axes: the
W&B logger alone, then a tiny-kit RL run with both on, checked from the files they wrote."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "ray"))  # rl_setup, ray_plugins (before Ray starts)

from rl_setup import rl_config  # noqa: E402
from wandb_offline import read_offline_run  # noqa: E402

from slime.config import load_config  # noqa: E402
from slime.errors import ConfigError  # noqa: E402
from slime.rl import read_metrics, run_rl  # noqa: E402
from slime.rl.tracking import WandbLogger, check_wandb  # noqa: E402

RECORDS = [{"rollout_id": 0, "train/steps": 2.0, "train/ppo_kl": 0.0, "rollout/raw_reward": 0.25,
            "eval/tiny/mean_reward": 0.5, "perf/train_time": 1.5, "weight_version": 1, "async": False},
           {"rollout_id": 1, "train/steps": 2.0, "train/ppo_kl": 0.01, "rollout/raw_reward": 0.5,
            "perf/train_time": 1.25, "weight_version": 2, "async": False}]


def _wandb_config(tmp_path, *flags):
    return load_config(None, ["--use-wandb", "--wandb-mode", "offline", "--wandb-dir", str(tmp_path),
                              "--wandb-project", "proj", "--run-id", "r1", "--wandb-key", "secret", *flags])


def test_wandb_logs_slimes_names_on_slimes_step_axes(tmp_path):
    logger = WandbLogger(_wandb_config(tmp_path, "--wandb-group", "grpo"))
    for record in RECORDS:
        logger.log(record)
    logger.finish()
    run = read_offline_run(tmp_path)
    assert run["project"] == "proj"
    assert run["group"].startswith("grpo_") and len(run["group"]) == len("grpo_") + 6  # slime's random suffix
    assert run["name"] == f"{run['group']}-RANK_0"
    assert run["config"]["run"]["run_id"] == "r1"
    assert "wandb_key" not in run["config"]["run"]  # the key never leaves the process
    first, second = run["history"]
    assert first["train/ppo_kl"] == 0.0 and first["rollout/raw_reward"] == 0.25
    assert first["eval/tiny/mean_reward"] == 0.5 and "weight_version" not in first
    assert (first["rollout/step"], first["train/step"], first["eval/step"]) == (0, 0, 0)
    assert (second["rollout/step"], second["train/step"]) == (1, 2)  # 2 optimizer steps per rollout


def test_wandb_logs_a_background_eval_at_its_own_step(tmp_path):
    """An eval-fleet result that ended after later steps: eval/* only, against eval/step = its rollout id."""
    logger = WandbLogger(_wandb_config(tmp_path))
    for record in [*RECORDS, {"rollout_id": 0, "record": "eval", "eval/rollout_id": 0, "eval/weight_version": 1,
                              "eval/checkpoint": "ckpt", "eval/tiny/mean_reward": 0.75, "perf/eval_time": 2.0}]:
        logger.log(record)
    logger.finish()
    late = read_offline_run(tmp_path)["history"][-1]
    assert late["eval/step"] == 0 and late["eval/tiny/mean_reward"] == 0.75 and late["eval/weight_version"] == 1
    assert "perf/eval_time" not in late and "rollout/step" not in late and "eval/checkpoint" not in late


def test_wandb_always_train_step_and_no_suffix(tmp_path):
    logger = WandbLogger(_wandb_config(tmp_path, "--wandb-always-use-train-step", "--disable-wandb-random-suffix"))
    for record in RECORDS:
        logger.log(record)
    logger.finish()
    run = read_offline_run(tmp_path)
    assert run["group"] == "r1" and run["name"] == "r1-RANK_0"  # group defaults to the run id
    assert [(h["rollout/step"], h["train/step"]) for h in run["history"]] == [(0, 0), (2, 2)]


def test_wandb_without_the_package_is_a_config_error(monkeypatch):
    monkeypatch.setitem(sys.modules, "wandb", None)
    with pytest.raises(ConfigError, match="'wandb' package is not installed"):
        check_wandb(load_config(None, ["--use-wandb"]))


@pytest.mark.slow
def test_rl_run_writes_wandb_offline_and_tensorboard(tiny_kit, tmp_path, monkeypatch):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    monkeypatch.setenv("WANDB_MODE", "offline")  # wandb reads it itself, as in slime
    config = rl_config(tiny_kit, tmp_path, "tracked", actor_num_gpus_per_node=1, rollout_num_gpus=1)
    config.rollout.num_rollout = 2
    config.run.use_tensorboard, config.run.tensorboard_dir = True, str(tmp_path / "tb")
    config.run.use_wandb, config.run.wandb_dir = True, str(tmp_path / "wb")
    result = run_rl(config, num_cpus=4, num_gpus=0)
    steps = read_metrics(result["metrics_uri"])
    assert sorted(steps) == [0, 1]

    run = read_offline_run(tmp_path / "wb")
    assert [h["rollout/step"] for h in run["history"]] == [0, 1]
    for row, rollout_id in zip(run["history"], (0, 1), strict=True):
        for key in ("train/ppo_kl", "train/grad_norm", "rollout/raw_reward", "train/train_rollout_logprob_abs_diff"):
            assert row[key] == pytest.approx(steps[rollout_id][key]), key

    [events] = list((tmp_path / "tb").glob("events.out.tfevents.*"))
    tb = EventAccumulator(str(events))
    tb.Reload()
    grad_norms = [(e.step, e.value) for e in tb.Scalars("train/grad_norm")]
    assert grad_norms == [(i, pytest.approx(steps[i]["train/grad_norm"])) for i in (0, 1)]
    assert json.loads(json.dumps(run["config"]["run"]))["use_wandb"] is True
