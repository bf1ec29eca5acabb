"""The built-in engine as a real HTTP server process, spoken to as SGLang would be."""

import shutil
import threading

import httpx
import pytest
import torch
from safetensors.torch import load_file, save_file

from slime.engines.builtin.launcher import start_builtin_engine


@pytest.fixture(scope="module")
def server(tiny_kit, tmp_path_factory):
    log = tmp_path_factory.mktemp("engine") / "engine.log"
    process, url = start_builtin_engine(str(tiny_kit.model_dir), log_path=log, random_seed=3)
    try:
        yield url
    finally:
        process.stop()
    assert not process.alive


@pytest.fixture
def http():
    with httpx.Client(timeout=120, trust_env=False) as client:
        yield client


def generate(http, url, **body):
    response = http.post(f"{url}/generate", json=body)
    assert response.status_code == 200, response.text
    return response.json()


def test_generate_shape_and_info_endpoints(server, http, tiny_kit):
    out = generate(http, server, input_ids=[49, 43, 50, 61], return_logprob=True,
                   sampling_params={"max_new_tokens": 5, "ignore_eos": True})
    assert set(out) == {"text", "output_ids", "meta_info"}
    meta = out["meta_info"]
    assert meta["finish_reason"] == {"type": "length", "length": 5}
    assert meta["weight_version"] == "default"
    assert [t for _, t, _ in meta["output_token_logprobs"]] == out["output_ids"]
    assert all(lp <= 0 and extra is None for lp, _, extra in meta["output_token_logprobs"])
    info = http.get(f"{server}/model_info").json()
    assert info["model_path"] == str(tiny_kit.model_dir) and info["is_generation"] is True
    assert http.get(f"{server}/get_model_info").json() == info
    assert http.get(f"{server}/server_info").json()["engine"] == "slime-builtin"
    assert http.get(f"{server}/v1/models").json()["data"][0]["id"] == str(tiny_kit.model_dir)
    assert http.get(f"{server}/get_load").json()[0]["num_reqs"] == 0
    for path in ("/health", "/health_generate", "/flush_cache"):
        assert http.get(f"{server}{path}").status_code == 200, path


def test_server_records_its_bursts_and_freezes_its_gc(server, http):
    """The server process freezes Python's GC over the model's objects, and /server_info's busy_period
    counts the HTTP replies of the last burst (the in-process engine has none)."""
    generate(http, server, input_ids=[49, 43, 50], sampling_params={"max_new_tokens": 3, "ignore_eos": True})
    state = http.get(f"{server}/server_info").json()["internal_states"][0]
    assert state["gc_frozen_objects"] > 10_000  # the model, tokenizer and libraries at least
    period = state["busy_period"]
    assert period["requests"] == 1 and period["replies"] == 1 and period["json_s"] > 0
    assert period["decode_rows"] == 2 and period["gc_full"] >= 0


def _generate_in_background(url, body):
    result = {}

    def target():
        with httpx.Client(timeout=300, trust_env=False) as client:
            result["response"] = client.post(f"{url}/generate", json=body)

    thread = threading.Thread(target=target)
    thread.start()
    return thread, result


def test_pause_holds_requests_until_continue(server, http):
    assert http.post(f"{server}/pause_generation").json()["status"] == "ok"
    try:
        thread, result = _generate_in_background(server, {"input_ids": [50], "sampling_params": {"max_new_tokens": 3}})
        thread.join(timeout=1.0)
        assert thread.is_alive(), "a paused engine must not finish requests"
    finally:
        assert http.post(f"{server}/continue_generation").json()["status"] == "ok"
    thread.join(timeout=60)
    assert result["response"].status_code == 200


def test_update_weights_from_disk_changes_outputs_and_version(server, http, tiny_kit, tmp_path):
    greedy = {"input_ids": [52, 43, 53, 61], "sampling_params": {"max_new_tokens": 8, "temperature": 0,
                                                                   "ignore_eos": True}}
    before = generate(http, server, **greedy)["output_ids"]
    changed = tmp_path / "changed"
    shutil.copytree(tiny_kit.model_dir, changed)
    state = load_file(changed / "model.safetensors")
    generator = torch.Generator().manual_seed(0)
    state = {k: v + 0.5 * torch.randn(v.shape, generator=generator) for k, v in state.items()}
    save_file(state, changed / "model.safetensors")

    reply = http.post(f"{server}/update_weights_from_disk", json={"model_path": str(changed), "weight_version": "v2"})
    assert reply.status_code == 200 and reply.json()["success"] is True
    after = generate(http, server, **greedy)
    assert after["output_ids"] != before
    assert after["meta_info"]["weight_version"] == "v2"
    assert http.get(f"{server}/get_weight_version").json() == {"weight_version": "v2"}
    assert http.get(f"{server}/model_info").json()["model_path"] == str(changed)

    restore = http.post(f"{server}/update_weights_from_disk",
                        json={"model_path": str(tiny_kit.model_dir), "weight_version": "v3"})
    assert restore.json()["success"] is True
    assert generate(http, server, **greedy)["output_ids"] == before

    missing = http.post(f"{server}/update_weights_from_disk", json={"model_path": str(tmp_path / "nope")})
    assert missing.status_code == 400 and missing.json()["success"] is False
    assert http.get(f"{server}/get_weight_version").json() == {"weight_version": "v3"}


@pytest.mark.parametrize(("payload", "message"), [
    (b"{not json", "not valid JSON"),
    (b'{"input_ids": []}', "input is empty"),
    (b'{"input_ids": [1], "sampling_params": {"max_new_tokens": -1}}', "max_new_tokens=-1"),
    (b'{"input_ids": ["a", "b"]}', "list of integers"),
    (b'{"input_ids": [1], "sampling_params": {"top_k": "x"}}', "top_k"),
    (b'[1, 2]', "must be a JSON object"),
])
def test_bad_requests_get_400_and_server_keeps_serving(server, http, payload, message):
    response = http.post(f"{server}/generate", content=payload, headers={"content-type": "application/json"})
    assert response.status_code == 400
    body = response.json()
    assert message in body["error"]["message"]
    assert generate(http, server, input_ids=[49], sampling_params={"max_new_tokens": 1})["output_ids"]


def test_release_and_resume_memory(server, http):
    assert http.post(f"{server}/release_memory_occupation", json={}).status_code == 200
    refused = http.post(f"{server}/generate", json={"input_ids": [49], "sampling_params": {"max_new_tokens": 1}})
    assert refused.status_code == 400 and "released" in refused.json()["error"]["message"]
    assert http.post(f"{server}/resume_memory_occupation", json={}).status_code == 200
    assert generate(http, server, input_ids=[49], sampling_params={"max_new_tokens": 1})["output_ids"]
