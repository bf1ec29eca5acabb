"""Flags of THUDM/slime's launch scripts (scripts/*.sh at 624b824a) that this project answered with "unknown option"
or "not a flag of SGLang": slime's PD-disaggregation flag (slime_flags.LAUNCHER_REFUSED), the SGLang flags the
scripts spell by an older SGLang's names (engine_flags.RENAMED_SGLANG_ARGS), Megatron-LM's --fp8-format
(megatron_flags.LAUNCH), and the scripts' Ray command lines' options (slime_flags.RAY_CLI)."""

import logging

import pytest

from slime.config import engine_flags, load_config
from slime.config.engine_flags import RENAMED_SGLANG_ARGS, pinned_sglang_flags, renamed_sglang_args
from slime.config.slime_flags import LAUNCHER_REFUSED, LAUNCHER_ROUTER, RAY_CLI, REFUSED, slime_flags
from slime.errors import ConfigError

# scripts/run-glm5-744B-A40B.sh's SGLANG_ARGS, verbatim (comments and blank lines dropped)
GLM5_SGLANG_ARGS = ["--rollout-num-gpus-per-engine", "64", "--sglang-mem-fraction-static", "0.70",
                    "--sglang-enable-dp-attention", "--sglang-ep-size", "64", "--sglang-dp-size", "64",
                    "--sglang-moe-dense-tp-size", "1", "--sglang-enable-dp-lm-head", "--sglang-moe-a2a-backend",
                    "deepep", "--sglang-deepep-mode", "auto", "--prefill-num-servers", "1",
                    "--sglang-speculative-algorithm", "EAGLE", "--sglang-speculative-num-steps", "3",
                    "--sglang-speculative-eagle-topk", "1", "--sglang-speculative-num-draft-tokens", "4",
                    "--sglang-page-size", "64", "--sglang-nsa-decode-backend", "flashmla_sparse",
                    "--sglang-nsa-prefill-backend", "flashmla_sparse", "--sglang-attention-backend", "nsa",
                    "--sglang-cuda-graph-max-bs", "8", "--sglang-max-running-requests", "512",
                    "--sglang-chunked-prefill-size", "131072", "--sglang-watchdog-timeout", "3600"]

# the old name's value in slime's scripts -> SGLang 0.5.23's flag (written out so a changed table fails a test)
EXPECTED_RENAMES = {
    ("--sglang-cuda-graph-max-bs", ("64",)): ("cuda_graph_max_bs_decode", 64),  # run-glm4.7-30B-A3B.sh
    ("--sglang-cuda-graph-bs", ("1", "2", "4", "8", "16")): ("cuda_graph_bs_decode", [1, 2, 4, 8, 16]),  # moonlight
    ("--sglang-mamba-scheduler-strategy", ("extra_buffer",)): ("mamba_radix_cache_strategy", "extra_buffer"),
    ("--sglang-nsa-decode-backend", ("flashmla_sparse",)): ("dsa_decode_backend", "flashmla_sparse"),
    ("--sglang-nsa-prefill-backend", ("flashmla_sparse",)): ("dsa_prefill_backend", "flashmla_sparse"),
}


@pytest.fixture
def pinned_only(monkeypatch):
    """Validate against the pinned 0.5.23 list even where SGLang happens to be installed."""
    monkeypatch.setattr(engine_flags, "installed_sglang_flags", lambda: None)


# --- --prefill-num-servers: slime's prefill/decode disaggregation ------------------------------------------------

def test_prefill_num_servers_is_refused_with_the_reason():
    with pytest.raises(ConfigError, match=r"--prefill-num-servers: megatron.prefill_num_servers: slime's "
                                          r"--prefill-num-servers is not supported here: prefill/decode "
                                          r"disaggregation is not built here: .*--rollout-num-gpus"):
        load_config(None, ["--prefill-num-servers", "1"])


def test_prefill_num_servers_in_yaml_names_the_reason(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("engine:\n  prefill_num_servers: 1\n")
    with pytest.raises(ConfigError, match=r"c.yaml:2: unknown field 'engine.prefill_num_servers'; slime's "
                                          r"--prefill-num-servers is not supported here: prefill/decode"):
        load_config(path)


def test_launcher_table_holds_flags_outside_slimes_own_table():
    """LAUNCHER_REFUSED is slime's SGLang launcher's flags, which slime_flags.tsv (utils/arguments.py) lacks."""
    assert not set(LAUNCHER_REFUSED) & ({f.name for f in slime_flags()} | set(REFUSED))
    assert all(len(reason) < 160 and "\n" not in reason for reason in LAUNCHER_REFUSED.values())


def test_slimes_sglang_config_is_refused_with_its_meaning(pinned_only):
    with pytest.raises(ConfigError, match=r"--sglang-config cannot be passed through: slime's --sglang-config \(a "
                                          r"YAML of models and server groups.*is not built here"):
        load_config(None, ["--sglang-config", "deploy.yaml"])


def test_slimes_router_timeout_flag_sets_the_routers_option(caplog):
    """slime's --sglang-router-request-timeout-secs (its launcher's; slime hands it to RouterArgs) was refused as
    "not a flag of SGLang": it reached the sglang pass-through by its prefix."""
    with caplog.at_level(logging.INFO, logger="slime.config"):
        config = load_config(None, ["--sglang-router-request-timeout-secs", "14400"])
    assert config.router == {"request_timeout_secs": 14400} and config.sglang == {}
    assert config.source("router.request_timeout_secs") == "--sglang-router-request-timeout-secs"
    assert any("--sglang-router-request-timeout-secs: passed to the router as --router-request-timeout-secs" in
               r.message for r in caplog.records), caplog.text
    same = load_config(None, ["--sglang-router-request-timeout-secs", "60", "--router-request-timeout-secs", "60"])
    assert same.router == {"request_timeout_secs": 60}
    with pytest.raises(ConfigError, match=r"--sglang-router-request-timeout-secs: slime's "
                                          r"--sglang-router-request-timeout-secs 14400 sets the router's "
                                          r"--request-timeout-secs, which is also given as 5; keep one"):
        load_config(None, ["--sglang-router-request-timeout-secs", "14400", "--router-request-timeout-secs", "5"])


def test_router_table_targets_are_router_options_and_no_config_fields():
    from slime.config import FIELD_SECTION
    from slime.config.engine_flags import check_router_args

    for name, (option, _) in LAUNCHER_ROUTER.items():
        assert name.startswith("sglang_router_") and name not in FIELD_SECTION
        check_router_args({option: 1})  # a real sglang-router flag


# --- SGLang flags under an older SGLang's names ------------------------------------------------------------------

@pytest.mark.parametrize(("given", "expected"), EXPECTED_RENAMES.items(), ids=[f for f, _ in EXPECTED_RENAMES])
def test_old_sglang_name_is_passed_under_the_new_one_and_logged(pinned_only, given, expected, caplog):
    (flag, values), (new, value) = given, expected
    with caplog.at_level(logging.INFO, logger="slime.config"):
        config = load_config(None, [flag, *values])
    assert config.sglang == {new: value}
    assert config.source(f"sglang.{new}") == flag  # later messages about the new name name the flag given
    dashed = new.replace("_", "-")
    assert any(f"{flag}: SGLang 0.5.23 names it --{dashed}, passed to the engines as --sglang-{dashed}" in r.message
               for r in caplog.records), caplog.text


def test_rename_table_is_old_names_sglang_lacks_and_new_names_it_has():
    flags = pinned_sglang_flags()
    assert {(old, new) for old, (new, _) in RENAMED_SGLANG_ARGS.items()} == {
        (flag[len("--sglang-"):].replace("-", "_"), new) for (flag, _), (new, _) in EXPECTED_RENAMES.items()}
    for old, (new, why) in RENAMED_SGLANG_ARGS.items():
        assert f"--{old.replace('_', '-')}" not in flags and f"--{new.replace('_', '-')}" in flags, old
        assert why and "\n" not in why


def test_a_slime_script_sglang_section_loads_but_for_its_pd_flag(pinned_only):
    with pytest.raises(ConfigError, match="--prefill-num-servers is not supported here"):
        load_config(None, GLM5_SGLANG_ARGS)
    at = GLM5_SGLANG_ARGS.index("--prefill-num-servers")
    config = load_config(None, GLM5_SGLANG_ARGS[:at] + GLM5_SGLANG_ARGS[at + 2:])
    assert config.sglang["dsa_decode_backend"] == config.sglang["dsa_prefill_backend"] == "flashmla_sparse"
    assert config.sglang["cuda_graph_max_bs_decode"] == 8 and config.sglang["attention_backend"] == "nsa"
    assert not {"nsa_decode_backend", "nsa_prefill_backend", "cuda_graph_max_bs"} & set(config.sglang)
    assert config.cluster.rollout_num_gpus_per_engine == 64


def test_old_and_new_name_with_different_values_conflict(pinned_only):
    with pytest.raises(ConfigError, match=r"--sglang-cuda-graph-max-bs 64 is SGLang's old name of "
                                          r"--cuda-graph-max-bs-decode, which is also given as 32; keep one of them"):
        load_config(None, ["--sglang-cuda-graph-max-bs", "64", "--sglang-cuda-graph-max-bs-decode", "32"])
    same = load_config(None, ["--sglang-cuda-graph-max-bs", "64", "--sglang-cuda-graph-max-bs-decode", "64"])
    assert same.sglang == {"cuda_graph_max_bs_decode": 64}


def test_yaml_spelling_of_an_old_name_is_renamed(pinned_only, tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("sglang:\n  mamba-scheduler-strategy: no_buffer\n  mem-fraction-static: 0.7\n")
    assert load_config(path).sglang == {"mamba_radix_cache_strategy": "no_buffer", "mem-fraction-static": 0.7}


def test_an_installed_sglang_that_knows_the_old_name_keeps_it(monkeypatch):
    """Validation follows the importable SGLang (engine_flags.known_sglang_flags); an older one has the old flag."""
    old_sglang = frozenset({"--cuda-graph-max-bs", "--mem-fraction-static"})
    monkeypatch.setattr(engine_flags, "installed_sglang_flags", lambda: ("0.5.9", old_sglang))
    assert load_config(None, ["--sglang-cuda-graph-max-bs", "64"]).sglang == {"cuda_graph_max_bs": 64}
    assert renamed_sglang_args({"cuda_graph_max_bs": 64}, old_sglang) == ({"cuda_graph_max_bs": 64}, {})


# --- Megatron-LM's --fp8-format -------------------------------------------------------------------------------------

def test_fp8_format_is_megatron_lms_name_for_fp8():
    """slime's scripts/low_precision/run-qwen3-30b-a3b-fp8.sh; make_bridge refuses FP8 without Transformer Engine
    (tests/backends/megatron/test_launch_flags.py)."""
    config = load_config(None, ["--fp8-format", "e4m3", "--fp8-recipe", "blockwise"])
    assert config.megatron == {"fp8": "e4m3", "fp8_recipe": "blockwise"}
    assert config.source("megatron.fp8") == "--fp8-format"
    with pytest.raises(ConfigError, match="--fp8-format 'e4m3' is Megatron-LM's name for fp8, which is also given "
                                          "as 'hybrid'"):
        load_config(None, ["--fp8-format", "e4m3", "--fp8", "hybrid"])


# --- the scripts' `ray start` / `ray job submit` / `ray stop` options ---------------------------------------------

# scripts/run-qwen3-4B.sh's Ray lines, verbatim (`ray start ...`, `ray job submit ... -- python3 train.py`), and
# `ray stop --force` of the scripts' cleanup
RAY_OPTIONS = [["--head"], ["--node-ip-address", "127.0.0.1"], ["--num-gpus", "8"], ["--disable-usage-stats"],
               ["--dashboard-host=0.0.0.0"], ["--dashboard-port=8265"], ["--address=http://127.0.0.1:8265"],
               ['--runtime-env-json={"env_vars": {"CUDA_DEVICE_MAX_CONNECTIONS": "1"}}'], ["--force"]]


@pytest.mark.parametrize("tokens", RAY_OPTIONS, ids=lambda tokens: tokens[0].split("=")[0])
def test_ray_command_line_options_stay_unknown_and_say_whose_they_are(tokens):
    name = tokens[0][2:].split("=")[0].replace("-", "_")
    with pytest.raises(ConfigError, match=f"unknown option --{name.replace('_', '-')}; an option of the scripts' "
                                          f"`ray (start|job submit|stop)` line, not of slime's train.py: "):
        load_config(None, tokens)
    assert RAY_CLI[name]


def test_ray_options_are_not_names_this_project_accepts():
    from slime.config import FIELD_SECTION, megatron_flag_names
    from slime.config.megatron_flags import LAUNCH

    assert not set(RAY_CLI) & (set(FIELD_SECTION) | megatron_flag_names() | set(LAUNCH) | set(REFUSED))
    assert "runtime_env_json" in RAY_CLI and "--train-env-vars" in RAY_CLI["runtime_env_json"]
