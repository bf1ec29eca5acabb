"""Every flag of slime's own argument parser (slime/config/slime_flags.tsv) is accepted with slime's name, type and
default, or refused with a one-line reason naming the flag: a slime launch script never has a flag silently
ignored."""

from __future__ import annotations

import ast
import json
import logging
from typing import Any

import pytest

from slime.config import FIELD_SECTION, Config, _field_kind, load_config
from slime.config.slime_flags import (
    DEFAULTS_DIFFER,
    MAPPED,
    PLUGIN_ONLY,
    REFUSED,
    SlimeFlag,
    slime_flags,
    source_commit,
)
from slime.config_reference import classify, flag_table_markdown, summary
from slime.errors import ConfigError

FLAGS = slime_flags()

# flags whose value only validates beside others (as in a real launch script)
COMPANIONS: dict[str, list[str]] = {
    "--save-interval": ["--save", "/tmp/ckpt"],
    "--kl-loss-coef": ["--use-kl-loss"],
    "--custom-tis-function-path": ["--use-tis"],
    "--debug-train-only": ["--load-debug-rollout-data", "runs/r/rollout/{rollout_id:06d}"],
    "--use-dynamic-batch-size": ["--max-tokens-per-gpu", "1024"],
    "--rollout-max-prompt-len": ["--hf-checkpoint", "/tmp/hf"],
    "--rollout-max-context-len": ["--hf-checkpoint", "/tmp/hf"],  # prompts default to at most context - 1 tokens
    "--update-weight-disk-keep-files": ["--weight-sync-mode", "disk"],
    "--custom-update-weight-post-write-path": ["--weight-sync-mode", "disk"],
    "--update-weight-local-checkpoint-dir": ["--update-weight-mode", "delta", "--weight-sync-mode", "disk"],
    "--use-stateless-adam": ["--no-save-optim"],
    "--release-train": ["--save", "/tmp/ckpt"],
    "--balance-by-flops": ["--use-dynamic-batch-size", "--max-tokens-per-gpu", "1024"],
    "--disable-rollout-global-dataset": ["--rollout-function-path", "my.rollout"],
    "--ref-update-interval": ["--use-kl-loss"],
    "--load-debug-rollout-data-subsample": ["--load-debug-rollout-data", "runs/r/rollout/{rollout_id:06d}"],
    "--use-opd": ["--opd-type", "megatron", "--opd-teacher-load", "/tmp/teacher"],
    "--opd-type": ["--use-opd", "--opd-teacher-load", "/tmp/teacher"],
    "--opd-teacher-load": ["--use-opd", "--opd-type", "megatron"],
    "--num-critic-only-steps": ["--advantage-estimator", "ppo"],
}
# values a plain "2" / "0.5" / "x" would not satisfy
VALUES: dict[str, list[str]] = {
    "--eps-clip-c": ["3.0"],
    "--eval-prompt-data": ["aime", "/data/aime.jsonl"],
    "--rollout-stop": ["</answer>"],
    "--apply-chat-template-kwargs": ['{"enable_thinking": false}'],
    "--ci-train-rollout-logprob-abs-diff-threshold": ["0.05"],
    "--rollout-external-engine-addrs": ["127.0.0.1:30000", "http://10.0.0.2:30001"],
    "--opd-type": ["megatron"],  # sglang is refused (test_opd_flags_are_validated_as_slime_does)
}


def example_args(flag: SlimeFlag) -> list[str]:
    """The flag with a value of slime's type, as a slime user would write it."""
    if flag.flag in VALUES:
        values = VALUES[flag.flag]
    elif flag.type == "bool":
        values = []
    elif flag.choices:
        values = [flag.choices.split(",")[0]]
    elif flag.type == "int":
        values = ["2"]
    elif flag.type == "float":
        values = ["0.5"]
    elif flag.type == "json.loads":
        values = ["{}"]
    else:
        values = ["/some/path" if "path" in flag.name or "dir" in flag.name else "x"]
    return [flag.flag, *values, *COMPANIONS.get(flag.flag, [])]


def test_table_is_slimes_arguments_at_a_named_commit():
    assert len(source_commit()) == 40
    assert len(FLAGS) == 223  # 202 add_argument + 21 reset_arg in slime's arguments.py at that commit
    assert len({f.flag for f in FLAGS}) == len(FLAGS)
    assert all(f.flag.startswith("--") and f.type and f.group for f in FLAGS)
    by_flag = {f.flag: f for f in FLAGS}
    assert by_flag["--rollout-batch-size"].type == "int"
    assert by_flag["--disable-rewards-normalization"].dest == "rewards_normalization"


def test_every_flag_is_classified_and_tables_are_consistent():
    names = {f.name for f in FLAGS}
    assert not (set(REFUSED) - names), "REFUSED names a flag slime does not have"
    assert not (set(MAPPED) - names), "MAPPED names a flag slime does not have"
    assert not (set(DEFAULTS_DIFFER) - names)
    assert not (set(REFUSED) & set(MAPPED))
    assert not (set(REFUSED) & set(FIELD_SECTION)), "a refused flag is also a config field"
    assert not (set(MAPPED) - set(FIELD_SECTION)), "a mapped flag needs a config field"
    unknown = [f.flag for f in FLAGS if classify(f)[0] == "unknown"]
    assert unknown == []
    assert all(len(reason) < 160 and "\n" not in reason for reason in REFUSED.values())


@pytest.mark.parametrize("flag", [f for f in FLAGS if f.name in REFUSED], ids=lambda f: f.flag)
def test_refused_flag_fails_naming_flag_and_reason(flag):
    with pytest.raises(ConfigError) as info:
        load_config(None, example_args(flag))
    message = str(info.value)
    assert flag.flag in message
    assert REFUSED[flag.name] in message


def test_refused_flag_in_yaml_names_the_reason(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("rollout:\n  freeze_indexer: true\n")
    with pytest.raises(ConfigError, match=r"c.yaml:2: unknown field 'rollout.freeze_indexer'.*DSA indexer layers"):
        load_config(path)
    path.write_text("megatron:\n  freeze_indexer: true\n")
    with pytest.raises(ConfigError, match=r"c.yaml:2: megatron.freeze_indexer: slime's --freeze-indexer is "
                                          "not supported"):
        load_config(path)


def _expected(flag: SlimeFlag, args: list[str]) -> Any:
    values = args[1:len(args) - len(COMPANIONS.get(flag.flag, []))]
    if not values:
        return True
    return values


def _slime_default(flag: SlimeFlag) -> Any:
    default = ast.literal_eval(flag.default)
    return json.loads(default) if flag.type == "json.loads" and isinstance(default, str) else default


@pytest.mark.parametrize("flag", [f for f in FLAGS if f.name not in REFUSED], ids=lambda f: f.flag)
def test_accepted_flag_sets_its_field_with_slimes_type_and_default(flag, tmp_path):
    args = example_args(flag)
    if flag.flag == "--custom-config-path":  # must name a YAML file
        (tmp_path / "custom.yaml").write_text("my_threshold: 3\n")
        args = [flag.flag, str(tmp_path / "custom.yaml")]
    if flag.flag == "--megatron-config-path":  # must name a role YAML
        (tmp_path / "roles.yaml").write_text("megatron: []\n")
        args = [flag.flag, str(tmp_path / "roles.yaml")]
    config = load_config(None, args)
    name = flag.name
    if name not in FIELD_SECTION:  # a Megatron flag slime re-declares: the pass-through takes it
        assert name in config.megatron
        return
    section = FIELD_SECTION[name]
    value = getattr(getattr(config, section), name)
    given = _expected(flag, args)
    kind = _field_kind(section, name)
    if flag.type == "bool":
        assert kind == "bool" and value is True
    elif flag.nargs in ("+", "*") or flag.action == "append":
        assert kind in ("list", "dict")
        assert value == (dict(zip(given[::2], given[1::2], strict=True)) if kind == "dict" else
                         [type(value[0])(v) for v in given])
    elif flag.type == "json.loads":
        assert value == json.loads(given[0])
    else:
        expect = {"int": int, "float": float}.get(flag.type, str)(given[0])
        assert value == expect and type(value) is type(expect)
    default = Config.model_fields[section].annotation.model_fields[name]
    default = default.default_factory() if default.default_factory else default.default
    if name in DEFAULTS_DIFFER:  # declared different: it must be
        assert default != _slime_default(flag)
    else:
        assert default == _slime_default(flag), f"{flag.flag}: default {default!r}, slime's {flag.default}"


def test_mapped_flag_is_logged_once(caplog):
    for name in MAPPED:
        flag = next(f for f in FLAGS if f.name == name)
        caplog.clear()
        with caplog.at_level(logging.INFO, logger="slime.config"):
            load_config(None, example_args(flag))
        lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith(f"{flag.flag}:")]
        assert len(lines) == 1 and MAPPED[name] in lines[0]


def test_flag_table_lists_every_flag_with_its_state():
    table = flag_table_markdown()
    counts = summary()
    assert counts["total"] == 223
    assert counts["accepted"] + counts.get("mapped", 0) + counts["refused"] == 223
    for flag in FLAGS:
        assert f"| `{flag.flag}` |" in table
    assert f"{counts['accepted']} accepted" in table


# ----------------------------------------------------------------------------- what accepted flags do


def test_offload_is_both_offloads():
    c = load_config(None, ["--offload"]).cluster
    assert c.offload_train is True and c.offload_rollout is True
    assert load_config(None, []).cluster.offload_train is None
    with pytest.raises(ConfigError, match="offload_train is false"):
        load_config(None, ["--offload", "--offload-train", "false"])


def test_tb_names_give_slimes_tensorboard_dir():
    run = load_config(None, ["--tb-project-name", "proj", "--tb-experiment-name", "exp"]).run
    assert run.tensorboard_dir == "tensorboard_log/proj/exp"
    assert load_config(None, ["--tb-project-name", "proj", "--run-id", "r1"]).run.tensorboard_dir == \
        "tensorboard_log/proj/r1"
    given = load_config(None, ["--tb-project-name", "proj", "--tensorboard-dir", "/tmp/tb"]).run
    assert given.tensorboard_dir == "/tmp/tb"  # an explicit directory wins


def test_update_weight_transport_picks_the_sync_mode():
    assert load_config(None, ["--update-weight-transport", "disk"]).sync.weight_sync_mode == "disk"
    assert load_config(None, ["--update-weight-transport", "nccl"]).sync.weight_sync_mode == "distributed"
    with pytest.raises(ConfigError, match="means weight_sync_mode distributed"):
        load_config(None, ["--update-weight-transport", "nccl", "--weight-sync-mode", "disk"])


def test_opd_flags_fill_the_typed_fields():
    config = load_config(None, ["--use-opd", "--opd-type", "megatron", "--opd-kl-coef", "0.25", "--opd-teacher-load",
                                "/ckpt/teacher", "--opd-teacher-ckpt-step", "3"])
    a, ck = config.algorithm, config.checkpoint
    assert (a.use_opd, a.opd_type, a.opd_kl_coef) == (True, "megatron", 0.25)
    assert (ck.opd_teacher_load, ck.opd_teacher_ckpt_step) == ("/ckpt/teacher", 3)
    plain = load_config(None, [])
    assert (plain.algorithm.use_opd, plain.algorithm.opd_type, plain.algorithm.opd_kl_coef) == (False, None, 1.0)


@pytest.mark.parametrize(("args", "reason"), [
    (["--use-opd"], "algorithm.opd_type: --use-opd needs --opd-type"),
    (["--use-opd", "--opd-type", "megatron"], "checkpoint.opd_teacher_load: --opd-type megatron needs the teacher"),
    (["--opd-teacher-load", "/t"], "checkpoint.opd_teacher_load: is set but use_opd is not"),
    (["--use-opd", "--opd-type", "sglang"], "algorithm.opd_type: sglang .* not built here.*--opd-type megatron"),
    (["--use-opd", "--opd-type", "megatron", "--opd-teacher-load", "/t", "--lora-rank", "8"],
     "algorithm.use_opd: a Megatron OPD teacher next to LoRA adapters is not built here"),
    (["--use-opd", "--opd-type", "megatron", "--opd-teacher-load", "/t", "--disable-compute-advantages-and-returns"],
     "use_opd needs the reference/old log-prob passes"),
    (["--use-opd", "--opd-type", "teacher", "--opd-teacher-load", "/t"], "opd_type"),
])
def test_opd_flags_are_validated_as_slime_does(args, reason):
    with pytest.raises(ConfigError, match=reason):
        load_config(None, args)


@pytest.mark.parametrize(("args", "reason"), [
    (["--update-weight-mode", "delta", "--weight-sync-mode", "tensor"], "disk or distributed transport, not tensor"),
    (["--update-weight-mode", "delta", "--colocate"], r"not tensor .*weight_sync_mode is auto \(tensor: colocate"),
    (["--update-weight-local-checkpoint-dir", "/tmp/l", "--update-weight-mode", "delta"], "only used by the disk delta"),
    (["--update-weight-delta-encoding", "overwrite", "--update-weight-mode", "delta"], "applies to the disk delta"),
    (["--update-weight-mode", "delta", "--weight-sync-mode", "disk"], "needs update_weight_local_checkpoint_dir"),
    (["--rollout-data-transport", "nixl"], "NIXL is not built here"),
])
def test_values_not_built_are_refused_with_a_reason(args, reason):
    with pytest.raises(ConfigError, match=f"{args[0]}: .*{reason}"):
        load_config(None, args)


def test_delta_over_the_distributed_transport_is_accepted():
    for extra in ([], ["--update-weight-transport", "nccl"], ["--weight-sync-mode", "distributed"]):
        sync = load_config(None, ["--update-weight-mode", "delta", "--update-weight-delta-checksum", "blake3",
                                  *extra]).sync
        assert sync.update_weight_mode == "delta" and sync.update_weight_delta_checksum == "blake3"


def test_custom_config_attributes_reach_plugin_args(tmp_path):
    path = tmp_path / "custom.yaml"
    path.write_text("my_threshold: 0.3\nmy_tags: [a, b]\n")
    args = load_config(None, ["--custom-config-path", str(path)]).as_namespace()
    assert args.my_threshold == 0.3 and args.my_tags == ["a", "b"]
    path.write_text("rollout_batch_size: 8\n")
    with pytest.raises(ConfigError, match=r"--custom-config-path: .*'rollout_batch_size' is a config field: set it "
                                          r"as --rollout-batch-size"):
        load_config(None, ["--custom-config-path", str(path)])
    path.write_text("- a\n")
    with pytest.raises(ConfigError, match="expected a mapping"):
        load_config(None, ["--custom-config-path", str(path)])
    with pytest.raises(ConfigError, match="no such file"):
        load_config(None, ["--custom-config-path", str(tmp_path / "missing.yaml")])


def test_eval_min_new_tokens_is_an_eval_sampling_param():
    from slime.rollout.generate import sampling_params_from_args

    args = load_config(None, ["--eval-min-new-tokens", "3"]).as_namespace()
    assert sampling_params_from_args(args, evaluation=True)["min_new_tokens"] == 3
    assert "min_new_tokens" not in sampling_params_from_args(args)


@pytest.mark.parametrize(("args", "reason"), [
    (["--use-stateless-adam"], "set no_save_optim"),
    (["--use-stateless-adam", "--no-save-optim", "--optimizer", "sgd"], "needs optimizer adam"),
    (["--ref-update-interval", "2"], "no reference model to update"),
    (["--disable-compute-advantages-and-returns", "--use-kl-loss"], "use_kl_loss needs the reference"),
    (["--disable-compute-advantages-and-returns", "--custom-advantage-function-path", "m.f"],
     "custom_advantage_function_path needs"),
    (["--load-debug-rollout-data-subsample", "0.5"], "set load_debug_rollout_data"),
])
def test_trainer_flags_refuse_what_they_cannot_do(args, reason):
    with pytest.raises(ConfigError, match=f"{args[0]}: .*{reason}"):
        load_config(None, args)


def test_plugin_only_flags_reach_plugins_and_say_so_once(caplog):
    assert set(PLUGIN_ONLY) <= set(FIELD_SECTION) and not set(PLUGIN_ONLY) & (set(MAPPED) | set(REFUSED))
    for name, note in PLUGIN_ONLY.items():
        flag = next(f for f in FLAGS if f.name == name)
        caplog.clear()
        with caplog.at_level(logging.INFO, logger="slime.config"):
            args = load_config(None, example_args(flag)).as_namespace()
        assert getattr(args, name) == _expected(flag, example_args(flag))[0] or flag.type != "str"
        lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith(f"{flag.flag}:")]
        assert len(lines) == 1 and note in lines[0]
        assert classify(flag) == ("accepted", f"{FIELD_SECTION[name]}.{name}: {note}")
    assert load_config(None, ["--fetch-trajectory-retry-times", "3"]).as_namespace().fetch_trajectory_retry_times == 3


def test_megatron_config_path_applies_the_actor_overrides(tmp_path, caplog):
    path = tmp_path / "roles.yaml"
    path.write_text("megatron:\n"
                    "  - name: default\n    role: actor\n    overrides:\n      lr: 1e-5\n"
                    "      tensor_model_parallel_size: 2\n      num_nodes: 4\n"
                    "  - name: value\n    role: critic\n    overrides: {lr: 2e-6}\n")
    with caplog.at_level(logging.INFO, logger="slime.config"):
        config = load_config(None, ["--megatron-config-path", str(path), "--lr", "3e-6"])
    assert config.train.lr == 1e-5  # the role file wins over the flag, as in slime
    assert config.megatron["tensor_model_parallel_size"] == 2 and config.cluster.actor_num_nodes == 1
    assert config.source("train.lr") == f"{path} (actor overrides.lr)"
    assert any("role 'critic' is not trained here" in r.getMessage() for r in caplog.records)
    path.write_text("megatron:\n  - {role: actor, overrides: {lr_typo: 1}}\n")
    with pytest.raises(ConfigError, match="actor override 'lr_typo' is neither"):
        load_config(None, ["--megatron-config-path", str(path)])
    path.write_text("megatron:\n  - {role: actor}\n  - {role: actor}\n")
    with pytest.raises(ConfigError, match="2 entries with role actor"):
        load_config(None, ["--megatron-config-path", str(path)])
    path.write_text("actor: {lr: 1}\n")
    with pytest.raises(ConfigError, match="needs a top-level 'megatron' list"):
        load_config(None, ["--megatron-config-path", str(path)])


def test_padded_vocab_size_is_the_bridges_padding(tiny_kit):
    from slime.stages.convert import vocab_padding

    model = str(tiny_kit.model_dir)  # vocabulary 384
    assert vocab_padding(load_config(None, []), model) == 128  # Megatron's default multiple
    assert vocab_padding(load_config(None, ["--make-vocab-size-divisible-by", "64"]), model) == 64
    assert vocab_padding(load_config(None, ["--padded-vocab-size", "512"]), model) == 512
    for bad in (["--padded-vocab-size", "300"], ["--padded-vocab-size", "513", "--tensor-model-parallel-size", "2"]):
        with pytest.raises(ConfigError, match="padded_vocab_size .* must be an integer >= the vocabulary"):
            vocab_padding(load_config(None, bad), model)


def test_slimes_boolean_optional_flags_take_their_no_spelling():
    """slime declares --offload-train / --offload-rollout with argparse.BooleanOptionalAction: its scripts may say
    --no-offload-train. Every such flag of slime's table is negatable here, and the negation takes no value."""
    from slime.config import _NEGATABLE

    assert {f.name for f in slime_flags() if f.action == "BooleanOptionalAction"} == _NEGATABLE
    for name in sorted(_NEGATABLE):
        flag = "--no-" + name.replace("_", "-")
        assert getattr(load_config(None, [flag]).cluster, name) is False
        with pytest.raises(ConfigError, match=f"{flag} takes no value"):
            load_config(None, [flag, "true"])
