"""The RL loop's pure parts, without Ray: config checks, the periodic rule, the metrics log and the
setting aside of outputs a resumed run redoes."""

from __future__ import annotations

import json

import pytest

from slime.config import Config, load_config, parse_overrides
from slime.errors import ConfigError
from slime.rl.loop import _due, check_rl_config
from slime.rl.metrics import MetricsLog, headline, read_metrics
from slime.rl.stale import set_aside_stale_steps
from slime.storage import ArtifactStore, is_committed, write_samples
from slime.types import Sample


def base(tmp_path, **sections) -> Config:
    data = {"run": {"store": str(tmp_path / "store"), "run_id": "r"},
            "checkpoint": {"hf_checkpoint": "model"}, "data": {"prompt_data": "p.jsonl"},
            "rollout": {"rollout_batch_size": 2, "num_rollout": 3}}
    for section, values in sections.items():
        data.setdefault(section, {}).update(values)
    return Config.model_validate(data)


def test_async_flag_is_slime_spelling_and_refused_with_colocate(tmp_path):
    nested, origin = parse_overrides(["--async", "--update-weights-interval", "2"])
    assert nested["sync"] == {"async_mode": True, "update_weights_interval": "2"}
    assert origin["sync.async_mode"] == "--async"
    path = tmp_path / "c.yaml"
    path.write_text("cluster:\n  colocate: true\n")
    with pytest.raises(ConfigError, match=r"--async: sync.async_mode: .*colocate.*cluster.colocate set at"):
        load_config(str(path), ["--async"])


def test_async_modes_and_the_staleness_bound_are_checked_together(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("sync:\n  async_mode: true\n")  # a YAML bool, as --async: one-step-off
    assert load_config(str(path)).sync.async_mode == "one_step_off"
    path.write_text("{}\n")
    config = load_config(str(path), ["--async-mode", "fully", "--max-policy-version-lag", "2",
                                     "--stale-sample-policy", "regenerate"])
    assert (config.sync.async_mode, config.sync.max_policy_version_lag, config.sync.stale_sample_policy) == \
        ("fully", 2, "regenerate")
    assert load_config(str(path), ["--max-policy-version-lag", "0"]).sync.max_policy_version_lag == 0  # sync: 0
    with pytest.raises(ConfigError, match=r"one_step_off .* up to 1 versions behind, above the bound 0"):
        load_config(str(path), ["--async", "--max-policy-version-lag", "0"])
    with pytest.raises(ConfigError, match=r"update_weights_interval 3 trains samples up to 2 versions behind"):
        load_config(str(path), ["--update-weights-interval", "3", "--max-policy-version-lag", "1"])
    with pytest.raises(ConfigError, match=r"partial rollout carries tokens across steps.*--async-mode fully"):
        load_config(str(path), ["--partial-rollout", "--max-policy-version-lag", "1"])
    with pytest.raises(ConfigError, match=r"rollout_function_path: fully async mode runs its own generation"):
        load_config(str(path), ["--async-mode", "fully", "--rollout-function-path", "my.rollout"])
    with pytest.raises(ConfigError, match=r"async \(fully\) generation needs separate train and rollout GPUs"):
        load_config(str(path), ["--async-mode", "fully", "--colocate"])
    with pytest.raises(ConfigError, match=r"syncing only every 3 steps would starve it; use at most 2"):
        load_config(str(path), ["--async-mode", "fully", "--update-weights-interval", "3"])
    load_config(str(path), ["--async-mode", "fully", "--update-weights-interval", "3", "--max-policy-version-lag", "2"])
    with pytest.raises(ConfigError, match=r"async_mode.*'off', 'one_step_off' or 'fully'"):
        load_config(str(path), ["--async-mode", "sometimes"])
    with pytest.raises(ConfigError, match="max_policy_version_lag"):
        load_config(str(path), ["--max-policy-version-lag", "-1"])
    with pytest.raises(ConfigError, match="cannot run with run.debug_rollout_only"):
        check_rl_config(base(tmp_path, sync={"async_mode": "fully"}, run={"debug_rollout_only": True}))


def test_rl_config_checks_name_the_fields(tmp_path):
    check_rl_config(base(tmp_path))
    with pytest.raises(ConfigError, match=r"run.run_id \(--run-id\)"):
        check_rl_config(base(tmp_path, run={"run_id": None}))
    with pytest.raises(ConfigError, match=r"--num-rollout.*--num-epoch"):
        check_rl_config(base(tmp_path, rollout={"num_rollout": None}))
    check_rl_config(base(tmp_path, rollout={"num_rollout": None}, data={"num_epoch": 2}))
    with pytest.raises(ConfigError, match="eval_interval is set but there is no eval dataset"):
        check_rl_config(base(tmp_path, eval={"eval_interval": 2}))
    with pytest.raises(ConfigError, match="offload_rollout must be false"):
        check_rl_config(base(tmp_path, sync={"async_mode": True}, cluster={"offload_rollout": True}))


def test_tensorboard_needs_its_package(tmp_path):
    config = base(tmp_path, run={"use_tensorboard": True})
    try:
        import tensorboard  # noqa: F401
    except ImportError:
        with pytest.raises(ConfigError, match="pip install tensorboard"):
            check_rl_config(config)
    else:
        check_rl_config(config)


def test_periodic_rule_counts_from_one_and_fires_at_the_end():
    assert [i for i in range(7) if _due(i, 3, 7)] == [2, 5, 6]
    assert [i for i in range(4) if _due(i, 1, 4)] == [0, 1, 2, 3]
    assert not any(_due(i, None, 4) for i in range(4))


def test_metrics_log_appends_lines_and_a_rerun_step_keeps_its_last_record(tmp_path):
    uri = str(tmp_path / "store" / "r" / "rl" / "metrics.jsonl")
    log = MetricsLog(uri)
    log.append({"rollout_id": 0, "rl/reward_mean": 0.25, "bad": float("nan"), "dropped": [1, 2]})
    log.append({"rollout_id": 1, "rl/reward_mean": 0.5})
    MetricsLog(uri).append({"rollout_id": 1, "rl/reward_mean": 0.75})  # a resumed run redoes step 1
    lines = (tmp_path / "store" / "r" / "rl" / "metrics.jsonl").read_text().splitlines()
    assert len(lines) == 3 and json.loads(lines[0]) == {"rollout_id": 0, "rl/reward_mean": 0.25, "bad": None}
    records = read_metrics(uri)
    assert records[1]["rl/reward_mean"] == 0.75 and records[0]["rl/reward_mean"] == 0.25


def test_metrics_log_on_an_object_store_without_append():
    uri = "memory://rl-metrics-test/r/rl/metrics.jsonl"
    for i in range(3):
        MetricsLog(uri).append({"rollout_id": i, "x": i})
    assert sorted(read_metrics(uri)) == [0, 1, 2]


def test_headline_picks_the_first_source_present():
    h = headline({"rollout/time_s": 2.0, "perf/rollout_time": 3.0, "train/ppo_kl": 1e-9, "rollout/raw_reward": 0.5,
                  "rollout/reward/mean": 0.1, "train/pg_clipfrac": 0, "sync/total_s": True})
    assert h == {"rl/rollout_s": 2.0, "rl/ppo_kl": 1e-9, "rl/reward_mean": 0.5, "rl/clip_frac": 0.0}


def test_outputs_of_steps_to_redo_are_moved_not_deleted(tmp_path):
    store = ArtifactStore(str(tmp_path / "store"))
    samples = [Sample(index=0, tokens=[1, 2], response_length=1, loss_mask=[1])]
    for stage, name in [("rollout", "000001"), ("rollout", "000002"), ("rollout", "000003"),
                        ("rollout_dropped", "000002"), ("eval", "000002-summary"), ("eval", "000003-tiny")]:
        write_samples(store.uri("r", stage, name), samples)
    moved = set_aside_stale_steps(store, "r", 2)  # resume at rollout 2: weights of version 2 are checkpointed
    assert store.committed("r", "rollout") == ["000001"]
    assert store.committed("r", "rollout_dropped") == []
    assert store.committed("r", "eval") == ["000002-summary"]
    assert len(moved) == 4 and all(is_committed(uri) for uri in moved)
    assert sorted(name.split("-", 1)[1] for name in store.committed("r", "rl_stale")) == [
        "eval-000003-tiny", "rollout-000002", "rollout-000003", "rollout_dropped-000002"]
    assert set_aside_stale_steps(store, "r", 2) == []
    # a rerun that found no checkpoint starts over: every step output goes, the before-train eval too
    assert len(set_aside_stale_steps(store, "r", 0)) == 2
    assert store.committed("r", "rollout") == [] and store.committed("r", "eval") == []
