"""slime's rollout-side hooks in the rollout manager, each a plugin written to slime's signature
(tests/ray/ray_plugins.py): --rollout-sample-hook-path (sync and async, before the reward),
--custom-rollout-log-function-path, --custom-eval-rollout-log-function-path, --eval-function-path, and
--custom-config-path's attributes on `args`. One built-in engine behind the router, in this process."""

from __future__ import annotations

import pytest
import ray_plugins
from rl_setup import EVAL_PROMPTS, GROUP, ROLLOUT_BATCH, rl_config

from slime.ray.rollout_manager import RolloutManager
from slime.storage import read_samples


@pytest.fixture(scope="module")
def manager(tiny_kit, tmp_path_factory):
    root = tmp_path_factory.mktemp("hooks")
    (root / "custom.yaml").write_text("my_custom_setting: 42\n")
    config = rl_config(tiny_kit, root, "hooks", actor_num_gpus_per_node=1, rollout_num_gpus=1)
    config.reward.custom_rm_path = "ray_plugins.rm_hook_count"
    config.rollout.rollout_sample_hook_path = ["ray_plugins.tag_sample", "ray_plugins.count_hooks"]
    config.rollout.custom_rollout_log_function_path = "ray_plugins.log_rollout_data"
    config.rollout.custom_eval_rollout_log_function_path = "ray_plugins.log_eval_rollout_data"
    config.rollout.eval_function_path = "ray_plugins.eval_rollout_fn"
    config.run.custom_config_path = str(root / "custom.yaml")
    mgr = RolloutManager(config.model_dump(mode="json"), [[]], str(root / "logs"))
    try:
        mgr.start()
        yield mgr
    finally:
        mgr.dispose()


def test_sample_hooks_run_in_order_before_the_reward_and_the_log_function_takes_over(manager):
    ray_plugins.CALLS["rollout_log"].clear()
    uri, metrics = manager.generate(3)
    samples = read_samples(uri)
    assert len(samples) == ROLLOUT_BATCH * GROUP
    for s in samples:
        assert s.metadata["hooks"] == [["tag", 3, False], ["count", 3, False]]
        assert s.reward == 2.0  # both hooks ran before the reward function saw the sample
    [call] = ray_plugins.CALLS["rollout_log"]
    assert call["rollout_id"] == 3 and call["samples"] == ROLLOUT_BATCH * GROUP
    assert call["rewards"] == [2.0] * len(samples) and call["reward_mean"] == 2.0
    assert call["rollout_time"] > 0 and call["custom"] == 42  # custom_config_path's attribute on args
    # the log function returned True: the step keeps only what the loop needs, not the default rollout/*
    assert "rollout/reward/mean" not in metrics and metrics["rollout/uri"] == uri
    assert metrics["perf/rollout_time"] > 0


def test_eval_uses_the_eval_function_and_calls_the_eval_log_function(manager):
    ray_plugins.CALLS["eval_fn"].clear()
    ray_plugins.CALLS["eval_log"].clear()
    metrics = manager.eval(5)
    assert ray_plugins.CALLS["eval_fn"] == [{"rollout_id": 5, "evaluation": True}]
    [call] = ray_plugins.CALLS["eval_log"]
    assert call["rollout_id"] == 5 and list(call["rewards"]) == ["tiny"]
    assert call["rewards"]["tiny"] == [2.0] * EVAL_PROMPTS  # hooks ran in eval too, told so
    assert call["hooks"] == [[["tag", 5, True], ["count", 5, True]]] * EVAL_PROMPTS
    assert "eval/tiny/mean_reward" in call["metric_keys"]
    assert metrics["eval/tiny/mean_reward"] == 2.0  # False: the default eval metrics are kept


def test_gc_freeze_is_the_actor_s_choice_and_happens_twice(manager, monkeypatch, tmp_path):
    """The RL loop's actor freezes the collector after start and after the first step (`gc_freeze`); a
    manager in a shared process (this one, the tests') never does."""
    import gc

    freezes = []
    monkeypatch.setattr(gc, "freeze", lambda: freezes.append(gc.get_count()))
    assert manager.gc_freeze is False
    manager.generate(5)
    assert freezes == []
    frozen = RolloutManager(manager.config.model_dump(mode="json"), [[]], str(tmp_path), gc_freeze=True)
    for _ in range(3):
        frozen._freeze_gc()
    assert len(freezes) == 2
