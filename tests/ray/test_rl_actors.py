"""End to end on CPU (tiny kit, one local Ray cluster with CPU bundles for the module): the rollout
manager starts 2 built-in engines behind the real sglang-router and generates GRPO groups into the
store; train groups of 2 and 1 data-parallel ranks train one step on that shard set and agree; the
weights synced into the engines (`slime.sync`, the mode `auto` picks) make the next rollout's log-probs
match the trainer's again; a checkpoint with the data-source state resumes at the next rollout id."""

from __future__ import annotations

import json

import pytest
from rl_setup import EVAL_PROMPTS, GROUP, ROLLOUT_BATCH, check_first_step, rl_config, started_manager

from slime.errors import ConfigError
from slime.ray.placement import RayCluster, create_placement
from slime.ray.train_group import TrainGroup
from slime.storage import is_committed, read_samples


@pytest.fixture(scope="module")
def config(tiny_kit, tmp_path_factory):
    return rl_config(tiny_kit, tmp_path_factory.mktemp("ray-rl"), "ray-e2e", actor_num_gpus_per_node=2,
                     rollout_num_gpus=2)


@pytest.fixture(scope="module")
def placement(config):
    cluster = RayCluster.connect(config.cluster, num_gpus=0)
    try:
        placement = create_placement(config.cluster)
        assert not placement.plan.use_gpu and placement.plan.num_bundles == 4
        yield placement
    finally:
        cluster.shutdown()


@pytest.fixture(scope="module")
def manager(config, placement, tmp_path_factory):
    with started_manager(config, placement, tmp_path_factory.mktemp("ray-logs")) as actor:
        yield actor


def test_generate_and_data_source_state_round_trip(manager):
    import ray

    uri, metrics = ray.get(manager.generate.remote(0))
    assert is_committed(uri) and metrics["rollout/uri"] == uri
    samples = read_samples(uri)
    assert len(samples) == ROLLOUT_BATCH * GROUP
    assert all(s.rollout_log_probs is not None and len(s.rollout_log_probs) == s.response_length for s in samples)
    state = ray.get(manager.data_source_state.remote())
    assert state["sample_group_index"] == ROLLOUT_BATCH

    first = read_samples(ray.get(manager.generate.remote(1))[0])
    ray.get(manager.load_data_source_state.remote(state))
    assert ray.get(manager.data_source_state.remote()) == state
    ray.get(manager.offload.remote())  # engines release their memory, then take it back
    ray.get(manager.onload.remote())
    again = read_samples(ray.get(manager.generate.remote(2))[0])
    assert [(s.group_index, s.prompt) for s in again] == [(s.group_index, s.prompt) for s in first]
    assert again[0].group_index == ROLLOUT_BATCH  # the batch after rollout 0, not a third one


def test_eval(manager):
    import ray

    metrics = ray.get(manager.eval.remote(0))
    assert metrics["eval/tiny/samples"] == EVAL_PROMPTS
    assert metrics["eval/tiny/mean_reward"] == pytest.approx(0.5)  # rm_by_index over indices 0..19
    assert is_committed(metrics["eval/summary_uri"].rsplit("/", 1)[0]) and metrics["perf/eval_time"] > 0


@pytest.fixture(scope="module")
def group(config, placement):
    """The module's 2-rank train group, initialised (kept alive for the weight-sync test)."""
    group = TrainGroup(config, placement)
    try:
        assert group.init() == 0 and group.extra_state() == {}
        yield group
    finally:
        group.shutdown()


@pytest.fixture(scope="module")
def trained(manager, group):
    """Rollout 10 trained by the 2-rank group and saved with the data-source state:
    (shard set URI, train metrics, data-source state, checkpoint path)."""
    import ray

    uri, _ = ray.get(manager.generate.remote(10))
    state = ray.get(manager.data_source_state.remote())
    assert all(not r["offloaded"] for r in group.offload())  # CPU: the calls exist and are no-ops
    group.onload()
    metrics = group.train(10, uri)
    path = group.save(10, {"data_source": state})
    return uri, metrics, state, path


def test_two_ranks_train_one_grpo_step_and_save(trained):
    _, metrics, _, path = trained
    check_first_step(metrics)
    assert metrics["rollout/raw_reward"] == pytest.approx(0.5)  # rm_by_index: half of every group
    assert is_committed(path) and path.endswith("iter_0000010")


def test_after_a_weight_sync_the_engines_sample_from_the_trained_policy(manager, group, trained):
    import ray

    synced = group.update_weights(ray.get(manager.worker_urls.remote()), 11)
    assert synced["sync/bytes"] > 0 and synced["sync/total_s"] > 0 and synced["sync/weight_version"] == "11"
    uri, _ = ray.get(manager.generate.remote(11))
    # lr 1e-2 moved every weight: engines still on the old weights differ by ~0.26 (measured), not < 1e-4
    check_first_step(group.train(11, uri))


def train_one_rank(config, placement, uri: str) -> dict:
    """Train rollout 10 (`uri`) on a fresh 1-rank group that starts from scratch; its train metrics."""
    group = TrainGroup(config, placement, world_size=1)
    try:
        assert group.init() == 0
        return group.train(10, uri)
    finally:
        group.shutdown()


@pytest.mark.slow
def test_one_rank_trains_like_two(config, placement, trained):
    uri, metrics, _, _ = trained
    single = config.model_copy(deep=True)
    single.checkpoint.save = None  # one rank must not resume the two-rank checkpoint
    # the reference-model path too: KL to a reference loaded with the same weights is 0 at the first
    # step, and k3's gradient there is 0, so loss and grad norm must still match the 2-rank run
    single.algorithm.use_kl_loss = True
    single.algorithm.kl_loss_coef = 0.5
    single.algorithm.kl_loss_type = "k3"
    alone = train_one_rank(single, placement, uri)
    check_first_step(alone)
    assert alone["rollout/kl"] == pytest.approx(0.0, abs=1e-7) and alone["train/kl_loss"] == pytest.approx(0.0, abs=1e-7)
    for name in ("train/loss", "train/pg_loss", "train/entropy_loss", "train/grad_norm",
                 "train/train_rollout_logprob_abs_diff"):
        assert alone[name] == pytest.approx(metrics[name], rel=1e-5, abs=1e-7), name


@pytest.mark.slow
def test_two_pipeline_stages_train_like_two_data_parallel_ranks(config, placement, trained):
    """--pipeline-model-parallel-size 2 over the 2 train ranks (DP 1): megatron's 1F1B schedule between the
    ranks; both return the global metrics of the 2-rank data-parallel step on the same rollout."""
    uri, metrics, _, _ = trained
    staged = config.model_copy(deep=True)
    staged.checkpoint.save = None  # must not resume the data-parallel checkpoint
    staged.megatron = {"pipeline_model_parallel_size": 2}
    group = TrainGroup(staged, placement)
    try:
        assert group.init() == 0
        piped = group.train(10, uri)
    finally:
        group.shutdown()
    check_first_step(piped)
    for name in ("train/loss", "train/pg_loss", "train/entropy_loss", "train/grad_norm",
                 "train/train_rollout_logprob_abs_diff"):
        assert piped[name] == pytest.approx(metrics[name], rel=1e-5, abs=1e-7), name


@pytest.mark.slow
def test_megatron_hooks_get_slimes_arguments(config, placement, trained, tmp_path):
    """--custom-megatron-init-path and the before-log-prob / before-train-step hooks, written to slime's
    signatures (ray_plugins), run in the train rank at slime's points with slime's arguments."""
    uri = trained[0]
    log = tmp_path / "hooks.jsonl"
    (tmp_path / "custom.yaml").write_text(f"hook_log: {log}\n")
    hooked = config.model_copy(deep=True)
    hooked.checkpoint.save = None  # start from scratch
    hooked.algorithm.use_kl_loss = True  # a reference pass too
    hooked.train.global_batch_size = ROLLOUT_BATCH * GROUP // 2  # two optimizer steps
    hooked.run.custom_config_path = str(tmp_path / "custom.yaml")
    hooked.train.custom_megatron_init_path = "ray_plugins.megatron_init"
    hooked.train.custom_megatron_before_log_prob_hook_path = "ray_plugins.before_log_prob"
    hooked.train.custom_megatron_before_train_step_hook_path = "ray_plugins.before_train_step"
    hooked.train.train_env_vars = {"SLIME_HOOK_TEST": "from --train-env-vars"}
    hooked.train.custom_advantage_function_path = "ray_plugins.constant_advantages"
    hooked.train.rollout_data_postprocess_path = "ray_plugins.double_advantages"
    hooked.train.freeze_params_name_list = ["word_embeddings"]  # partial training
    hooked.algorithm.use_rollout_entropy = True
    metrics = train_one_rank(hooked, placement, uri)
    assert metrics["train/steps"] == 2
    calls = [json.loads(line) for line in log.read_text().splitlines()]
    assert calls[0] == {"hook": "init", "dist_initialized": True, "seed": hooked.run.seed,
                        "env": "from --train-env-vars"}
    assert calls[1:3] == [{"hook": "log_prob", "store_prefix": "", "chunks": 1},
                          {"hook": "log_prob", "store_prefix": "ref_", "chunks": 1}]
    advantage, postprocess = calls[3:5]
    assert advantage["hook"] == "advantage" and advantage["samples"] == ROLLOUT_BATCH * GROUP
    assert {"rewards", "log_probs", "ref_log_probs", "kl", "loss_masks", "response_lengths",
            "total_lengths", "entropy"} <= set(advantage["keys"]) and advantage["lengths_match"]
    assert 0 < metrics["rollout/entropy"] < 20  # nats per token of a 4M-parameter model (--use-rollout-entropy)
    assert postprocess == {"hook": "postprocess", "rollout_id": 10}
    assert metrics["rollout/advantages"] == pytest.approx(2.0)  # the hook's 1, doubled by the post-process
    steps = calls[5:]
    assert [(c["hook"], c["rollout_id"], c["step_id"], c["chunks"]) for c in steps] == \
        [("train_step", 10, 0, 1), ("train_step", 10, 1, 1)]
    assert [c["scheduler_steps"] for c in steps] == [0, 1]  # called before each step's optimizer update
    assert [[n.rsplit(".", 2)[-2] for n in c["frozen"]] for c in steps] == [["word_embeddings"]] * 2
    assert steps[0]["embedding_sum"] == steps[1]["embedding_sum"]  # frozen: the first step left it
    assert steps[0]["fc1_sum"] != steps[1]["fc1_sum"]  # trained


@pytest.mark.slow
def test_checkpoint_resumes_at_the_next_rollout_with_its_state(config, placement, trained):
    _, _, state, _ = trained
    resumed = TrainGroup(config, placement)
    try:
        assert resumed.init() == 11
        assert resumed.extra_state() == {"data_source": state}
    finally:
        resumed.shutdown()


@pytest.mark.slow
def test_two_steps_per_rollout_use_the_old_log_probs(config, placement, trained):
    uri = trained[0]
    two_steps = config.model_copy(deep=True)
    two_steps.checkpoint.save = None
    two_steps.train.global_batch_size = None
    two_steps.train.num_steps_per_rollout = 2
    metrics = train_one_rank(two_steps, placement, uri)
    assert metrics["train/steps"] == 2
    # step 1's ratio is exactly 1; step 2 compares the updated policy with the rollout-time log-probs
    # (were they recomputed per step instead, ppo_kl would be 0 on both)
    assert abs(metrics["train/ppo_kl"]) > 1e-6  # a k1 estimate: either sign
    assert metrics["train/train_rollout_logprob_abs_diff"] < 1e-4  # measured before the first step


def test_a_rank_that_refuses_the_config_fails_the_group_at_once(config, placement):
    refused = config.model_copy(deep=True)
    refused.algorithm.loss_type = "sft_loss"  # what every rank refuses at init (the RL ranks train policy_loss)
    group = TrainGroup(refused, placement)
    try:
        with pytest.raises(ConfigError, match="trains policy_loss only"):
            group.init()
    finally:
        group.shutdown()
