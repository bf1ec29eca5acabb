"""Evals beside fully async training (slime.rl.eval_fleet), end to end on CPU: one train rank, one rollout
engine and one eval engine (`cluster.eval_num_gpus 1`: a built-in engine process of its own), 4 rollouts,
an eval every 2. The eval function sleeps `async_plugins.EVAL_SLEEP_S` first, so each eval spans training
steps: they must go on (rollouts generated, batches trained) while it runs, the generator paused only by
weight syncs and checkpoints, and each result keyed by the rollout id, the weight version it evaluated and
the checkpoint holding that version."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))  # async_plugins (before Ray starts: actors import it)
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "ray"))  # rl_setup, ray_plugins

import async_plugins  # noqa: E402
from rl_setup import rl_config  # noqa: E402

from slime.config import Config  # noqa: E402
from slime.config.validate import validate  # noqa: E402
from slime.errors import ConfigError  # noqa: E402
from slime.ray.placement import plan_placement  # noqa: E402
from slime.rl import read_metrics, run_rl  # noqa: E402
from slime.storage import ArtifactStore, is_committed  # noqa: E402

NUM_ROLLOUT = 4


def fleet_config(tiny_kit, root: Path, run_id: str) -> Config:
    config = rl_config(tiny_kit, root / run_id, run_id, actor_num_gpus_per_node=1, rollout_num_gpus=1,
                       eval_num_gpus=1)
    config.run.store = str(root / "store")
    config.rollout.num_rollout = NUM_ROLLOUT
    config.rollout.partial_rollout = True
    config.checkpoint.save_interval = 2
    config.sync.async_mode = "fully"
    config.sync.max_policy_version_lag = 1
    config.eval.eval_interval = 2
    config.rollout.eval_function_path = "async_plugins.slow_eval"
    validate(config, {})  # the cross-field checks a loaded config passes
    return config


@pytest.fixture(scope="module")
def fleet_run(tiny_kit, tmp_path_factory):
    from slime.ray.placement import RayCluster

    root = tmp_path_factory.mktemp("eval-fleet")
    config = fleet_config(tiny_kit, root, "fleet")
    cluster = RayCluster.connect(config.cluster, num_gpus=0)
    try:
        yield config, run_rl(config)
    finally:
        cluster.shutdown()


def test_the_eval_fleet_has_bundles_of_its_own_after_the_others():
    plan = plan_placement(Config.model_validate({"cluster": {"actor_num_gpus_per_node": 2, "rollout_num_gpus": 2,
                                                             "eval_num_gpus": 2}}).cluster, use_gpu=True)
    assert plan.train_bundles == [0, 1] and plan.engine_bundles == [[2], [3]]
    assert plan.eval_engine_bundles == [[4], [5]] and plan.num_bundles == 6


@pytest.mark.parametrize("fields, message", [
    ({"cluster": {"eval_num_gpus": 1}}, "fully async"),
    ({"cluster": {"eval_num_gpus": 1, "share_gpu": True}, "sync": {"async_mode": "fully"}}, "tensor"),
    ({"cluster": {"eval_num_gpus": 1, "rollout_num_gpus_per_engine": 2}, "sync": {"async_mode": "fully"}},
     "multiple"),
])
def test_an_eval_fleet_it_cannot_serve_is_refused_at_load(fields, message):
    with pytest.raises(ConfigError, match=message):
        validate(Config.model_validate(fields), {})


@pytest.mark.slow  # about 2 minutes on the shared 2-core machine (three engine processes, four steps)
def test_evals_run_beside_training_at_their_interval_keyed_by_version(fleet_run):
    config, result = fleet_run
    assert [s["rollout_id"] for s in result["steps"]] == list(range(NUM_ROLLOUT))
    store = ArtifactStore.from_config(config)
    save = Path(config.checkpoint.save)

    # at their interval: before training (version 0), after rollouts 1 and 3 (versions 2 and 4), committed
    records = read_metrics(result["metrics_uri"])
    evals = {i: (r["eval/weight_version"], r["eval/checkpoint"]) for i, r in records.items() if "eval/weight_version" in r}
    assert evals == {0: (0, config.checkpoint.load or config.checkpoint.hf_checkpoint),
                     1: (2, str(save / "iter_0000001")), 3: (4, str(save / "iter_0000003"))}
    for version in (0, 2, 4):
        assert is_committed(store.uri(config.run.run_id, "eval", f"{version:06d}-tiny"))
    for i in evals:
        assert records[i]["eval/rollout_id"] == i and records[i]["eval/tiny/samples"] > 0

    # not paused: each eval ran for EVAL_SLEEP_S at least, and steps ended while it ran, their batches generated
    # and trained; the generator paused for the weight syncs and checkpoints only
    lines = [json.loads(line) for line in Path(result["metrics_uri"]).read_text().splitlines()]
    steps = [line for line in lines if line.get("record") != "eval"]
    landed = [line for line in lines if line.get("record") == "eval"]
    assert landed, "every eval ended within its own step: none ran beside training"
    for line in landed:
        assert line["perf/eval_wall_s"] >= async_plugins.EVAL_SLEEP_S
        launched = line["time"] - line["perf/eval_wall_s"]
        during = [s for s in steps if launched < s["time"] < line["time"]]
        assert during, f"no step ended while the eval of version {line['eval/weight_version']} ran"
        assert all(s["rollout/response_len/mean"] > 0 and s["train/steps"] == 1 for s in during)
        assert lines.index(line) > lines.index(next(s for s in steps if s["rollout_id"] == line["rollout_id"]))
    # between two batches one pause: the checkpoint's (kept through the sync) or the sync's; none for an eval
    assert [s["async/generation_pauses"] for s in steps] == [0] + [1] * (NUM_ROLLOUT - 1)
