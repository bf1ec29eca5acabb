"""The four-GPU 7B configuration (deployments/gpu-7b-x4.yaml) checked on the CPU as far as it runs without GPUs:
the config loads, its layout (slime/config/layout.py) is TP 2 x DP 2 train ranks (or TP 2 x PP 2 with the
documented override) beside four one-GPU engines on the same four GPUs, Ray's placement plan and the trainer's own
split (bridge.model_parallel_sizes) agree, and layouts that cannot run are refused with the numbers."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from slime.config import load_config
from slime.config.layout import check_layout, local_model_config, parallel_layout
from slime.data.tiny import _model_config, build_tokenizer, load_recipe, padded_vocab_size
from slime.engines.launch import builtin_engine_args
from slime.errors import ConfigError
from slime.ray.placement import plan_placement

ROOT = Path(__file__).resolve().parents[1]
X4 = ROOT / "deployments" / "gpu-7b-x4.yaml"
PP2 = ["--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2"]  # the header's override


@pytest.fixture(scope="module")
def model_7b() -> dict:
    """config.json of the 7B kit's model (built from its recipe: no weights)."""
    recipe = load_recipe(ROOT / "datasets" / "gpu-7b" / "recipe.yaml")
    vocab = padded_vocab_size(len(build_tokenizer(recipe)), recipe.model.vocab_multiple)
    return _model_config(recipe.model, vocab, {}).to_dict()


def test_the_header_names_the_command_and_the_override():
    header = X4.read_text().split("\n\n")[0]
    assert "python -m flows.rl --config deployments/gpu-7b-x4.yaml" in header
    assert " ".join(PP2) in header and "NOT MEASURED" in header


def test_tp2_dp2_train_ranks_beside_four_one_gpu_engines(model_7b):
    config = load_config(X4)
    layout = check_layout(config, model_7b)
    assert (layout.train_ranks, layout.tp, layout.pp, layout.cp, layout.dp) == (4, 2, 1, 1, 2)
    assert (layout.engines, layout.gpus_per_engine, layout.colocate, layout.gpus) == (4, 1, True, 4)
    assert layout.describe() == "4 train ranks = TP 2 x PP 1 x DP 2; 4 engines of 1 GPU; colocated on 4 GPUs"
    plan = plan_placement(config.cluster, use_gpu=True)
    assert (plan.colocate, plan.num_bundles, plan.train_bundles) == (True, 4, [0, 1, 2, 3])
    assert plan.engine_bundles == [[0], [1], [2], [3]]
    from slime.backends.megatron.bridge import model_parallel_sizes

    assert model_parallel_sizes(config.megatron, plan.num_bundles) == (2, 1)
    # the trainer's settings: bf16, distributed optimizer, sequence parallel, recompute, 4096-token micro-batches
    assert config.megatron["bf16"] and config.train.use_distributed_optimizer and config.megatron["sequence_parallel"]
    assert config.megatron["recompute_granularity"] == "full" and config.train.max_tokens_per_gpu == 4096
    assert config.rollout.rollout_batch_size * config.rollout.n_samples_per_prompt == 256
    assert config.rollout.rollout_max_response_len == 1024 and config.engine.engine == "builtin"
    # one GPU per engine: no --tp-size; the slot cache sized by SGLang's flag names
    assert builtin_engine_args(config, None, 1) == ["--max-running-requests", "128", "--context-length", "2048"]
    assert builtin_engine_args(config, None, 2)[-2:] == ["--tp-size", "2"]


def test_the_tp2_pp2_override(model_7b):
    config = load_config(X4, PP2)
    layout = check_layout(config, model_7b)
    assert (layout.tp, layout.pp, layout.dp, layout.engines) == (2, 2, 1, 4)
    from slime.backends.megatron.bridge import model_parallel_sizes

    assert model_parallel_sizes(config.megatron, layout.train_ranks) == (2, 2)


@pytest.mark.parametrize(("overrides", "message"), [
    (["--tensor-model-parallel-size", "3"], "tensor_model_parallel_size 3 x pipeline_model_parallel_size 1 = 3 "
                                            "does not divide the 4 train ranks"),
    (["--pipeline-model-parallel-size", "4"], "= 8 does not divide the 4 train ranks"),
    # eight GPUs, TP 8: Qwen2.5-7B's 4 KV heads cannot be split in 8
    (["--actor-num-gpus-per-node", "8", "--tensor-model-parallel-size", "8"],
     "tensor_model_parallel_size 8 does not divide the model's num_attention_heads 28"),
    (["--actor-num-gpus-per-node", "6", "--pipeline-model-parallel-size", "3"],
     "pipeline_model_parallel_size 3 does not divide the model's 28 layers"),
    # engines of 8 GPUs: the built-in engine splits KV heads, never replicates them
    (["--actor-num-gpus-per-node", "8", "--rollout-num-gpus-per-engine", "8"],
     "rollout_num_gpus_per_engine 8: the built-in engine runs tensor parallel over its GPUs, and --tp-size 8 does "
     "not divide num_attention_heads 28, num_key_value_heads 4"),
    (["--rollout-num-gpus", "3", "--rollout-num-gpus-per-engine", "2"], "rollout_num_gpus 3 is not a multiple"),
    (["--rollout-batch-size", "1", "--n-samples-per-prompt", "3", "--global-batch-size", "3"],
     "global_batch_size 3 does not split over the 2 data-parallel ranks"),
])
def test_layouts_that_cannot_run_are_refused(model_7b, overrides, message):
    with pytest.raises(ConfigError) as info:
        check_layout(load_config(X4, overrides), model_7b)
    assert message in str(info.value)


def test_the_rl_stage_checks_the_layout_before_anything_starts(tmp_path, model_7b):
    """check_rl_config (before Ray) reads the checkpoint's config.json: TP 8 over 8 GPUs is refused there."""
    from slime.rl.loop import check_rl_config

    (tmp_path / "config.json").write_text(json.dumps(model_7b))
    assert local_model_config(str(tmp_path))["num_key_value_heads"] == 4
    bad = load_config(X4, ["--hf-checkpoint", str(tmp_path), "--actor-num-gpus-per-node", "8",
                           "--tensor-model-parallel-size", "4", "--rollout-num-gpus-per-engine", "8"])
    assert parallel_layout(bad).dp == 2
    with pytest.raises(ConfigError, match="--tp-size 8 does not divide"):
        check_rl_config(bad)
