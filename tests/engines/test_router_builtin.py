"""Two built-in engines behind the real sglang-router: what rollout code relies on, end to end.

Tests run in file order on one module-scoped cluster; the last one kills an engine.
"""

import asyncio
import shutil
import threading
import time

import httpx
import pytest
import torch
from safetensors.torch import load_file, save_file

from slime.engines.client import EngineClient


@pytest.fixture(scope="module")
def cluster(engine_cluster, tmp_path_factory):
    with engine_cluster(tmp_path_factory.mktemp("cluster"), health_check_interval_secs=1,
                        health_failure_threshold=1) as running:
        yield running


@pytest.fixture
def http():
    with httpx.Client(timeout=120, trust_env=False) as client:
        yield client


def generated_tokens(http, url):
    return http.get(f"{url}/server_info").json()["internal_states"][0]["generated_tokens"]


def test_generate_through_router_round_robin(cluster, http):
    router, engines = cluster
    before = [generated_tokens(http, url) for _, url in engines]
    for i in range(6):
        reply = http.post(f"{router.url}/generate", json={
            "input_ids": [49 + i, 43, 50, 61], "return_logprob": True,
            "sampling_params": {"max_new_tokens": 4, "ignore_eos": True}})
        assert reply.status_code == 200, reply.text
        meta = reply.json()["meta_info"]
        assert meta["completion_tokens"] == 4 and len(meta["output_token_logprobs"]) == 4
    served = [generated_tokens(http, url) - b for (_, url), b in zip(engines, before, strict=True)]
    assert served == [12, 12], f"round robin should split 6 requests evenly, got tokens {served}"


def test_abort_all_through_broadcast_returns_partial_tokens(cluster, http):
    router, engines = cluster
    results = []

    def long_request():
        with httpx.Client(timeout=300, trust_env=False) as client:
            results.append(client.post(f"{router.url}/generate", json={
                "input_ids": [49, 50], "sampling_params": {"max_new_tokens": 500, "ignore_eos": True}}))

    threads = [threading.Thread(target=long_request) for _ in range(2)]
    for thread in threads:
        thread.start()
    deadline = time.monotonic() + 30
    while sum(http.get(f"{url}/get_load").json()[0]["num_reqs"] for _, url in engines) < 2:
        assert time.monotonic() < deadline
        time.sleep(0.05)
    time.sleep(0.3)

    async def abort():
        async with EngineClient() as client:
            return await router.broadcast(client, "/abort_request", {"abort_all": True})

    assert set(asyncio.run(abort())) == {url for _, url in engines}
    for thread in threads:
        thread.join(timeout=60)
    assert len(results) == 2
    for reply in results:
        out = reply.json()
        assert out["meta_info"]["finish_reason"]["type"] == "abort"
        assert 0 < len(out["output_ids"]) < 500
    # no request is left running on any engine
    assert all(http.get(f"{url}/get_load").json()[0]["num_reqs"] == 0 for _, url in engines)


def test_update_weights_on_every_engine(cluster, http, tiny_kit, tmp_path):
    router, engines = cluster
    greedy = {"input_ids": [52, 43, 53, 61], "sampling_params": {"max_new_tokens": 6, "temperature": 0,
                                                                   "ignore_eos": True}}
    before = http.post(f"{router.url}/generate", json=greedy).json()["output_ids"]
    changed = tmp_path / "changed"
    shutil.copytree(tiny_kit.model_dir, changed)
    generator = torch.Generator().manual_seed(1)
    state = {k: v + 0.5 * torch.randn(v.shape, generator=generator)
             for k, v in load_file(changed / "model.safetensors").items()}
    save_file(state, changed / "model.safetensors")

    async def update(path, version):
        async with EngineClient() as client:
            await router.broadcast(client, "/pause_generation")
            replies = await router.broadcast(client, "/update_weights_from_disk",
                                             {"model_path": str(path), "weight_version": version})
            await router.broadcast(client, "/continue_generation")
            return replies

    replies = asyncio.run(update(changed, "2"))
    assert all(r["success"] for r in replies.values())
    outs = [http.post(f"{router.url}/generate", json=greedy).json() for _ in range(2)]  # one per engine
    assert all(o["meta_info"]["weight_version"] == "2" and o["output_ids"] != before for o in outs)
    assert outs[0]["output_ids"] == outs[1]["output_ids"]
    asyncio.run(update(tiny_kit.model_dir, "3"))
    assert http.post(f"{router.url}/generate", json=greedy).json()["output_ids"] == before


def test_killed_engine_is_marked_unhealthy_and_traffic_continues(cluster, http):
    router, engines = cluster
    (dead, dead_url), (_, live_url) = engines
    dead.stop()
    deadline = time.monotonic() + 30
    while True:
        states = {w["url"].rstrip("/"): w["is_healthy"] for w in router.list_workers()}
        if states.get(dead_url) is False:
            break
        assert time.monotonic() < deadline, f"router never marked {dead_url} unhealthy: {states}"
        time.sleep(0.2)
    assert states[live_url] is True
    before = generated_tokens(http, live_url)
    for i in range(4):
        reply = http.post(f"{router.url}/generate", json={"input_ids": [49, 43 + i],
                                                          "sampling_params": {"max_new_tokens": 3,
                                                                              "ignore_eos": True}})
        assert reply.status_code == 200, reply.text
    assert generated_tokens(http, live_url) - before == 12
