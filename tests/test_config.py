import textwrap

import pytest

from slime.config import FIELD_SECTION, Config, load_config, parse_overrides
from slime.errors import ConfigError


def _yaml(tmp_path, text):
    path = tmp_path / "c.yaml"
    path.write_text(textwrap.dedent(text))
    return path


def test_slime_flag_names_map_to_sections():
    expected = {
        "rollout_batch_size": "rollout", "n_samples_per_prompt": "rollout", "global_batch_size": "train",
        "num_rollout": "rollout", "advantage_estimator": "algorithm", "kl_loss_coef": "algorithm",
        "eps_clip": "algorithm", "eps_clip_high": "algorithm", "prompt_data": "data", "input_key": "data",
        "label_key": "data", "apply_chat_template": "data", "rollout_max_response_len": "rollout",
        "save_interval": "checkpoint", "eval_interval": "eval", "colocate": "cluster", "store": "run",
        "run_id": "run",
    }
    assert {k: FIELD_SECTION[k] for k in expected} == expected


def test_yaml_then_cli_overrides(tmp_path):
    path = _yaml(tmp_path, """
        rollout:
          rollout_batch_size: 8
          n_samples_per_prompt: 4
        train:
          global_batch_size: 16
        """)
    cfg = load_config(path, [
        "--n-samples-per-prompt", "2", "--lr=3e-5", "--colocate", "--rollout-stop", "<|im_end|>", "\n\n",
        "--eval-prompt-data", "gsm8k", "/d/gsm.jsonl", "aime", "/d/aime.jsonl",
        "--apply-chat-template-kwargs", '{"enable_thinking": false}', "--rollout-top-k", "-1",
        "--store", "s3://bucket/runs", "--run-id", "exp1",
    ])
    assert cfg.rollout.rollout_batch_size == 8
    assert cfg.rollout.n_samples_per_prompt == 2
    assert cfg.train.lr == 3e-5
    assert cfg.cluster.colocate is True
    assert cfg.rollout.rollout_stop == ["<|im_end|>", "\n\n"]
    assert cfg.eval.eval_prompt_data == {"gsm8k": "/d/gsm.jsonl", "aime": "/d/aime.jsonl"}
    assert cfg.data.apply_chat_template_kwargs == {"enable_thinking": False}
    assert cfg.rollout.rollout_top_k == -1
    assert (cfg.run.store, cfg.run.run_id) == ("s3://bucket/runs", "exp1")


def test_pass_through_sections():
    cfg = load_config(None, [
        "--sglang-mem-fraction-static", "0.7", "--sglang-enable-memory-saver", "--sglang-chunked-prefill-size", "4096",
        "--router-policy", "cache_aware", "--tensor-model-parallel-size", "2", "--weight-decay-incr-style", "cosine",
    ])
    assert cfg.sglang == {"mem_fraction_static": 0.7, "enable_memory_saver": True, "chunked_prefill_size": 4096}
    assert cfg.router == {"policy": "cache_aware"}
    assert cfg.megatron == {"tensor_model_parallel_size": 2, "weight_decay_incr_style": "cosine"}
    # slime's own sglang_* field is a typed field, not a pass-through
    assert load_config(None, ["--sglang-server-concurrency", "64"]).rollout.sglang_server_concurrency == 64


def test_namespace_has_slime_attribute_names():
    cfg = load_config(None, ["--rollout-batch-size", "4", "--sglang-router-port", "3000", "--sglang-tp-size", "2",
                             "--num-layers", "2"])
    args = cfg.as_namespace()
    assert args.rollout_batch_size == 4
    assert args.sglang_router_port == 3000 and args.sglang_router_ip == "127.0.0.1"
    assert args.sglang_tp_size == 2
    assert args.num_layers == 2
    assert args.advantage_estimator == "grpo"


def test_type_error_names_file_line_and_field(tmp_path):
    path = _yaml(tmp_path, """
        rollout:
          n_samples_per_prompt: 4
          rollout_batch_size: many
        """)
    with pytest.raises(ConfigError) as err:
        load_config(path)
    assert f"{path}:4: rollout.rollout_batch_size" in str(err.value)
    assert "'many'" in str(err.value)


def test_cli_type_error_names_flag():
    with pytest.raises(ConfigError, match="--rollout-temperature: rollout.rollout_temperature: Input should be greater"):
        load_config(None, ["--rollout-temperature", "0"])


def test_unknown_and_misplaced_keys(tmp_path):
    with pytest.raises(ConfigError, match=r"c.yaml:2: unknown field 'rollout.rollout_batch_szie'; did you mean "
                                          r"'rollout_batch_size'"):
        load_config(_yaml(tmp_path, "rollout:\n  rollout_batch_szie: 3\n"))
    with pytest.raises(ConfigError, match=r"c.yaml:2: unknown field 'rollout.lr'; it belongs under 'train:'"):
        load_config(_yaml(tmp_path, "rollout:\n  lr: 0.1\n"))
    with pytest.raises(ConfigError, match=r"c.yaml:1: unknown section 'rollout_batch_size'; it belongs under 'rollout:'"):
        load_config(_yaml(tmp_path, "rollout_batch_size: 3\n"))
    with pytest.raises(ConfigError, match="unknown section 'rolout'; did you mean 'rollout'"):
        load_config(_yaml(tmp_path, "rolout: {}\n"))
    with pytest.raises(ConfigError, match="invalid YAML"):
        load_config(_yaml(tmp_path, "rollout: [\n"))
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(tmp_path / "missing.yaml")


def test_unknown_megatron_flag_suggests_closest():
    with pytest.raises(ConfigError, match="unknown option --tensor-model-paralel-size; did you mean "
                                          "'tensor-model-parallel-size'"):
        load_config(None, ["--tensor-model-paralel-size", "2"])


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["--rollout-batch-size", "5", "--n-samples-per-prompt", "4", "--global-batch-size", "8"],
         "5 \\* 4 = 20 must be a multiple of global_batch_size \\(8\\)"),
        (["--kl-coef", "0.1", "--use-kl-loss", "--kl-loss-coef", "0.01"], "are exclusive"),
        (["--kl-loss-coef", "0.01"], "use_kl_loss is false"),
        (["--eps-clip-c", "0.5"], "must be > 1"),
        (["--num-critic-only-steps", "2"], "--num-critic-only-steps: algorithm.num_critic_only_steps: "
         "num_critic_only_steps 2 trains only the PPO critic for the first rollouts, and advantage_estimator 'grpo' "
         "has no critic: set --advantage-estimator ppo"),
        (["--num-critic-only-steps", "-1"], "greater than or equal to 0"),
        (["--pipeline-model-parallel-size", "2", "--virtual-pipeline-model-parallel-size", "2"],
         "megatron.virtual_pipeline_model_parallel_size: virtual pipeline stages"),
        (["--advantage-estimator", "reinforce_plus_plus"], "needs normalize_advantages"),
        (["--use-dynamic-batch-size"], "needs max_tokens_per_gpu"),
        (["--run-id", "../other"], "--run-id: run.run_id: .*must be one directory name"),
        (["--store", "foo://x"], "--store: run.store: unknown storage protocol 'foo'"),
        (["--global-batch-size", "8", "--num-steps-per-rollout", "2"], "not both"),
        (["--rollout-batch-size", "8", "--over-sampling-batch-size", "4"], "smaller than rollout_batch_size"),
        (["--use-tis", "--tis-clip-low", "3"], "must be below tis_clip"),
        (["--advantage-estimator", "grpoo"], "Input should be 'grpo'"),
        (["--colocate", "maybe"], "expected no value or true/false"),
        (["--rollout-batch-size"], "missing value"),
        (["rollout_batch_size", "3"], "unexpected argument"),
    ],
)
def test_cross_field_and_flag_errors(overrides, message):
    with pytest.raises(ConfigError, match=message):
        load_config(None, overrides)


def test_critic_only_steps_need_the_ppo_critic():
    assert load_config(None, []).algorithm.num_critic_only_steps == 0  # slime's default: the actor always trains
    ppo = load_config(None, ["--advantage-estimator", "ppo", "--num-critic-only-steps", "2"]).algorithm
    assert (ppo.advantage_estimator, ppo.num_critic_only_steps) == ("ppo", 2)
    # the LoRA train path builds no critic
    with pytest.raises(ConfigError, match="algorithm.advantage_estimator: ppo trains a value critic.*lora_rank 0"):
        load_config(None, ["--advantage-estimator", "ppo", "--lora-rank", "4"])


def test_context_len_gives_slime_defaults():
    bounded = load_config(None, ["--rollout-max-context-len", "100", "--hf-checkpoint", "m"])
    assert bounded.data.rollout_max_prompt_len == 99 and bounded.eval.eval_max_context_len == 100  # slime
    args = bounded.as_namespace()
    assert (args.rollout_max_prompt_len, args.eval_max_context_len) == (99, 100)
    cfg = load_config(None, ["--rollout-max-context-len", "100", "--hf-checkpoint", "m",
                             "--rollout-max-prompt-len", "60", "--eval-max-context-len", "300"])
    assert (cfg.data.rollout_max_prompt_len, cfg.eval.eval_max_context_len) == (60, 300)  # set: kept
    cfg = load_config(None, [])
    assert cfg.data.rollout_max_prompt_len is None and cfg.eval.eval_max_context_len is None  # unbounded
    # the defaults survive the config's round trip to the rollout and train actors, and apply there too
    assert Config.model_validate(bounded.model_dump()).data.rollout_max_prompt_len == 99
    assert Config.model_validate({"rollout": {"rollout_max_context_len": 8}}).eval.eval_max_context_len == 8


@pytest.mark.parametrize(("overrides", "message"), [
    (["--rollout-max-context-len", "100", "--rollout-max-prompt-len", "100", "--hf-checkpoint", "m"],
     r"^--rollout-max-prompt-len: data.rollout_max_prompt_len: 100 must be at most rollout_max_context_len - 1 = 99"
     r".*\[rollout.rollout_max_context_len set at --rollout-max-context-len\]"),
    (["--rollout-max-context-len", "100"],
     r"^--rollout-max-context-len: rollout.rollout_max_context_len: drops prompts longer than .* 99 tokens .*"
     r"needs checkpoint.hf_checkpoint"),
    (["--rollout-max-context-len", "1", "--hf-checkpoint", "m"],
     r"--rollout-max-context-len: rollout.rollout_max_context_len: Input should be greater than or equal to 2"),
])
def test_context_len_errors_name_the_flags(overrides, message):
    with pytest.raises(ConfigError, match=message):
        load_config(None, overrides)


def test_section_hash_is_stable_and_sensitive(tmp_path):
    a = load_config(_yaml(tmp_path, "rollout:\n  rollout_batch_size: 8\n  n_samples_per_prompt: 2\n"))
    b = load_config(None, ["--n-samples-per-prompt", "2", "--rollout-batch-size", "8"])
    assert a.section_hash("rollout") == b.section_hash("rollout")
    assert a.section_hash() == b.section_hash()
    c = load_config(None, ["--n-samples-per-prompt", "2", "--rollout-batch-size", "9"])
    assert c.section_hash("rollout") != a.section_hash("rollout")
    assert c.section_hash("train") == a.section_hash("train")
    assert len(a.section_hash("rollout")) == 64
    with pytest.raises(ConfigError, match="unknown config section"):
        a.section_hash("rollouts")


def test_section_hash_ignores_values_left_at_their_defaults(tmp_path):
    """Only values set away from their defaults are hashed: a config that spells a default out, or a later
    version that adds a field with a default, keeps the hash of what is committed under it (rejection
    sampling's reusable output); a changed value still changes it."""
    plain = load_config(None, ["--rollout-batch-size", "8"])
    spelled = load_config(_yaml(tmp_path, "rollout:\n  rollout_batch_size: 8\n  rollout_temperature: 1.0\n"
                                          "  rollout_http_timeout_s: null\ntrain:\n  compile_scores: null\n"))
    assert spelled.rollout.rollout_temperature == type(spelled.rollout)().rollout_temperature  # a default
    assert plain.section_hash("rollout", "train") == spelled.section_hash("rollout", "train")
    hotter = load_config(None, ["--rollout-batch-size", "8", "--rollout-temperature", "0.7"])
    assert hotter.section_hash("rollout") != plain.section_hash("rollout")


def test_require_lists_every_missing_field():
    with pytest.raises(ConfigError, match=r"stage 'rl' needs: rollout.rollout_batch_size \(--rollout-batch-size\), "
                                          r"data.prompt_data \(--prompt-data\)"):
        Config().require("rollout.rollout_batch_size", "data.prompt_data", stage="rl")
    Config(rollout={"rollout_batch_size": 2}).require("rollout.rollout_batch_size", stage="rl")


def test_parse_overrides_records_origins():
    nested, origin = parse_overrides(["--eps-clip=0.3", "--sglang-tp-size", "2"])
    assert nested == {"algorithm": {"eps_clip": "0.3"}, "sglang": {"tp_size": 2}}
    assert origin == {"algorithm.eps_clip": "--eps-clip", "sglang.tp_size": "--sglang-tp-size"}


def test_unknown_sglang_and_router_flags_name_the_closest_real_one():
    with pytest.raises(ConfigError, match=r"(?s)--sglang-mem-fraction-statc: .*did you mean --sglang-mem-fraction-static"):
        load_config(None, ["--sglang-mem-fraction-statc", "0.5"])
    with pytest.raises(ConfigError, match=r"(?s)--router-polcy: .*did you mean --router-policy"):
        load_config(None, ["--router-polcy", "round_robin"])
    with pytest.raises(ConfigError, match="--sglang-port cannot be passed through"):
        load_config(None, ["--sglang-port", "3000"])


def test_sft_schedule_overrides_train_for_sft_only_and_is_checked():
    config = load_config(overrides=["--lr", "1e-5", "--min-lr", "1e-6", "--sft-lr", "2e-3",
                                    "--sft-lr-decay-style", "cosine"])
    assert (config.train.lr, config.train.lr_decay_style) == (1e-5, "constant")
    sft = config.sft_train()
    assert (sft.lr, sft.min_lr, sft.lr_decay_style) == (2e-3, 1e-6, "cosine")
    with pytest.raises(ConfigError, match=r"sft\.sft_min_lr: min_lr 0\.01 is above lr 0\.002"):
        load_config(overrides=["--sft-lr", "2e-3", "--sft-min-lr", "1e-2"])


# ----------------------------------------------------------------------------- LoRA


def test_lora_targets_map_hf_names_to_megatron_layers():
    config = load_config(None, ["--lora-rank", "8", "--lora-alpha", "32",
                                "--target-modules", "q_proj,k_proj,v_proj,down_proj"])
    assert config.lora.enabled and config.lora.scale == 4.0
    assert config.lora.megatron_targets() == ["linear_qkv", "linear_fc2"]
    assert load_config(None, ["--lora-rank", "4"]).lora.megatron_targets() == \
        ["linear_qkv", "linear_proj", "linear_fc1", "linear_fc2"]
    assert not load_config(None, []).lora.enabled


@pytest.mark.parametrize("targets, message", [
    ("q_proj", "q_proj lives in Megatron's fused linear_qkv .*missing k_proj, v_proj"),
    ("gate_proj,down_proj", "gate_proj lives in Megatron's fused linear_fc1 .*missing up_proj"),
    ("lm_head", "'lm_head' maps to no Megatron linear layer"),
    ("all-linear,o_proj", "all-linear already names every linear layer"),
])
def test_lora_targets_that_cannot_map_are_refused(targets, message):
    with pytest.raises(ConfigError, match=f"--target-modules: lora.target_modules: .*{message}"):
        load_config(None, ["--lora-rank", "8", "--target-modules", targets])


def test_lora_refuses_partial_training_lists_and_an_adapter_without_rank():
    with pytest.raises(ConfigError, match="--only-train-params-name-list: train.only_train_params_name_list: LoRA"):
        load_config(None, ["--lora-rank", "8", "--only-train-params-name-list", "mlp"])
    with pytest.raises(ConfigError, match="--lora-adapter-path: lora.lora_adapter_path: .* set lora_rank"):
        load_config(None, ["--lora-adapter-path", "runs/x/sft/checkpoint"])


def test_lora_adapter_sync_flags_and_refusals():
    from slime.engines.launch import lora_engine_args
    from slime.engines.sglang_server import build_sglang_command
    from slime.sync import resolve_mode

    config = load_config(None, ["--lora-rank", "8", "--target-modules", "q_proj,k_proj,v_proj,down_proj",
                                "--lora-sync", "adapter"])
    assert resolve_mode(config.sync, colocated=True) == "adapter"
    assert lora_engine_args(config) == {"enable_lora": True, "max_lora_rank": 8,
                                        "lora_target_modules": ["q_proj", "k_proj", "v_proj", "down_proj"]}
    assert lora_engine_args(load_config(None, ["--lora-rank", "8"])) == {}, "merged (the default) needs no flags"
    command = build_sglang_command("model", "127.0.0.1", 30000, lora_engine_args(config))  # SGLang validates them
    assert command[command.index("--enable-lora"):] == ["--enable-lora", "--max-lora-rank", "8", "--lora-target-modules",
                                                        "q_proj", "k_proj", "v_proj", "down_proj"]
    with pytest.raises(ConfigError, match="--lora-sync: sync.lora_sync: adapter sync sends LoRA adapters"):
        load_config(None, ["--lora-sync", "adapter"])
    with pytest.raises(ConfigError, match="sync.lora_sync: .* weight_sync_mode distributed sends full tensors"):
        load_config(None, ["--lora-rank", "8", "--lora-sync", "adapter", "--weight-sync-mode", "distributed"])
    with pytest.raises(ConfigError, match="sync.lora_sync: .* delta sync does not apply"):
        load_config(None, ["--lora-rank", "8", "--lora-sync", "adapter", "--update-weight-mode", "delta",
                           "--update-weight-local-checkpoint-dir", "/tmp/x", "--weight-sync-mode", "disk"])
    with pytest.raises(ConfigError, match="sglang.max_lora_rank: 4 is below lora.lora_rank 8"):
        load_config(None, ["--lora-rank", "8", "--lora-sync", "adapter", "--engine", "sglang",
                           "--sglang-max-lora-rank", "4"])
    kept = load_config(None, ["--lora-rank", "8", "--lora-sync", "adapter", "--update-weight-disk-keep-files"])
    assert kept.sync.update_weight_disk_keep_files, "adapter sync writes to the disk dir: its options apply"


def test_share_gpu_fractions_and_what_they_imply():
    from slime.engines.launch import engine_memory_limit
    from slime.sync import resolve_mode

    config = load_config(None, ["--share-gpu", "--train-gpu-fraction", "0.6", "--rollout-gpu-fraction", "0.4",
                                "--async-mode", "fully"])
    assert config.cluster.gpu_fractions() == (0.6, 0.4) and not config.cluster.colocate
    assert resolve_mode(config.sync, config.cluster.same_gpus) == "tensor"  # NCCL cannot pair ranks on one GPU
    assert engine_memory_limit(config) == 0.4  # the built-in engine's whole cap
    sglang = load_config(None, ["--share-gpu", "--engine", "sglang"])
    assert sglang.cluster.gpu_fractions() == (0.5, 0.5)
    assert engine_memory_limit(sglang) == 0.4  # SGLang's flag counts weights and KV cache only
    given = load_config(None, ["--share-gpu", "--engine", "sglang", "--sglang-mem-fraction-static", "0.3"])
    assert engine_memory_limit(given) == 0.3
    assert engine_memory_limit(load_config(None, [])) is None


@pytest.mark.parametrize(("argv", "message"), [
    (["--share-gpu", "--colocate"], r"cluster.share_gpu: .*colocate makes them take turns.*choose one"),
    (["--share-gpu", "--offload-rollout"], r"offload_rollout \(or offload\) cannot be set"),
    (["--share-gpu", "--offload"], r"offload_train \(or offload\) cannot be set"),
    (["--share-gpu", "--train-gpu-fraction", "0.6", "--rollout-gpu-fraction", "0.5"],
     r"train_gpu_fraction 0.6 \+ rollout_gpu_fraction 0.5 = 1.1 is more than one GPU"),
    (["--share-gpu", "--train-gpu-fraction", "0.7"], r"0.7 \+ rollout_gpu_fraction 0.5 = 1.2"),
    (["--rollout-gpu-fraction", "0.3"], r"--rollout-gpu-fraction: cluster.rollout_gpu_fraction: applies only with "
                                        r"cluster.share_gpu"),
    (["--share-gpu", "--weight-sync-mode", "distributed"], r"NCCL refuses two ranks on one device"),
    (["--share-gpu", "--update-weight-transport", "nccl"], r"NCCL refuses two ranks on one device"),
    (["--share-gpu", "--engine", "sglang", "--sglang-mem-fraction-static", "0.7"],
     r"sglang.mem_fraction_static: 0.7 is above the engine's part of the shared GPU, rollout_gpu_fraction 0.5"),
    (["--share-gpu", "--rollout-gpu-fraction", "1"], r"rollout_gpu_fraction"),
])
def test_share_gpu_refuses_what_one_gpu_cannot_hold(argv, message):
    with pytest.raises(ConfigError, match=message):
        load_config(None, argv)


def test_custom_loss_is_refused_when_the_config_is_read_naming_what_to_use():
    with pytest.raises(ConfigError, match=r"--loss-type: algorithm.loss_type: custom_loss .* use policy_loss or "
                                          r"sft_loss.*custom_loss_function_path set at --custom-loss-function-path"):
        load_config(None, ["--loss-type", "custom_loss", "--custom-loss-function-path", "plugins.my_loss"])
    assert load_config(None, ["--loss-type", "sft_loss"]).algorithm.loss_type == "sft_loss"


def test_rollout_http_timeout_defaults_to_none_and_is_not_below_the_routers(tmp_path):
    """None (no client limit: the router bounds a generation); a number must not cut what the router
    allows: at least --router-request-timeout-secs, else sglang-router's own default."""
    from sglang_router.router_args import RouterArgs

    from slime.config.engine_flags import ROUTER_REQUEST_TIMEOUT_S

    assert RouterArgs.request_timeout_secs == ROUTER_REQUEST_TIMEOUT_S  # the installed router's default
    assert load_config(None, []).rollout.rollout_http_timeout_s is None
    assert load_config(None, ["--rollout-http-timeout-s", "1800"]).rollout.rollout_http_timeout_s == 1800
    with pytest.raises(ConfigError, match=r"--rollout-http-timeout-s: rollout.rollout_http_timeout_s: 600 s is "
                                          r"below the router's request timeout, 1800 s \(--sglang-router-request"):
        load_config(None, ["--rollout-http-timeout-s", "600"])
    # slime's launcher flag raises the router's bound, and with it the floor
    with pytest.raises(ConfigError, match=r"7200 s is below the router's request timeout, 14400 s.*"
                                          r"router.request_timeout_secs set at --sglang-router-request-timeout-secs"):
        load_config(None, ["--sglang-router-request-timeout-secs", "14400", "--rollout-http-timeout-s", "7200"])
    # a lower router bound (YAML, the router's own spelling) allows a lower client limit
    path = _yaml(tmp_path, """
        rollout:
          rollout_http_timeout_s: 600
        router:
          request-timeout-secs: 300
    """)
    assert load_config(path).rollout.rollout_http_timeout_s == 600
    with pytest.raises(ConfigError, match=r"greater than 0"):
        load_config(None, ["--rollout-http-timeout-s", "0"])
