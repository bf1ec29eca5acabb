"""Megatron-LM's `--no-X` fusion flags and checkpoint-loading flags on slime command lines (slime/megatron_flags.py,
the checkpoint section of slime/config.py): they were refused as unknown options."""

import dataclasses

import pytest

from slime.config import load_config
from slime.errors import ConfigError
from slime.megatron_flags import NEGATED

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
