"""SGLang launcher: pass-through flag validation and command building (SGLang itself cannot run on CPU)."""

import dataclasses
import importlib.util
import sys
import types

import pytest

from slime.config import engine_flags
from slime.config.engine_flags import check_sglang_args, known_sglang_flags, pinned_sglang_flags
from slime.engines.sglang_server import SGLangEngine, build_sglang_command
from slime.errors import ConfigError, EngineStartError

pytestmark = pytest.mark.timeout(60)
SGLANG_INSTALLED = importlib.util.find_spec("sglang") is not None


@pytest.fixture
def pinned_only(monkeypatch):
    """Validate against the pinned 0.5.23 list even where SGLang happens to be installed."""
    monkeypatch.setattr(engine_flags, "installed_sglang_flags", lambda: None)


def test_pinned_flag_list():
    flags = pinned_sglang_flags()
    assert len(flags) == 560
    assert {"--mem-fraction-static", "--tp-size", "--disable-cuda-graph", "--model-path"} <= flags
    assert all(f.startswith("--") and " " not in f for f in flags)


def test_good_flags_pass(pinned_only):
    check_sglang_args({"mem_fraction_static": 0.7, "tp_size": 2, "disable_cuda_graph": True,
                       "cuda_graph_max_bs_decode": 64, "attention-backend": "torch_native"})
    check_sglang_args({})


def test_typo_suggests_closest_flag(pinned_only):
    with pytest.raises(ConfigError) as err:
        check_sglang_args({"mem_fraction_statc": 0.7})
    msg = str(err.value)
    assert "--sglang-mem-fraction-statc is not a flag of SGLang 0.5.23" in msg
    assert "did you mean --sglang-mem-fraction-static?" in msg


def test_all_problems_in_one_message(pinned_only):
    with pytest.raises(ConfigError) as err:
        check_sglang_args({"tp_sise": 2, "mem_fraction_static": 0.5, "zzzz_qqqq": 1})
    msg = str(err.value)
    assert "--sglang-tp-sise" in msg and "--sglang-tp-size" in msg
    assert "--sglang-zzzz-qqqq is not a flag" in msg and "did you mean" not in msg.split("zzzz-qqqq")[1]
    assert "mem-fraction-static" not in msg


@pytest.mark.parametrize(("key", "hint"), [
    ("model_path", "checkpoint.hf_checkpoint"),
    ("model", "alias of --model-path"),
    ("host", "binds each engine"),
    ("port", "engine.sglang_router_port"),
    ("config", "sglang:"),
])
def test_reserved_keys_rejected(pinned_only, key, hint):
    with pytest.raises(ConfigError) as err:
        check_sglang_args({key: "x"})
    msg = str(err.value)
    assert f"--sglang-{key.replace('_', '-')} cannot be passed through" in msg
    assert hint in msg


def test_build_command_exact(pinned_only):
    cmd = build_sglang_command(
        "/models/qwen", "127.0.0.1", 30001,
        {"mem_fraction_static": 0.7, "disable_cuda_graph": True, "enable_metrics": False,
         "cuda_graph_bs_decode": [1, 2, 4], "json_model_override_args": {"rope_theta": 1e6},
         "tp-size": 2, "chunked_prefill_size": None},
        python="/venv/bin/python",
    )
    assert cmd == [
        "/venv/bin/python", "-m", "sglang.launch_server",
        "--model-path", "/models/qwen", "--host", "127.0.0.1", "--port", "30001",
        "--mem-fraction-static", "0.7",
        "--disable-cuda-graph",
        "--cuda-graph-bs-decode", "1", "2", "4",
        "--json-model-override-args", '{"rope_theta": 1000000.0}',
        "--tp-size", "2",
    ]


def test_build_command_validates(pinned_only):
    with pytest.raises(ConfigError, match="--sglang-mem-fraction-static"):
        build_sglang_command("/m", "127.0.0.1", 1, {"mem_fraction_statc": 0.7})
    with pytest.raises(ConfigError, match="cannot be passed through"):
        build_sglang_command("/m", "127.0.0.1", 1, {"port": 5})


def test_installed_sglang_is_the_reference(monkeypatch):
    """With SGLang importable, its ServerArgs fields and parser flags decide (here a fake version)."""

    @dataclasses.dataclass
    class ServerArgs:
        model_path: str = ""
        host: str = "127.0.0.1"
        port: int = 30000
        brand_new_option: int = 0

        @staticmethod
        def add_cli_args(parser):
            parser.add_argument("--brand-new-option", type=int)
            parser.add_argument("--only-a-cli-alias", type=int)

    fake = types.ModuleType("sglang")
    fake.__version__ = "9.9.9"
    srt = types.ModuleType("sglang.srt")
    server_args = types.ModuleType("sglang.srt.server_args")
    server_args.ServerArgs = ServerArgs
    monkeypatch.setitem(sys.modules, "sglang", fake)
    monkeypatch.setitem(sys.modules, "sglang.srt", srt)
    monkeypatch.setitem(sys.modules, "sglang.srt.server_args", server_args)
    engine_flags.installed_sglang_flags.cache_clear()
    try:
        version, flags = known_sglang_flags()
        assert version == "9.9.9" and "--brand-new-option" in flags and "--only-a-cli-alias" in flags
        check_sglang_args({"brand_new_option": 3, "only_a_cli_alias": 1})
        with pytest.raises(ConfigError, match="not a flag of SGLang 9.9.9; did you mean --sglang-brand-new-option"):
            check_sglang_args({"brand_new_optio": 3})
        with pytest.raises(ConfigError, match="--sglang-mem-fraction-static is not a flag of SGLang 9.9.9"):
            check_sglang_args({"mem_fraction_static": 0.5})  # in 0.5.23's list, not in this version
    finally:
        engine_flags.installed_sglang_flags.cache_clear()


def test_engine_validates_at_construction(pinned_only):
    with pytest.raises(ConfigError, match="did you mean --sglang-mem-fraction-static"):
        SGLangEngine("/m", sglang_args={"mem_fraction_statc": 0.7})


def test_engine_command_picks_port(pinned_only, tmp_path):
    engine = SGLangEngine(tmp_path, sglang_args={"mem_fraction_static": 0.5}, python="py")
    with pytest.raises(RuntimeError, match="call start"):
        _ = engine.url
    cmd = engine.command()
    assert engine.port is not None and engine.url == f"http://127.0.0.1:{engine.port}"
    assert cmd == ["py", "-m", "sglang.launch_server", "--model-path", str(tmp_path), "--host", "127.0.0.1",
                   "--port", str(engine.port), "--mem-fraction-static", "0.5"]


@pytest.mark.skipif(SGLANG_INSTALLED, reason="checks the failure path where SGLang is not installed")
def test_engine_start_fails_fast_with_log(pinned_only, tmp_path):
    engine = SGLangEngine(tmp_path, log_path=tmp_path / "sglang.log", startup_timeout_s=60)
    with pytest.raises(EngineStartError) as err:
        engine.start()
    assert "No module named 'sglang'" in str(err.value) and "sglang.launch_server" in str(err.value)
    assert not engine.alive
    engine.stop()  # idempotent after a failed start
