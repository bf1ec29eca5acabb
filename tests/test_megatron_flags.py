"""Megatron-LM's `--no-X` fusion flags, checkpoint-loading flags and other launch flags on slime command lines (slime/config/megatron_flags.py,
the checkpoint section in slime/config/checkpoint.py): they were refused as unknown options."""

import dataclasses
import logging
import types

import pytest

from slime.config import load_config
from slime.config.megatron_flags import LAUNCH, NEGATED, checkpoint_mismatches
from slime.errors import ConfigError

# Megatron-LM's flag -> the TransformerConfig field it turns off (megatron/training/arguments.py and
# argument_utils.py, NVIDIA/Megatron-LM d98e8a6); written out here so a changed table fails a test
EXPECTED = {
    "--no-gradient-accumulation-fusion": "gradient_accumulation_fusion",
    "--no-rope-fusion": "apply_rope_fusion",
    "--no-masked-softmax-fusion": "masked_softmax_fusion",
    "--no-bias-swiglu-fusion": "bias_activation_fusion",
    "--no-bias-gelu-fusion": "bias_activation_fusion",
    "--no-bias-dropout-fusion": "bias_dropout_fusion",
    "--no-persist-layer-norm": "persist_layer_norm",
}


@pytest.mark.parametrize(("flag", "field"), EXPECTED.items())
def test_each_no_flag_sets_its_field_false(flag, field):
    config = load_config(None, [flag])
    assert config.megatron == {field: False}
    assert config.source(f"megatron.{field}") == flag  # later checks of the field name the flag


def test_table_targets_are_model_options_that_reach_the_transformer_config():
    from megatron.core.transformer import TransformerConfig

    from slime.backends.megatron.bridge import model_options

    assert {f"--{k.replace('_', '-')}": v for k, v in NEGATED.items()} == EXPECTED
    fields = {f.name: f for f in dataclasses.fields(TransformerConfig)}
    for field in set(NEGATED.values()):
        assert fields[field].type in (bool, "bool"), field
    off = {field: False for field in NEGATED.values()}
    assert model_options(off) == off  # each goes into the model's TransformerConfig (make_bridge)


def test_no_flag_with_false_changes_nothing_and_other_values_are_refused():
    assert load_config(None, ["--no-rope-fusion", "false"]).megatron == {}
    with pytest.raises(ConfigError, match=r"no_rope_fusion: --no-rope-fusion is a switch .* not 3"):
        load_config(None, ["--no-rope-fusion", "3"])


def test_no_flag_and_its_field_set_true_conflict():
    with pytest.raises(ConfigError, match="--no-rope-fusion sets apply_rope_fusion=False, but apply_rope_fusion is "
                                          "also given as True"):
        load_config(None, ["--no-rope-fusion", "--apply-rope-fusion", "true"])
    both_off = load_config(None, ["--no-rope-fusion", "--apply-rope-fusion", "false"])
    assert both_off.megatron == {"apply_rope_fusion": False}


def test_no_flags_in_yaml_and_megatron_config_path(tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text("megatron:\n  no_bias_swiglu_fusion: true\n  tensor_model_parallel_size: 1\n")
    assert load_config(path).megatron == {"bias_activation_fusion": False, "tensor_model_parallel_size": 1}
    roles = tmp_path / "roles.yaml"
    roles.write_text("megatron:\n  - {role: actor, overrides: {no_gradient_accumulation_fusion: true}}\n")
    config = load_config(None, ["--megatron-config-path", str(roles)])
    assert config.megatron == {"gradient_accumulation_fusion": False}


def test_other_megatron_no_flags_stay_unknown():
    """Megatron-LM flags whose options this project does not read are still refused, not silently kept."""
    with pytest.raises(ConfigError, match="unknown option --no-align-param-gather"):
        load_config(None, ["--no-align-param-gather"])


@pytest.mark.parametrize("flag", ["--no-load-optim", "--no-load-rng", "--finetune"])
def test_checkpoint_loading_flags_are_typed_fields(flag, tmp_path):
    config = load_config(None, ["--load", "/ckpt/sft", flag])
    name = flag[2:].replace("-", "_")
    assert getattr(config.checkpoint, name) is True and config.megatron == {}
    others = {"no_load_optim", "no_load_rng", "finetune"} - {name}
    assert not any(getattr(config.checkpoint, other) for other in others)
    path = tmp_path / "run.yaml"  # in the pass-through section, the typed field is named
    path.write_text(f"megatron:\n  {name}: true\n")
    with pytest.raises(ConfigError, match=f"megatron.{name}: {name} is a typed field: set it as checkpoint.{name}"):
        load_config(path)


@pytest.mark.parametrize(("load", "save"), [("/ckpt/rl", "/ckpt/rl"), ("/ckpt/rl", "/ckpt/rl/"),
                                            ("/ckpt/rl/iter_0000004", "/ckpt/rl")])
def test_loading_flags_need_a_save_directory_of_the_runs_own(load, save):
    with pytest.raises(ConfigError, match="--no-load-optim applies to the checkpoint --load names .* Give --save a "
                                          "directory of its own"):
        load_config(None, ["--load", load, "--save", save, "--no-load-optim"])
    assert load_config(None, ["--load", load, "--save", save]).checkpoint.save == save  # without the flags: fine


def test_loading_flags_with_a_save_of_its_own_or_a_relative_one():
    assert load_config(None, ["--load", "/ckpt/rl", "--save", "/ckpt/rl2", "--finetune"]).checkpoint.finetune
    assert load_config(None, ["--load", "/ckpt/rl", "--save", "ckpt", "--finetune"]).checkpoint.finetune


# --- Megatron-LM's other launch flags of slime's scripts (megatron_flags.LAUNCH) ----------------------------------

# THUDM/slime 624b824a: scripts/models/qwen2.5-0.5B.sh's MODEL_ARGS, and the PERF_ARGS and MISC_ARGS of
# scripts/run-qwen3-4B.sh (verbatim, comments dropped)
SLIME_MODEL_ARGS = ["--swiglu", "--num-layers", "24", "--hidden-size", "896", "--ffn-hidden-size", "4864",
                    "--num-attention-heads", "14", "--use-rotary-position-embeddings", "--disable-bias-linear",
                    "--add-qkv-bias", "--normalization", "RMSNorm", "--norm-epsilon", "1e-6", "--rotary-base",
                    "1000000", "--group-query-attention", "--num-query-groups", "2", "--vocab-size", "151936"]
SLIME_PERF_ARGS = ["--tensor-model-parallel-size", "2", "--sequence-parallel", "--pipeline-model-parallel-size", "1",
                   "--context-parallel-size", "1", "--expert-model-parallel-size", "1",
                   "--expert-tensor-parallel-size", "1", "--recompute-granularity", "full", "--recompute-method",
                   "uniform", "--recompute-num-layers", "1", "--use-dynamic-batch-size", "--max-tokens-per-gpu",
                   "9216"]
SLIME_MISC_ARGS = ["--attention-dropout", "0.0", "--hidden-dropout", "0.0", "--accumulate-allreduce-grads-in-fp32",
                   "--attention-softmax-in-fp32", "--attention-backend", "flash"]


def test_a_slime_script_command_line_loads():
    """Before, --accumulate-allreduce-grads-in-fp32 (in nearly every slime run script) was an unknown option."""
    config = load_config(None, ["--hf-checkpoint", "/root/Qwen2.5-0.5B-Instruct", *SLIME_MODEL_ARGS,
                                *SLIME_PERF_ARGS, *SLIME_MISC_ARGS])
    assert config.megatron["accumulate_allreduce_grads_in_fp32"] is True
    assert config.megatron["num_layers"] == 24 and config.megatron["tensor_model_parallel_size"] == 2
    assert config.train.max_tokens_per_gpu == 9216


def test_renamed_flag_value_lands_in_its_megatron_core_field():
    config = load_config(None, ["--decoder-first-pipeline-num-layers", "14", "--decoder-last-pipeline-num-layers",
                                "13"])
    assert config.megatron == {"num_layers_in_first_pipeline_stage": 14, "num_layers_in_last_pipeline_stage": 13}
    assert config.source("megatron.num_layers_in_first_pipeline_stage") == "--decoder-first-pipeline-num-layers"
    with pytest.raises(ConfigError, match="--decoder-first-pipeline-num-layers 14 is Megatron-LM's name for "
                                          "num_layers_in_first_pipeline_stage, which is also given as 3"):
        load_config(None, ["--decoder-first-pipeline-num-layers", "14", "--num-layers-in-first-pipeline-stage", "3"])


def test_renamed_targets_are_transformer_config_fields_that_reach_the_model():
    from slime.backends.megatron.bridge import model_options

    fields = {flag.field: 1 for flag in LAUNCH.values() if flag.kind == "renamed"}
    assert fields and model_options(fields) == fields


@pytest.mark.parametrize(("flags", "name"), [
    (["--use-dist-ckpt"], "use_dist_ckpt"), (["--log-interval", "1"], "log_interval"),
    (["--tokenizer-type", "HuggingFaceTokenizer"], "tokenizer_type"), (["--manual-gc"], "manual_gc"),
    (["--use-mcore-models"], "use_mcore_models"), (["--no-create-attention-mask-in-dataloader"],
                                                   "no_create_attention_mask_in_dataloader"),
    (["--dist-ckpt-strictness", "log_all"], "dist_ckpt_strictness"), (["--use-flash-attn"], "use_flash_attn"),
    (["--no-check-for-nan-in-loss-and-grad"], "no_check_for_nan_in_loss_and_grad"),
])
def test_flags_without_effect_are_accepted_and_logged_with_the_reason(flags, name, caplog):
    with caplog.at_level(logging.INFO, logger="slime.config"):
        config = load_config(None, flags)
    assert name in config.megatron
    flag = f"--{name.replace('_', '-')}"
    assert any(flag in r.message and LAUNCH[name].why in r.message for r in caplog.records), caplog.text


def test_a_flag_this_project_builds_one_way_refuses_the_other_value():
    with pytest.raises(ConfigError, match=r"megatron.accumulate_allreduce_grads_in_fp32: "
                                          r"--accumulate-allreduce-grads-in-fp32=False is not built here: .*"
                                          r"grad_reduce_in_fp32=True"):
        load_config(None, ["--accumulate-allreduce-grads-in-fp32", "false"])
    with pytest.raises(ConfigError, match=r"--use-dist-ckpt is a switch; give it no value or true/false, not 3"):
        load_config(None, ["--use-dist-ckpt", "3"])


@pytest.mark.parametrize(("flags", "reason"), [
    (["--spec", "slime_plugins.models.glm4"], "custom layer specs .* are not built here"),
    (["--q-lora-rank", "1536"], "multi-latent attention .* is not built here"),
    (["--use-gated-attention"], "gated attention comes from a slime_plugins layer spec"),
    (["--enable-experimental"], "experimental features are not enabled here"),
])
def test_flags_that_matter_and_are_not_built_are_refused_with_the_reason(flags, reason):
    name = flags[0][2:].replace("-", "_")
    with pytest.raises(ConfigError, match=f"megatron.{name}: {flags[0]} is refused: .*{reason}"):
        load_config(None, flags)


def test_shape_flags_are_kept_for_the_checkpoint_check_and_typed_here():
    config = load_config(None, ["--rotary-percent", "0.5", "--use-rope-scaling", "--apply-layernorm-1p",
                                "--num-experts", "8"])
    assert config.megatron == {"rotary_percent": 0.5, "use_rope_scaling": True, "apply_layernorm_1p": True,
                               "num_experts": 8}
    with pytest.raises(ConfigError, match=r"--rotary-percent must be a number in \(0, 1\], got 2"):
        load_config(None, ["--rotary-percent", "2"])


def test_checkpoint_values_come_from_the_hf_config():
    """bridge.make_bridge compares with these (the tiny-kit run is tests/backends/megatron/test_launch_flags.py)."""
    from transformers import LlamaConfig, PhiConfig

    llama31 = LlamaConfig(rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                        "high_freq_factor": 4.0, "original_max_position_embeddings": 8192},
                          max_position_embeddings=131072)
    dense = types.SimpleNamespace(layernorm_zero_centered_gamma=False, num_moe_experts=None)
    assert checkpoint_mismatches({"use_rope_scaling": True, "rotary_percent": 1.0}, llama31, dense) == []
    assert checkpoint_mismatches({"rotary_percent": 0.5}, PhiConfig(partial_rotary_factor=0.5), dense) == []
    refused = checkpoint_mismatches({"use_rope_scaling": True, "rotary_percent": 0.5, "num_experts": 8},
                                    LlamaConfig(), dense)
    assert refused == [
        "megatron.num_experts: --num-experts 8, but the checkpoint gives None (" + LAUNCH["num_experts"].why + ")",
        "megatron.rotary_percent: --rotary-percent 0.5, but the checkpoint gives 1.0 ("
        + LAUNCH["rotary_percent"].why + ")",
        "megatron.use_rope_scaling: --use-rope-scaling True, but the checkpoint gives False ("
        + LAUNCH["use_rope_scaling"].why + ")"]


def test_typos_of_launch_flags_stay_unknown():
    with pytest.raises(ConfigError, match="unknown option --accumulate-allreduce-grad-in-fp32; did you mean "
                                          "'accumulate-allreduce-grads-in-fp32'"):
        load_config(None, ["--accumulate-allreduce-grad-in-fp32"])


def test_launch_flags_in_a_megatron_config_path_role(tmp_path):
    roles = tmp_path / "roles.yaml"
    roles.write_text("megatron:\n  - {role: actor, overrides: {accumulate_allreduce_grads_in_fp32: true, "
                     "decoder_first_pipeline_num_layers: 2}}\n")
    config = load_config(None, ["--megatron-config-path", str(roles)])
    assert config.megatron == {"accumulate_allreduce_grads_in_fp32": True, "num_layers_in_first_pipeline_stage": 2}


def test_launch_table_shadows_nothing_and_the_reference_lists_it():
    from slime.config import FIELD_SECTION, megatron_flag_names
    from slime.config_reference import reference_markdown

    assert not set(LAUNCH) & (megatron_flag_names() | set(FIELD_SECTION) | set(NEGATED))
    assert all((flag.from_checkpoint is not None) == (flag.kind == "checkpoint") for flag in LAUNCH.values())
    reference = reference_markdown()
    for name, flag in LAUNCH.items():
        assert f"| `--{name.replace('_', '-')}` | {flag.kind}" in reference, name
