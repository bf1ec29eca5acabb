"""slime's debug modes as ways of running `slime rl` on the store: --debug-rollout-only generates rollouts
into the store without a trainer, then --load-debug-rollout-data (implying --debug-train-only) trains on
those stored shard sets without engines."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "ray"))  # rl_setup, ray_plugins (before Ray starts)

from rl_setup import GROUP, ROLLOUT_BATCH, rl_config  # noqa: E402

from slime.config import load_config  # noqa: E402
from slime.errors import ConfigError, NotCommittedError  # noqa: E402
from slime.rl import read_metrics, run_rl  # noqa: E402
from slime.storage import ArtifactStore, is_committed  # noqa: E402


def test_debug_flags_are_checked():
    with pytest.raises(ConfigError, match="debug_train_only: needs load_debug_rollout_data"):
        load_config(None, ["--debug-train-only"])
    with pytest.raises(ConfigError, match="exclude each other"):
        load_config(None, ["--debug-rollout-only", "--load-debug-rollout-data", "r/{rollout_id}"])
    assert load_config(None, ["--load-debug-rollout-data", "r/{rollout_id}"]).run.debug_train_only is True


@pytest.mark.slow
def test_rollout_only_then_train_only_on_the_stored_rollouts(tiny_kit, tmp_path):
    rollouts = rl_config(tiny_kit, tmp_path, "gen", actor_num_gpus_per_node=1, rollout_num_gpus=1)
    rollouts.rollout.num_rollout = 2
    rollouts.run.debug_rollout_only = True
    rollouts.eval.eval_interval = 2
    gen = run_rl(rollouts, num_cpus=4, num_gpus=0)
    store = ArtifactStore.from_config(rollouts)
    shard_sets = [store.uri("gen", "rollout", f"{i:06d}") for i in range(2)]
    assert all(is_committed(uri) for uri in shard_sets)
    records = read_metrics(gen["metrics_uri"])
    assert sorted(records) == [0, 1] and gen["last_checkpoint"] is None
    assert not any(k.startswith("train/") for r in records.values() for k in r)  # no trainer
    # the engines keep the HF weights (version 0), evaluated once (before the first rollout)
    assert any(k.startswith("eval/") for k in records[0]) and {r["weight_version"] for r in records.values()} == {0}

    trainer = rl_config(tiny_kit, tmp_path, "train", actor_num_gpus_per_node=1, rollout_num_gpus=1)
    trainer.rollout.num_rollout = 2
    trainer.run.load_debug_rollout_data = store.uri("gen", "rollout") + "/{rollout_id:06d}"
    trainer.run.debug_train_only = True
    trainer.eval.eval_interval = 1  # no engines: no eval
    trained = run_rl(trainer, num_cpus=4, num_gpus=0)
    steps = read_metrics(trained["metrics_uri"])
    assert sorted(steps) == [0, 1] and trained["worker_urls"] == []
    for step in steps.values():
        assert step["train/samples"] == ROLLOUT_BATCH * GROUP and step["train/grad_norm"] > 0
        assert not any(k.startswith("eval/") or k.startswith("sync/") for k in step)
    assert trained["last_checkpoint"] is not None  # saved at the end, as any RL run

    # slime's --start-rollout-id and --load-debug-rollout-data-subsample: only rollout 1, on half its groups
    part = trainer.model_copy(deep=True)
    part.run.run_id, part.checkpoint.save = "part", str(tmp_path / "part-ckpt")
    part.data.start_rollout_id, part.run.load_debug_rollout_data_subsample = 1, 0.5
    part.train.global_batch_size = ROLLOUT_BATCH * GROUP // 2
    partial = run_rl(part, num_cpus=4, num_gpus=0)
    steps = read_metrics(partial["metrics_uri"])
    assert partial["start_rollout_id"] == 1 and sorted(steps) == [1]
    assert steps[1]["train/samples"] == ROLLOUT_BATCH * GROUP // 2

    missing = trainer.model_copy(deep=True)
    missing.run.run_id, missing.rollout.num_rollout = "missing", 3
    missing.checkpoint.save = str(tmp_path / "missing-ckpt")
    with pytest.raises(NotCommittedError, match="rollout 2: .*000002 is not a committed rollout shard set"):
        run_rl(missing, num_cpus=4, num_gpus=0)
