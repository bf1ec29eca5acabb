"""`slime rl` on GLM-4.5 (`glm4_moe`), end to end on CPU: the built-in engine serves the tests' tiny GLM-4.5 kit
(tests/tiny_glm_kit_recipe.yaml: a dense first layer, 8 routed experts top-2 in 2 groups, a shared expert, a random
expert bias, scaling factor 2.5, half-rotary heads), the Megatron trainer trains it (GRPO, lr 1e-2, a KL reference
model beside the policy) and syncs it to the engine after every rollout.

With `--ci-test` the engine's log-probs must equal the trainer's after every sync: every GLM tensor (experts, shared
expert, router, expert bias, dense layer) reached the engine under the name it serves. `--check-weight-update-equal`
zeroes every engine tensor (the expert bias buffer included) before the first sync, which must restore each bit for
bit. With `--moe-router-bias-update-rate 0.01` the bias moves at every step and must reach the engine too.
R3 (`--use-rollout-routing-replay`): the engine's routed experts (-1 in the dense layer) reach the trainer and are
replayed there (a rollout whose records were moved to other experts gives a large gap)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "ray"))  # rl_setup, ray_plugins (before Ray starts)

from rl_setup import GROUP, ROLLOUT_BATCH  # noqa: E402

from slime.config import load_config  # noqa: E402
from slime.data.tiny import load_recipe, make_tiny_kit  # noqa: E402
from slime.rl import read_metrics, run_rl  # noqa: E402
from slime.storage import ArtifactStore, read_samples  # noqa: E402

RECIPE = Path(__file__).resolve().parents[1] / "tiny_glm_kit_recipe.yaml"
# |trainer - engine| mean log-prob of a rollout's tokens, both fp32: measured 1.4e-7 to 2.1e-7 at every rollout (bias
# rate 0.01 and R3 alike). With the engine's expert-bias updates dropped (a local experiment, bias rate 0.01) the gap
# was 8.1e-3 and 2.3e-3 at rollouts 1 and 2: a bias that did not sync fails this bound by ~20x and more.
SYNC_BOUND = 1e-4
# R3 with every recorded expert moved to the other group: measured 1.7e-2 (rollout 0, where engine and trainer hold
# the same weights: without replay it would be ~1.6e-7)
MOVED_ROUTING_GAP = 2e-3


@pytest.fixture(scope="module")
def glm_kit(tmp_path_factory):
    return make_tiny_kit(tmp_path_factory.mktemp("tiny-glm-kit") / "kit", load_recipe(RECIPE))


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    return tmp_path_factory.mktemp("rl-glm")


def glm_config(kit, root: Path, run_id: str, num_rollout: int, *flags: str):
    return load_config(None, [
        "--store", str(root / "store"), "--run-id", run_id, "--seed", "7", "--hf-checkpoint", str(kit.model_dir),
        "--save", str(root / run_id / "checkpoints"), "--prompt-data", str(kit.train),
        "--rollout-batch-size", str(ROLLOUT_BATCH), "--n-samples-per-prompt", str(GROUP),
        "--rollout-max-response-len", "6", "--custom-rm-path", "ray_plugins.rm_by_index",
        "--global-batch-size", str(ROLLOUT_BATCH * GROUP), "--micro-batch-size", str(ROLLOUT_BATCH * GROUP),
        "--lr", "1e-2", "--entropy-coef", "0.01", "--num-rollout", str(num_rollout),
        "--actor-num-gpus-per-node", "1", "--rollout-num-gpus", "1", "--engine", "builtin", *flags])


@pytest.fixture(scope="module")
def ray_cluster(glm_kit, root):
    from slime.ray.placement import RayCluster

    cluster = RayCluster.connect(glm_config(glm_kit, root, "sizing", 1).cluster, num_gpus=0)
    yield cluster
    cluster.shutdown()


def samples(config, rollout_id: int):
    return read_samples(ArtifactStore.from_config(config).uri(config.run.run_id, "rollout", f"{rollout_id:06d}"))


def checkpoint_tensor(checkpoint: str, key: str):
    """One tensor of a Megatron checkpoint (torch_dist, one rank), read without a process group."""
    import torch
    import torch.distributed.checkpoint as dcp

    reader = dcp.FileSystemReader(f"{checkpoint}/model")
    meta = reader.read_metadata().state_dict_metadata[key]
    tensor = torch.empty(meta.size, dtype=meta.properties.dtype)
    dcp.load({key: tensor}, storage_reader=reader, no_dist=True)
    return tensor


def test_every_glm_tensor_syncs_to_the_engine_the_moving_expert_bias_included(glm_kit, root, ray_cluster):
    from safetensors.torch import load_file

    config = glm_config(glm_kit, root, "sync", 3, "--ci-test", "--ci-train-rollout-logprob-abs-diff-threshold",
                        str(SYNC_BOUND), "--check-weight-update-equal", "--use-kl-loss", "--kl-loss-coef", "0.01",
                        "--moe-router-bias-update-rate", "0.01")
    result = run_rl(config)  # --ci-test raises on a gap above the bound, --check-weight-update-equal on a mismatch
    records = read_metrics(result["metrics_uri"])
    assert sorted(records) == [0, 1, 2]
    gaps = [records[i]["train/train_rollout_logprob_abs_diff"] for i in range(3)]
    assert all(gap < SYNC_BOUND for gap in gaps), gaps
    assert all(records[i]["weight_version"] == i + 1 for i in range(3))  # synced after every step
    assert all(abs(records[i]["rl/ppo_kl"]) < 1e-6 for i in range(3))

    # the bias moved in training (3 steps of +-0.01 per expert, megatron's aux-loss-free balancing): rollouts 1 and
    # 2 were sampled with the moved bias, else the gap above would be ~1e-2
    initial = load_file(glm_kit.model_dir / "model.safetensors")
    for layer in (1, 2):  # layer 0 is dense
        bias = checkpoint_tensor(result["last_checkpoint"], f"decoder.layers.{layer}.mlp.router.expert_bias")
        moved = bias - initial[f"model.layers.{layer}.mlp.gate.e_score_correction_bias"]
        assert moved.abs().max() <= 0.03 + 1e-6 and (moved.abs() > 0.005).any(), moved
        assert ((moved * 100).round() - moved * 100).abs().max() < 1e-3, moved  # whole steps of 0.01


@pytest.mark.slow
def test_rollout_routing_replay_takes_the_engines_experts(glm_kit, root, ray_cluster):
    config = glm_config(glm_kit, root, "r3", 2, "--use-rollout-routing-replay", "--ci-test",
                        "--ci-train-rollout-logprob-abs-diff-threshold", str(SYNC_BOUND))
    result = run_rl(config)
    records = read_metrics(result["metrics_uri"])
    gaps = [records[i]["train/train_rollout_logprob_abs_diff"] for i in (0, 1)]
    assert all(gap < SYNC_BOUND for gap in gaps), gaps
    for rollout_id in (0, 1):  # the engine's records reached the shards: every fed token, 3 layers x top-2
        for sample in samples(config, rollout_id):
            routed = sample.rollout_routed_experts
            assert routed is not None and len(routed) == len(sample.tokens) - 1
            assert all(row[:2] == [-1, -1] for row in routed)  # the dense first layer has no router
            assert all(0 <= e < 8 and row[2] != row[3] and row[4] != row[5] for row in routed for e in row[2:])

    # the trainer replays what the engine recorded: records moved to the other group's experts (a custom generate
    # function) give a gap the engine's own routing never would
    moved = glm_config(glm_kit, root, "r3-moved", 1, "--use-rollout-routing-replay",
                       "--custom-generate-function-path", "ray_plugins.generate_other_experts")
    gap = read_metrics(run_rl(moved)["metrics_uri"])[0]["train/train_rollout_logprob_abs_diff"]
    assert gap > MOVED_ROUTING_GAP, gap
