"""rm_type remote_rm against a real reward server (FastAPI + uvicorn on 127.0.0.1, in a thread)."""

from __future__ import annotations

import asyncio
import socket
import threading
import time
from argparse import Namespace

import pytest
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse

import slime.rollout.rewards.hub
from slime.engines.client import EngineClient
from slime.errors import EngineHTTPError
from slime.rollout.rewards import compute_reward, reward_samples
from slime.rollout.rewards.remote import RM_MAX_RETRIES, RM_TIMEOUT_S
from slime.types import Sample, Status


def _app(received: list[dict], hits: dict[str, int]) -> FastAPI:
    app = FastAPI()

    @app.post("/score")
    async def score(request: Request):
        body = await request.json()
        received.append(body)
        return 1.0 if body["response"].strip() == str(body["label"]) else 0.0

    @app.post("/judge")
    async def judge(request: Request):
        body = await request.json()
        return {"score": float(len(body["response"])), "verdict": "ok"}

    @app.post("/flaky")
    async def flaky(request: Request):
        hits["flaky"] = hits.get("flaky", 0) + 1
        if hits["flaky"] == 1:  # first attempt: a restarting server; the retry succeeds
            return JSONResponse({"error": "warming up"}, status_code=503)
        return 0.5

    @app.post("/broken")
    async def broken(request: Request):
        hits["broken"] = hits.get("broken", 0) + 1
        return JSONResponse({"error": "reward model crashed"}, status_code=500)

    return app


@pytest.fixture(scope="module")
def rm_server():
    """(base URL, payloads received, hit counters); the server thread is stopped and joined after."""
    received: list[dict] = []
    hits: dict[str, int] = {}
    server = uvicorn.Server(uvicorn.Config(_app(received, hits), host="127.0.0.1", port=0, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        assert thread.is_alive() and time.monotonic() < deadline, "reward server did not start"
        time.sleep(0.05)
    port = server.servers[0].sockets[0].getsockname()[1]
    yield f"http://127.0.0.1:{port}", received, hits
    server.should_exit = True
    thread.join(timeout=30)
    assert not thread.is_alive()


@pytest.fixture(autouse=True)
def short_backoff(monkeypatch):
    """remote_rm's client (its timeout and retry count) with 10 ms between retries instead of 0.5, 1, 2 s: the
    retry tests count attempts, not seconds (tests/engines/test_client.py does the same)."""
    monkeypatch.setattr(slime.rollout.rewards.hub, "make_rm_client", lambda: EngineClient(
        timeout_s=RM_TIMEOUT_S, max_retries=RM_MAX_RETRIES, backoff_base_s=0.01, backoff_max_s=0.01))


def rm_args(url: str, **kw) -> Namespace:
    return Namespace(rm_type="remote_rm", rm_url=url, custom_rm_path=None, group_rm=False, **kw)


def test_remote_rm_posts_slime_payload(rm_server):
    base, received, _ = rm_server
    received.clear()
    batch = [Sample(index=i, prompt=f"{i}+1=", response=f" {i + d}", label=str(i + 1)) for i, d in enumerate([1, 0, 1])]
    asyncio.run(reward_samples(rm_args(f"{base}/score", reward_key=None), batch))
    assert [s.reward for s in batch] == [1.0, 0.0, 1.0]
    assert sorted(received, key=lambda b: b["prompt"]) == [
        {"prompt": "0+1=", "response": " 1", "label": "1"},
        {"prompt": "1+1=", "response": " 1", "label": "2"},
        {"prompt": "2+1=", "response": " 3", "label": "3"},
    ]


def test_remote_rm_dict_reward_with_key(rm_server):
    base, _, _ = rm_server
    batch = [Sample(index=0, response="abcd", label="x")]
    asyncio.run(reward_samples(rm_args(f"{base}/judge", reward_key="score"), batch))
    assert batch[0].reward == {"score": 4.0, "verdict": "ok"}


def test_remote_rm_retries_a_503(rm_server):
    base, _, hits = rm_server
    assert asyncio.run(compute_reward(rm_args(f"{base}/flaky"), Sample(response="x", label="y"))) == 0.5
    assert hits["flaky"] == 2


def test_remote_rm_error_names_url_and_status(rm_server):
    base, _, hits = rm_server
    url = f"{base}/broken"
    with pytest.raises(EngineHTTPError, match=rf"POST {url} returned HTTP 500 after 4 attempt\(s\)") as info:
        asyncio.run(compute_reward(rm_args(url), Sample(response="x", label="y")))
    assert info.value.status == 500 and "reward model crashed" in info.value.body
    assert hits["broken"] == 4  # first try + 3 retries

    batch = [Sample(index=0, response="x", label="y")]
    asyncio.run(reward_samples(rm_args(url, reward_key=None), batch))
    assert batch[0].status is Status.FAILED
    assert batch[0].metadata["reward_error"].startswith(f"EngineHTTPError: POST {url} returned HTTP 500")


def test_remote_rm_unreachable(rm_server):
    # a port nobody listens on: connection refused, retried, then a clear error
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    batch = [Sample(index=0, response="x", label="y")]
    asyncio.run(reward_samples(rm_args(f"http://127.0.0.1:{port}/score", reward_key=None), batch))
    assert batch[0].status is Status.FAILED
    assert f"http://127.0.0.1:{port}/score failed after 4 attempt(s)" in batch[0].metadata["reward_error"]
