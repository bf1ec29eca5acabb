"""The rollout's read timeout on `/generate` follows `rollout.rollout_http_timeout_s`.

A fake router that is also its only worker (the router's `GET /workers`, the engine's `/generate`,
`/get_load` and `/abort_request`, SGLang-shaped JSON) answers `/generate` after `DELAY_S`: a generation
that outlasts the configured timeout fails the rollout, naming the timeout and the field to raise; with
the field raised, or unset (no client limit, as slime), the same request succeeds. Control calls keep their
own short timeout whatever the field says.
"""

from __future__ import annotations

import asyncio
import json
import threading
import time
from collections import Counter
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import pytest

from slime.config import FIELD_SECTION, Config
from slime.rollout import RolloutEngineError, generate_rollout
from slime.rollout.http import close_engine_client, engine_client, worker_urls
from slime.stages.rejection_sampling import generate_and_score
from slime.types import Sample, Status

pytestmark = pytest.mark.timeout(60)

DELAY_S = 1.5


class _RouterAndWorker(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"

    def log_message(self, *args):
        pass

    def _send(self, obj: Any) -> None:
        body = json.dumps(obj).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def do_GET(self):
        srv = self.server
        with srv.lock:
            srv.hits[("GET", self.path)] += 1
        if self.path == "/workers":
            time.sleep(srv.workers_delay_s)
            return self._send({"workers": [{"id": "w0", "url": srv.url, "is_healthy": True}], "total": 1})
        if self.path == "/get_load":
            return self._send([{"num_reqs": 0}])
        return self._send({"error": f"{self.path} not found"})

    def do_POST(self):
        srv = self.server
        length = int(self.headers.get("Content-Length") or 0)
        request = json.loads(self.rfile.read(length) or b"{}")
        with srv.lock:
            srv.hits[("POST", self.path)] += 1
        if self.path == "/abort_request":
            return self._send({"success": True})
        if self.path == "/generate":
            time.sleep(srv.generate_delay_s)  # a long generation: nothing is sent until it is done
            n = request["sampling_params"].get("max_new_tokens") or 2
            ids = list(range(11, 11 + n))
            return self._send({"text": " done", "output_ids": ids, "meta_info": {
                "id": "r", "finish_reason": {"type": "length", "length": n}, "prompt_tokens": len(request["input_ids"]),
                "completion_tokens": n, "cached_tokens": 0, "weight_version": "default",
                "output_token_logprobs": [[-0.5, t, None] for t in ids]}})
        return self._send({"error": f"{self.path} not found"})


@pytest.fixture
def fake_router():
    srv = ThreadingHTTPServer(("127.0.0.1", 0), _RouterAndWorker)
    srv.daemon_threads = True
    srv.block_on_close = False
    srv.hits, srv.lock = Counter(), threading.Lock()
    srv.generate_delay_s, srv.workers_delay_s = DELAY_S, 0.0
    srv.url = f"http://127.0.0.1:{srv.server_address[1]}"
    threading.Thread(target=srv.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True).start()
    yield srv
    srv.shutdown()
    srv.server_close()


class _Prompts:
    """A data source of pre-tokenised one-sample groups (with generate_pretokenized: no tokenizer needed)."""

    def __init__(self) -> None:
        self.drawn = 0
        self.returned: list[list[Sample]] = []

    def get_samples(self, num_groups: int, rollout_id: int | None = None) -> list[list[Sample]]:
        groups = [[Sample(group_index=self.drawn + i, index=self.drawn + i, prompt="1+1=", label="2",
                          tokens=[1, 2, 3])] for i in range(num_groups)]
        self.drawn += num_groups
        return groups

    def add_samples(self, groups: list[list[Sample]]) -> None:
        self.returned += groups


def _args(fake_router, **fields: Any):
    """slime's flat args for a one-group rollout against the fake router."""
    nested: dict[str, dict[str, Any]] = {}
    for name, value in {"rollout_batch_size": 1, "n_samples_per_prompt": 1, "rollout_max_response_len": 2,
                        "custom_rm_path": "rollout_plugins.rm_one",
                        "custom_generate_function_path": "rollout_plugins.generate_pretokenized", **fields}.items():
        nested.setdefault(FIELD_SECTION[name], {})[name] = value
    args = Config.model_validate(nested).as_namespace()
    args.sglang_router_ip, args.sglang_router_port = "127.0.0.1", fake_router.server_address[1]
    return args


def test_generation_longer_than_the_timeout_fails_naming_the_field(fake_router):
    args = _args(fake_router, rollout_http_timeout_s=0.3)
    started = time.perf_counter()
    with pytest.raises(RolloutEngineError) as err:
        generate_rollout(args, 0, _Prompts())
    elapsed = time.perf_counter() - started
    message = str(err.value)
    assert "/generate timed out (no reply within the read timeout of 0.3 s)" in message
    assert "rollout_http_timeout_s (--rollout-http-timeout-s)" in message
    assert elapsed < DELAY_S  # cut by the client at 0.3 s, not after the engine answered
    assert fake_router.hits[("POST", "/generate")] == 1  # a read timeout is not retried


@pytest.mark.parametrize("timeout_s", [DELAY_S * 3, None], ids=["raised", "unset"])
def test_same_generation_succeeds_with_the_field_raised_or_unset(fake_router, timeout_s):
    args = _args(fake_router, rollout_http_timeout_s=timeout_s)
    out = generate_rollout(args, 0, _Prompts())
    [[sample]] = out.samples
    assert sample.status is Status.TRUNCATED and sample.response_length == 2 and sample.reward == 1.0
    assert fake_router.hits[("POST", "/generate")] == 1


def test_control_calls_keep_their_short_timeout_and_the_loop_shares_one_client(fake_router, monkeypatch):
    """With no limit on generate calls, listing workers still gives up after CONTROL_TIMEOUT_S (shortened
    here to keep the test fast); plugins calling engine_client() without args get the rollout's client."""
    monkeypatch.setattr("slime.rollout.http.CONTROL_TIMEOUT_S", 0.2)
    fake_router.workers_delay_s = 0.8
    args = _args(fake_router, rollout_http_timeout_s=None)

    async def main():
        client = engine_client(args)
        same = engine_client() is client and engine_client(args) is client
        other = engine_client(_args(fake_router, rollout_http_timeout_s=5.0))
        try:
            with pytest.raises(Exception) as err:
                await worker_urls(client, fake_router.url)
            return client.timeout_s, same, other.timeout_s, other is not client, err.value
        finally:
            await close_engine_client()
            assert client.closed and other.closed

    timeout_s, same, other_timeout, distinct, error = asyncio.run(main())
    assert timeout_s is None and same
    assert other_timeout == 5.0 and distinct  # a second setting gets a client of its own
    assert "/workers timed out (no reply within the read timeout of 0.2 s)" in str(error)
    assert "rollout_http_timeout_s" not in str(error)  # raising the generate timeout would not help here


def test_rejection_sampling_uses_the_same_field(fake_router):
    prompts = [Sample(group_index=0, index=0, prompt="1+1=", label="2")]
    for timeout_s, failed in ((0.3, True), (None, False)):
        args = _args(fake_router, rollout_http_timeout_s=timeout_s)
        [[sample]] = asyncio.run(generate_and_score(args, fake_router.url, prompts, [[1, 2, 3]], 1,
                                                    {"max_new_tokens": 2}, concurrency=4))
        assert (sample.status is Status.FAILED) is failed
        if failed:
            assert "read timeout of 0.3 s" in sample.metadata["generate_error"]
            assert "rollout_http_timeout_s" in sample.metadata["generate_error"]
        else:
            assert sample.response_length == 2 and sample.reward == 1.0
