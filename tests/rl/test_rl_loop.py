"""`slime rl` end to end on CPU (tiny kit, GRPO, one local Ray cluster for the module): 2 built-in
engines behind the router and 2 data-parallel train ranks run 3 rollouts with saves, evals and a
weight sync every step; a run stopped after its checkpoint resumes with the same next batch as an
uninterrupted run; async mode samples one weight version behind; LoRA with adapter-only sync stays
on-policy; PPO trains its critic beside the actor, the critic alone during --num-critic-only-steps."""

from __future__ import annotations

import socket
import sys
import time
from pathlib import Path
from urllib.parse import urlparse

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "ray"))  # rl_setup, ray_plugins (before Ray starts)

from rl_setup import GROUP, ROLLOUT_BATCH, rl_config  # noqa: E402

from slime.backends.megatron.checkpoint import latest_checkpoint, read_training_state  # noqa: E402
from slime.rl import RLLoop, read_metrics, run_rl  # noqa: E402
from slime.storage import ArtifactStore, is_committed, read_samples  # noqa: E402

NUM_ROLLOUT = 3


def loop_config(tiny_kit, root: Path, run_id: str, ranks: int = 2, engines: int = 2, **sections):
    config = rl_config(tiny_kit, root / run_id, run_id, actor_num_gpus_per_node=ranks, rollout_num_gpus=engines)
    config.run.store = str(root / "store")  # one store: runs side by side
    config.rollout.num_rollout = NUM_ROLLOUT
    config.checkpoint.save_interval = 2
    for section, values in sections.items():
        for name, value in values.items():
            setattr(getattr(config, section), name, value)
    return config


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    return tmp_path_factory.mktemp("rl")


@pytest.fixture(scope="module")
def ray_cluster(tiny_kit, root):
    from slime.ray.placement import RayCluster

    cluster = RayCluster.connect(loop_config(tiny_kit, root, "sizing").cluster, num_gpus=0)
    yield cluster
    cluster.shutdown()


def rollout_rows(config, rollout_id: int) -> list[tuple]:
    uri = ArtifactStore.from_config(config).uri(config.run.run_id, "rollout", f"{rollout_id:06d}")
    return [(s.group_index, s.index, s.prompt) for s in read_samples(uri)]


def versions(config, rollout_id: int) -> set[tuple[str, ...]]:
    uri = ArtifactStore.from_config(config).uri(config.run.run_id, "rollout", f"{rollout_id:06d}")
    return {tuple(s.weight_versions) for s in read_samples(uri)}


@pytest.fixture(scope="module")
def full_run(tiny_kit, root, ray_cluster):
    # check_weight_update_equal: engines zero their weights before the first sync, which must restore them;
    # async_save: checkpoint 1 is written in the background while rollout 2 runs, committed by its train call
    config = loop_config(tiny_kit, root, "full", eval={"eval_interval": 2}, run={"check_weight_update_equal": True},
                         checkpoint={"async_save": True})
    return config, run_rl(config)


def test_three_grpo_rollouts_with_saves_evals_and_metrics(full_run):
    config, result = full_run
    assert result["start_rollout_id"] == 0 and not result["resumed"]
    assert [s["rollout_id"] for s in result["steps"]] == [0, 1, 2]
    save = config.checkpoint.save
    assert result["last_checkpoint"].endswith("iter_0000002") and latest_checkpoint(save) == result["last_checkpoint"]
    assert is_committed(f"{save}/iter_0000001")  # save_interval 2: after rollout 1, then at the end
    assert read_training_state(f"{save}/iter_0000001").extra_state["rollout_id"] == 1  # its own state, though
    assert result["steps"][1]["perf/save_s"] < result["steps"][2]["perf/save_s"]  # written while training went on
    assert not is_committed(f"{save}/iter_0000000")
    extra = read_training_state(result["last_checkpoint"]).extra_state
    assert extra["rollout_id"] == 2 and extra["weight_version"] == 3
    assert extra["data_source"]["sample_group_index"] == NUM_ROLLOUT * ROLLOUT_BATCH  # after batch 2, not beyond

    records = read_metrics(result["metrics_uri"])
    assert sorted(records) == [0, 1, 2] and records[2] == result["steps"][2]
    for rollout_id, r in records.items():
        assert r["weight_version"] == rollout_id + 1  # synced after every step
        assert r["rl/reward_mean"] == pytest.approx(0.5)  # rm_by_index: half of every group
        assert r["rl/rollout_s"] > 0 and r["rl/train_s"] > 0 and r["rl/sync_s"] > 0 and r["rl/tokens_per_s"] > 0
        assert r["rl/grad_norm"] > 0 and r["rl/clip_frac"] == 0.0 and r["rl/entropy"] > 0
        assert abs(r["rl/ppo_kl"]) < 1e-6  # one step per rollout, on the rollout's own policy
        # lr 1e-2 moves every weight: a rollout from stale weights would differ by ~0.1 or more
        assert r["rl/logprob_abs_diff"] < 1e-4, rollout_id
        assert r["train/samples"] == ROLLOUT_BATCH * GROUP
        assert versions(config, rollout_id) == {(str(rollout_id),)}  # every token from the synced weights
    # evals: before training (weight version 0), after rollout 1 (version 2) and at the end (version 3)
    assert records[0]["eval/weight_version"] == 0 and records[1]["eval/weight_version"] == 2
    assert records[2]["eval/weight_version"] == 3
    assert ArtifactStore.from_config(config).committed(config.run.run_id, "eval") == [
        f"{v:06d}-{name}" for v in (0, 2, 3) for name in ("summary", "tiny")]


def test_the_run_stopped_everything_it_started(full_run):
    import ray

    _, result = full_run
    for url in [*result["worker_urls"], result["router_url"]]:  # engines and router are gone
        parsed = urlparse(url)
        with pytest.raises(OSError), socket.create_connection((parsed.hostname, parsed.port), timeout=2):
            pass
    deadline = time.monotonic() + 30  # the placement group and actors gave their resources back
    while ray.available_resources().get("CPU", 0) < ray.cluster_resources()["CPU"] and time.monotonic() < deadline:
        time.sleep(0.5)
    assert ray.available_resources().get("CPU", 0) == ray.cluster_resources()["CPU"]


@pytest.mark.slow
def test_a_stopped_run_resumes_with_the_same_next_batch(tiny_kit, root, ray_cluster, full_run):
    full_config, _ = full_run
    config = loop_config(tiny_kit, root, "resume", ranks=1, engines=1)
    loop = RLLoop(config)
    try:  # rollouts 0 and 1 (checkpoint after 1), then rollout 2 is generated and the run stops
        assert loop.setup()["start_rollout_id"] == 0
        for rollout_id in (0, 1):
            uri = loop.rollout(rollout_id)["uri"]
            loop.train(rollout_id, uri)
            saved = loop.maybe_save(rollout_id)
            loop.sync(rollout_id)
            loop.log_step(rollout_id)
        assert saved["saved"] and saved["path"].endswith("iter_0000001")
        loop.rollout(2)
    finally:
        loop.close()
    killed_batch = rollout_rows(config, 2)

    result = run_rl(config)
    assert result["resumed"] and result["start_rollout_id"] == 2 and len(result["steps"]) == 1
    # the batch drawn at rollout 2 is the uninterrupted run's (and the stopped run's, set aside)
    assert rollout_rows(config, 2) == rollout_rows(full_config, 2) == killed_batch
    stale = ArtifactStore.from_config(config).committed(config.run.run_id, "rl_stale")
    assert len(stale) == 1 and stale[0].endswith("-rollout-000002")
    resumed = read_training_state(result["last_checkpoint"]).extra_state["data_source"]
    assert resumed == read_training_state(latest_checkpoint(full_config.checkpoint.save)).extra_state["data_source"]
    assert sorted(read_metrics(result["metrics_uri"])) == [0, 1, 2]
    assert versions(config, 2) == {("2",)}  # the engines got the checkpoint's weights at set-up


@pytest.mark.slow
def test_async_mode_samples_one_weight_version_behind(tiny_kit, root, ray_cluster):
    config = loop_config(tiny_kit, root, "async", ranks=1, engines=1, sync={"async_mode": True})
    result = run_rl(config)
    assert [s["rollout_id"] for s in result["steps"]] == [0, 1, 2]
    # rollout 1 is generated while rollout 0 trains: weights of version 0; rollout 2 from version 1
    assert [versions(config, i) for i in range(3)] == [{("0",)}, {("0",)}, {("1",)}]
    records = read_metrics(result["metrics_uri"])
    assert records[0]["rl/logprob_abs_diff"] < 1e-4  # on-policy
    assert records[1]["rl/logprob_abs_diff"] > 1e-3  # one step off-policy (lr 1e-2)
    assert [records[i]["weight_version"] for i in range(3)] == [1, 2, 3]


@pytest.mark.slow
def test_fully_async_mode_trains_within_the_bound_and_checkpoints_what_it_holds(tiny_kit, root, ray_cluster):
    config = loop_config(tiny_kit, root, "fully", ranks=1, engines=1,
                         sync={"async_mode": "fully", "max_policy_version_lag": 1},
                         rollout={"partial_rollout": True}, checkpoint={"save_interval": 1})
    result = run_rl(config)
    assert [s["rollout_id"] for s in result["steps"]] == [0, 1, 2]
    records = read_metrics(result["metrics_uri"])
    store = ArtifactStore.from_config(config)
    groups = []
    for rollout_id in range(NUM_ROLLOUT):
        samples = read_samples(store.uri(config.run.run_id, "rollout", f"{rollout_id:06d}"))
        assert len(samples) == ROLLOUT_BATCH * GROUP
        for s in samples:  # every token of a trained sample is at most one version behind its step
            assert s.token_weight_versions and rollout_id - 1 <= min(s.token_weight_versions) <= rollout_id
        groups += sorted({s.group_index for s in samples})
        dropped = store.uri(config.run.run_id, "rollout_dropped", f"{rollout_id:06d}")
        if is_committed(dropped):  # stale, filtered or failed groups: accounted for, never trained
            groups += sorted({s.group_index for s in read_samples(dropped)})
        record = records[rollout_id]
        assert record["async"] == "fully" and record["weight_version"] == rollout_id + 1
        assert record["async/staleness/max"] <= 1 and "perf/trainer_idle_s" in record
        assert "perf/engine_idle_s" in record and "perf/pause_generation_s" in record
    assert len(groups) == len(set(groups))  # no group trained (or dropped) twice
    held = read_training_state(result["last_checkpoint"]).extra_state["fully_async"]
    assert held["next_rollout_id"] == NUM_ROLLOUT
    held_groups = [g[0]["group_index"] for g in held["completed"] + held["interrupted"] + held["dropped"]]
    assert "data_source" not in held  # the cursor is kept once, beside it
    drawn = read_training_state(result["last_checkpoint"]).extra_state["data_source"]["sample_group_index"]
    assert sorted(groups + held_groups) == list(range(drawn))


def engine_processes(model_dir: Path) -> list[int]:
    """PIDs of live processes whose command line names the kit's model (engine servers)."""
    pids = []
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            cmdline = (proc / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            state = (proc / "stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue
        if str(model_dir) in cmdline and state != "Z":
            pids.append(int(proc.name))
    return pids


@pytest.mark.slow
def test_sigterm_after_a_checkpoint_stops_everything_and_the_rerun_resumes(tiny_kit, root, ray_cluster, full_run):
    import signal
    import subprocess

    import yaml

    full_config, _ = full_run
    config = loop_config(tiny_kit, root, "sigterm", ranks=1, engines=1)
    config_file = root / "sigterm.yaml"
    config_file.write_text(yaml.safe_dump(config.model_dump(mode="json")))
    assert not engine_processes(tiny_kit.model_dir)
    env = {**__import__("os").environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1] / "ray")}
    child = subprocess.Popen([sys.executable, "-m", "slime.rl", "--config", str(config_file)], env=env,
                             stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 480
        while latest_checkpoint(config.checkpoint.save) is None and child.poll() is None:
            assert time.monotonic() < deadline, "no checkpoint in time"
            time.sleep(0.5)
        child.send_signal(signal.SIGTERM)
        assert child.wait(timeout=240) == 128 + signal.SIGTERM
    finally:
        if child.poll() is None:
            child.kill()
    assert latest_checkpoint(config.checkpoint.save).endswith("iter_0000001")
    deadline = time.monotonic() + 30
    while engine_processes(tiny_kit.model_dir) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert not engine_processes(tiny_kit.model_dir)  # the stopped run's engines went with it

    result = run_rl(config)
    assert result["start_rollout_id"] == 2 and len(result["steps"]) == 1
    assert rollout_rows(config, 2) == rollout_rows(full_config, 2)


@pytest.mark.slow
def test_release_train_recreates_the_ranks_from_each_rollouts_checkpoint(tiny_kit, root, ray_cluster):
    config = loop_config(tiny_kit, root, "release", ranks=1, engines=1, cluster={"release_train": True})
    config.rollout.num_rollout, config.checkpoint.save_interval = 2, None
    result = run_rl(config)
    steps = read_metrics(result["metrics_uri"])
    assert sorted(steps) == [0, 1] and all(step["train/grad_norm"] > 0 for step in steps.values())
    # saved at every rollout (save_interval unset saves only the last otherwise): the new ranks resumed from it
    from slime.backends.megatron.checkpoint import iteration_dir

    assert [read_training_state(iteration_dir(config.checkpoint.save, i)).iteration for i in (0, 1)] == [0, 1]


def test_lora_rl_with_adapter_sync_stays_on_policy(tiny_kit, root, ray_cluster):  # ~30 s (Ray up)
    """LoRA RL with `--lora-sync adapter`: the engines are launched with --enable-lora, get only the adapters each
    step (/load_lora_adapter) and the rollout's requests name them (lora_path); a missed or stale adapter shows as
    a train-vs-rollout log-prob gap (lr 1e-2 moves B every step)."""
    config = loop_config(tiny_kit, root, "lora-adapter", ranks=1, engines=1, lora={"lora_rank": 4, "lora_alpha": 8},
                         sync={"lora_sync": "adapter", "update_weight_disk_dir": str(root / "lora-adapters")})
    result = run_rl(config)
    assert [s["rollout_id"] for s in result["steps"]] == [0, 1, 2]
    records = read_metrics(result["metrics_uri"])
    for i in range(3):
        assert records[i]["train/train_rollout_logprob_abs_diff"] < 1e-4, (i, records[i])
        assert 0 < records[i]["sync/bytes"] < 1e6, "adapters only (the model is 4 MB)"
    assert [versions(config, i) for i in range(3)] == [{("0",)}, {("1",)}, {("2",)}]
    assert sorted(p.name for p in (root / "lora-adapters").iterdir()) == ["lora_adapter_3"]


def test_ppo_trains_the_critic_beside_the_actor(tiny_kit, root, ray_cluster):
    """`--advantage-estimator ppo --num-critic-only-steps 1` through `slime rl`: the train rank runs the critic
    beside the actor; rollout 0 trains the critic alone (the weight sync still runs: rollout 1 is generated by
    version 1), rollout 1 both; the last checkpoint holds the critic under `{save}/critic`."""
    from slime.backends.megatron.checkpoint import iteration_dir

    config = loop_config(tiny_kit, root, "ppo", ranks=1, engines=1,
                         algorithm={"advantage_estimator": "ppo", "num_critic_only_steps": 1})
    config.rollout.num_rollout, config.checkpoint.save_interval = 2, None
    config.checkpoint.save = str(root / "ppo-checkpoints")
    result = run_rl(config)
    records = read_metrics(result["metrics_uri"])
    assert sorted(records) == [0, 1]
    for i in (0, 1):
        m = records[i]
        assert m["train/value_loss"] > 0 and m["train/critic-grad_norm"] > 0 and "train/value_clipfrac" in m, m
        assert m["train/actor_skipped"] == float(i == 0), m
    assert "train/grad_norm" not in records[0] and records[1]["train/grad_norm"] > 0
    assert records[1]["train/train_rollout_logprob_abs_diff"] < 1e-4  # the synced weights generated rollout 1
    assert [versions(config, i) for i in range(2)] == [{("0",)}, {("1",)}]
    assert is_committed(iteration_dir(str(root / "ppo-checkpoints" / "critic"), 1))
