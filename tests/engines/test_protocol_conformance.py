"""The engine protocol (DESIGN.md section 4), checked the same way against every engine.

Targets: the built-in engine (always, started here) and a real SGLang server, marked `sglang` and
selected explicitly: `SLIME_TEST_SGLANG_URL=http://127.0.0.1:30000 pytest -m sglang
tests/engines/test_protocol_conformance.py`. Token ids are small so that they are valid in
any vocabulary; nothing assumes a particular model.
"""

import os
import threading
import time

import httpx
import pytest

from slime.engines.builtin.launcher import start_builtin_engine

SGLANG_URL = os.environ.get("SLIME_TEST_SGLANG_URL")


@pytest.fixture(scope="module", params=["builtin", pytest.param("sglang", marks=pytest.mark.sglang)])
def target(request, tiny_kit, tmp_path_factory):
    if request.param == "sglang":
        if not SGLANG_URL:
            pytest.fail("the sglang target was selected (-m sglang) but SLIME_TEST_SGLANG_URL is not set")
        yield SGLANG_URL.rstrip("/")
        return
    process, url = start_builtin_engine(str(tiny_kit.model_dir), log_path=tmp_path_factory.mktemp("e") / "log")
    try:
        yield url
    finally:
        process.stop()


@pytest.fixture
def http():
    with httpx.Client(timeout=300, trust_env=False) as client:
        yield client


def test_generate_response_shape(target, http):
    reply = http.post(f"{target}/generate", json={
        "input_ids": [1, 2, 3, 4], "return_logprob": True,
        "sampling_params": {"max_new_tokens": 6, "temperature": 1.0, "ignore_eos": True}})
    assert reply.status_code == 200, reply.text
    out = reply.json()
    assert isinstance(out["text"], str)
    meta = out["meta_info"]
    assert meta["finish_reason"] == {"type": "length", "length": 6}
    assert meta["prompt_tokens"] == 4 and meta["completion_tokens"] == 6
    assert isinstance(meta["weight_version"], str) and isinstance(meta["id"], str)
    assert len(out["output_ids"]) == 6
    logprobs = meta["output_token_logprobs"]
    assert [entry[1] for entry in logprobs] == out["output_ids"]
    assert all(len(entry) == 3 and entry[0] <= 0 and entry[2] is None for entry in logprobs)


def test_batched_input_ids_give_one_result_each(target, http):
    reply = http.post(f"{target}/generate", json={
        "input_ids": [[1, 2], [3, 4, 5]], "sampling_params": {"max_new_tokens": 3, "ignore_eos": True}})
    assert reply.status_code == 200, reply.text
    outs = reply.json()
    assert [o["meta_info"]["prompt_tokens"] for o in outs] == [2, 3]
    assert all(o["meta_info"]["completion_tokens"] == 3 for o in outs)


def test_greedy_is_repeatable(target, http):
    body = {"input_ids": [5, 6, 7], "sampling_params": {"max_new_tokens": 5, "temperature": 0, "ignore_eos": True}}
    first = http.post(f"{target}/generate", json=body).json()["output_ids"]
    assert http.post(f"{target}/generate", json=body).json()["output_ids"] == first


def test_info_and_health_endpoints(target, http):
    for path in ("/health", "/health_generate", "/get_model_info", "/get_server_info", "/v1/models"):
        assert http.get(f"{target}{path}").status_code == 200, path
    assert isinstance(http.get(f"{target}/get_model_info").json()["model_path"], str)
    assert isinstance(http.get(f"{target}/get_model_info").json()["weight_version"], str)
    assert http.post(f"{target}/flush_cache").status_code == 200


def _budget(http, url, prompt_tokens):
    """The most new tokens the server accepts after `prompt_tokens` (prompt + new <= context)."""
    return http.get(f"{url}/v1/models").json()["data"][0]["max_model_len"] - prompt_tokens


def _long_generation(url, rid, max_new_tokens):
    result = {}

    def target_fn():
        with httpx.Client(timeout=600, trust_env=False) as client:
            result["reply"] = client.post(f"{url}/generate", json={
                "input_ids": [1, 2], "rid": rid, "return_logprob": True,
                "sampling_params": {"max_new_tokens": max_new_tokens, "ignore_eos": True}})

    thread = threading.Thread(target=target_fn)
    thread.start()
    return thread, result


def _wait_until_generating(http, url, prompt_tokens, timeout_s=120.0):
    """Block until the engine runs one request that holds more than its prompt, i.e. has produced tokens
    (`/get_load`: num_tokens counts the running requests' prompt and output tokens). An abort sent
    earlier could arrive before the request and be a no-op; one sent later finds it generating."""
    deadline = time.monotonic() + timeout_s
    while True:
        load = http.get(f"{url}/get_load").json()[0]
        if load["num_reqs"] >= 1 and load["num_waiting_reqs"] == 0 and load["num_tokens"] > prompt_tokens:
            return
        assert time.monotonic() < deadline, f"the request did not start generating in {timeout_s} s: {load}"
        time.sleep(0.005)


@pytest.mark.parametrize("how", ["abort_all", "rid"])
def test_abort_returns_partial_tokens(target, http, how):
    rid = f"conformance-{how}-{time.monotonic_ns()}"
    budget = _budget(http, target, 2)  # the whole context: hundreds of steps, the abort lands after a few
    thread, result = _long_generation(target, rid, budget)
    _wait_until_generating(http, target, 2)
    body = {"abort_all": True} if how == "abort_all" else {"rid": rid}
    assert http.post(f"{target}/abort_request", json=body).status_code == 200
    thread.join(timeout=120)
    assert not thread.is_alive()
    out = result["reply"].json()
    assert out["meta_info"]["finish_reason"]["type"] == "abort", out["meta_info"]
    assert 0 < len(out["output_ids"]) < budget
    assert len(out["meta_info"]["output_token_logprobs"]) == len(out["output_ids"])


def test_pause_and_continue(target, http):
    assert http.post(f"{target}/pause_generation", json={}).status_code == 200
    assert http.post(f"{target}/continue_generation", json={}).status_code == 200
    reply = http.post(f"{target}/generate", json={"input_ids": [1], "sampling_params": {"max_new_tokens": 2}})
    assert reply.status_code == 200


def test_update_weights_from_disk_sets_version(target, http):
    model_path = http.get(f"{target}/get_model_info").json()["model_path"]
    reply = http.post(f"{target}/update_weights_from_disk", json={"model_path": model_path,
                                                                  "weight_version": "conformance-7"})
    assert reply.status_code == 200 and reply.json()["success"] is True
    assert http.get(f"{target}/get_model_info").json()["weight_version"] == "conformance-7"
    out = http.post(f"{target}/generate", json={"input_ids": [1], "sampling_params": {"max_new_tokens": 1}}).json()
    assert out["meta_info"]["weight_version"] == "conformance-7"


def test_request_beyond_the_context_is_refused(target, http):
    budget = _budget(http, target, 2)
    too_long = http.post(f"{target}/generate", json={"input_ids": [1, 2],
                                                     "sampling_params": {"max_new_tokens": budget + 1}})
    assert too_long.status_code == 400 and "context length" in too_long.json()["error"]["message"]


@pytest.mark.parametrize("body", [
    {"input_ids": [1], "sampling_params": {"max_new_tokens": -1}},
    {"input_ids": [1], "sampling_params": {"temperature": "hot"}},
    {"input_ids": [1], "sampling_params": {"no_such_param": 1}},
])
def test_bad_requests_get_4xx_and_server_keeps_serving(target, http, body):
    reply = http.post(f"{target}/generate", json=body)
    assert 400 <= reply.status_code < 500, reply.text
    ok = http.post(f"{target}/generate", json={"input_ids": [1], "sampling_params": {"max_new_tokens": 1}})
    assert ok.status_code == 200
