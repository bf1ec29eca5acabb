"""EngineFleet with slime's --rollout-external-engine-addrs: an engine a user started is registered with the
router instead of launched, serves through it, and outlives the fleet."""

import httpx
import pytest

from slime.config import load_config
from slime.config.engine_flags import external_engine_urls
from slime.engines.fleet import EngineFleet, wait_external_engine
from slime.errors import ConfigError, EngineError, EngineStartError
from slime.net import find_free_port


def test_external_addresses_are_urls():
    assert external_engine_urls(["127.0.0.1:30000", "http://h:1/", "https://h:2"]) == \
        ["http://127.0.0.1:30000", "http://h:1", "https://h:2"]
    for bad in ("localhost", "h:port", "http://h:1/path"):
        with pytest.raises(ConfigError, match="is not host:port"):
            external_engine_urls([bad])
    with pytest.raises(ConfigError, match="rollout_external_engine_addrs: 'h:x'"):
        load_config(None, ["--rollout-external-engine-addrs", "h:x"])
    with pytest.raises(ConfigError, match="external engines .* cannot be restarted"):
        load_config(None, ["--rollout-external-engine-addrs", "h:1", "--use-fault-tolerance"])


def test_an_unreachable_external_engine_is_named():
    url = f"http://127.0.0.1:{find_free_port('127.0.0.1')}"
    with pytest.raises(EngineStartError, match=f"external engine {url} .* did not answer /health_generate"):
        wait_external_engine(url, timeout_s=1.0, interval_s=0.2)


def test_external_engine_serves_through_the_router_and_outlives_the_fleet(tiny_kit, tmp_path):
    from slime.engines.builtin.launcher import start_builtin_engine

    process, url = start_builtin_engine(str(tiny_kit.model_dir), log_path=tmp_path / "user-engine.log")
    try:
        addr = url.split("://", 1)[1]  # host:port, as slime users write it
        config = load_config(None, ["--rollout-external-engine-addrs", addr])
        fleet = EngineFleet(config, str(tiny_kit.model_dir), tmp_path, devices=[[0], [1]]).start()
        try:
            assert [s.url for s in fleet.slots] == [url] and fleet.info()[0]["pid"] is None  # not ours
            reply = httpx.post(f"{fleet.router.url}/generate", timeout=120, json={
                "input_ids": [49, 43, 50], "sampling_params": {"max_new_tokens": 3, "ignore_eos": True}})
            assert reply.status_code == 200 and reply.json()["meta_info"]["completion_tokens"] == 3
            with pytest.raises(EngineError, match="cannot be restarted here"):
                fleet.restart(0)
        finally:
            fleet.stop()
        assert process.alive and httpx.get(f"{url}/health", timeout=10).status_code == 200
    finally:
        process.stop()


def test_the_builtin_engine_runs_in_the_sglang_dtype(tiny_kit, tmp_path):
    """`--sglang-dtype` reaches the built-in engine as it reaches SGLang (auto is fp32 on the CPU: bf16 shows it
    was passed); a value neither runs in is refused when the config loads, naming the flag."""
    from slime.engines.launch import launch_engine

    servers = []
    config = load_config(None, ["--sglang-dtype", "bfloat16"])
    try:
        url = launch_engine(config, str(tiny_kit.model_dir), tmp_path / "engine.log", 0, [], keep=servers.append)
        assert httpx.get(f"{url}/get_server_info", timeout=30).json()["dtype"] == "bfloat16"
    finally:
        for server in servers:
            server.stop()
    with pytest.raises(ConfigError, match=r"--sglang-dtype: sglang\.dtype: 'int8' is not a dtype the built-in engine"):
        load_config(None, ["--sglang-dtype", "int8"])
