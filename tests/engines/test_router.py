"""A real sglang-router (0.3.2) in front of stub workers that speak the SGLang HTTP protocol.

The stub answers what the router probes (`/health`, `/server_info`, `/model_info` with a local
`model_path`, so no hub lookup happens) and the engine endpoints slime calls, with SGLang-shaped JSON.
"""

import asyncio
import json
import os
import threading
import time
from collections import Counter
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import httpx
import pytest
from proc_checks import port_free, running

from slime.config.engine_flags import check_router_args
from slime.engines.client import EngineClient
from slime.engines.router import SGLangRouter, broadcast_to_workers
from slime.errors import ConfigError, EngineError, EngineHTTPError
from slime.net import find_free_port

pytestmark = pytest.mark.timeout(90)


class _StubWorker(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"

    def log_message(self, *args):
        pass

    def _send(self, obj, status=200):
        body = json.dumps(obj).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def _record(self) -> bytes:
        length = int(self.headers.get("Content-Length") or 0)
        body = self.rfile.read(length) if length else b""
        with self.server.lock:
            self.server.hits[(self.command, self.path)] += 1
            self.server.bodies.setdefault(self.path, []).append(body)
        return body

    def do_GET(self):
        self._record()
        srv = self.server
        if self.path in ("/health", "/health_generate"):
            return self._send({})
        if self.path in ("/server_info", "/get_server_info"):
            return self._send({"model_path": srv.model_path, "port": srv.server_address[1]})
        if self.path in ("/model_info", "/get_model_info"):
            return self._send({"model_path": srv.model_path, "is_generation": True})
        if self.path == "/get_load":
            return self._send({"load": 0})
        if self.path == "/get_weight_version":
            return self._send({"weight_version": srv.name})
        return self._send({"error": f"{self.path} not found"}, 404)

    def do_POST(self):
        self._record()
        if self.path == "/generate":
            return self._send(self.server.generate_response)
        if self.path in ("/abort_request", "/update_weights_from_disk", "/pause_generation"):
            return self._send({"success": True, "message": f"{self.path} on {self.server.name}"})
        return self._send({"error": f"{self.path} not found"}, 404)


def _start_stub(name: str, model_dir: Path) -> ThreadingHTTPServer:
    srv = ThreadingHTTPServer(("127.0.0.1", 0), _StubWorker)
    srv.daemon_threads = True
    srv.block_on_close = False
    srv.name, srv.model_path = name, str(model_dir)
    srv.hits, srv.bodies, srv.lock = Counter(), {}, threading.Lock()
    srv.generate_response = {
        "text": f" answer from {name}",
        "output_ids": [11, 12],
        "meta_info": {"id": "r1", "finish_reason": {"type": "length", "length": 2}, "prompt_tokens": 3,
                      "completion_tokens": 2, "cached_tokens": 0, "weight_version": "default",
                      "output_token_logprobs": [[-0.5, 11, None], [-0.25, 12, None]], "worker": name},
    }
    threading.Thread(target=srv.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True).start()
    srv.url = f"http://127.0.0.1:{srv.server_address[1]}"
    return srv






@pytest.fixture(scope="module")
def stubs(tmp_path_factory):
    model_dir = tmp_path_factory.mktemp("stub-model")  # local dir: the router loads no tokenizer from a hub
    servers = [_start_stub("a", model_dir), _start_stub("b", model_dir)]
    yield servers
    for srv in servers:
        srv.shutdown()
        srv.server_close()


@pytest.fixture(scope="module")
def router(stubs, tmp_path_factory):
    """A round-robin router with both stubs registered at launch."""
    log = tmp_path_factory.mktemp("router") / "router.log"
    with SGLangRouter(worker_urls=[s.url for s in stubs], policy="round_robin", health_check_interval_secs=2,
                      health_failure_threshold=2, log_path=log) as r:
        r.wait_workers_healthy(2, timeout_s=30)
        yield r


def test_router_lifecycle_and_worker_registry(router, stubs, tmp_path):
    """A second router on the same host (own ports), no workers; add, list, remove a worker; stop."""
    lonely = SGLangRouter(log_path=tmp_path / "router2.log")
    lonely.start()
    try:
        assert lonely.port != router.port and lonely.prometheus_port != router.prometheus_port
        assert httpx.get(lonely.url + "/liveness", timeout=5).status_code == 200
        ready = httpx.get(lonely.url + "/readiness", timeout=5)
        assert ready.status_code == 503  # no healthy worker yet
        assert lonely.list_workers() == [] and lonely.worker_urls() == []

        worker_id = lonely.add_worker(stubs[0].url + "/")  # trailing slash normalised
        healthy = lonely.wait_workers_healthy(1, timeout_s=30)
        assert [w["url"] for w in healthy] == [stubs[0].url]
        (listed,) = lonely.list_workers()
        assert listed["id"] == worker_id and listed["is_healthy"] is True
        assert lonely.add_worker(stubs[0].url) == worker_id  # already listed: not added twice
        assert httpx.get(lonely.url + "/readiness", timeout=5).status_code == 200
        assert stubs[0].hits[("GET", "/model_info")] >= 1  # the router really probed the worker

        lonely.remove_worker(stubs[0].url)
        assert lonely.worker_urls() == []
        with pytest.raises(EngineError, match="is not registered"):
            lonely.remove_worker(stubs[0].url)

        # A worker that never comes up: accepted, never listed, removable by URL all the same.
        dead = f"http://127.0.0.1:{find_free_port()}"
        lonely.add_worker(dead)
        assert dead not in lonely.worker_urls()
        lonely.remove_worker(dead)
        with pytest.raises(EngineError, match="0/1 workers healthy"):
            lonely.wait_workers_healthy(1, timeout_s=0.5)
    finally:
        lonely.stop()
    pid = lonely.process.pid
    assert not lonely.alive and not running(pid)
    assert port_free(lonely.port) and port_free(lonely.prometheus_port)
    assert router.alive  # the other router was not touched


def test_generate_forwarded_and_round_robin(router, stubs):
    for srv in stubs:
        srv.hits.clear()
        srv.bodies.clear()
    request = {"input_ids": [1, 2, 3], "sampling_params": {"max_new_tokens": 2, "temperature": 1.0},
               "return_logprob": True}
    served = []
    with httpx.Client(timeout=10) as http:
        for _ in range(6):
            response = http.post(router.url + "/generate", json=request)
            assert response.status_code == 200
            body = response.json()
            served.append(body["meta_info"]["worker"])
    by_name = {s.name: s for s in stubs}
    assert body == by_name[served[-1]].generate_response  # the worker's body comes back unchanged
    assert [s.hits[("POST", "/generate")] for s in stubs] == [3, 3]
    assert all(served[i] != served[i + 1] for i in range(5))  # strict alternation
    forwarded = json.loads(stubs[0].bodies["/generate"][0])
    assert forwarded["input_ids"] == [1, 2, 3] and forwarded["return_logprob"] is True
    assert forwarded["sampling_params"]["max_new_tokens"] == 2


def test_broadcast_reaches_every_worker_directly(router, stubs):
    # The router itself does not route these (measured: 404), hence the direct broadcast.
    assert httpx.post(router.url + "/abort_request", json={"abort_all": True}, timeout=5).status_code == 404

    async def main():
        async with EngineClient(max_retries=0) as client:
            aborted = await router.broadcast(client, "/abort_request", {"abort_all": True})
            versions = await router.broadcast(client, "get_weight_version", method="GET")
            return aborted, versions

    aborted, versions = asyncio.run(main())
    assert set(aborted) == {s.url for s in stubs}
    for srv in stubs:
        assert aborted[srv.url] == {"success": True, "message": f"/abort_request on {srv.name}"}
        assert json.loads(srv.bodies["/abort_request"][-1]) == {"abort_all": True}
        assert versions[srv.url] == {"weight_version": srv.name}


def test_broadcast_reports_failed_workers(stubs):
    dead = f"http://127.0.0.1:{find_free_port()}"

    async def main():
        async with EngineClient(max_retries=0) as client:
            await broadcast_to_workers(client, [stubs[0].url, dead], "/update_weights_from_disk",
                                       {"model_path": "/ckpt/iter_1", "weight_version": "1"})

    with pytest.raises(EngineError) as err:
        asyncio.run(main())
    assert "failed on 1/2 worker(s)" in str(err.value) and dead in str(err.value)
    assert stubs[0].url + ":" not in str(err.value)
    assert json.loads(stubs[0].bodies["/update_weights_from_disk"][-1])["weight_version"] == "1"


class _SlowGenerate(_StubWorker):
    """`/generate` answered after `server.generate_delay_s`: a generation longer than the router allows."""

    def do_POST(self):
        if self.path == "/generate":
            self._record()
            time.sleep(self.server.generate_delay_s)
            return self._send(self.server.generate_response)
        return super().do_POST()


def test_router_cuts_each_attempt_at_its_request_timeout_and_retries_it(tmp_path):
    """What bounds a rollout generation when the client has no read timeout (rollout_http_timeout_s None):
    the router cuts each attempt at --router-request-timeout-secs, resends the request up to
    --router-retry-max-retries attempts in all, then answers HTTP 500, which the client reports."""
    srv = _start_stub("slow", tmp_path)
    srv.RequestHandlerClass, srv.generate_delay_s = _SlowGenerate, 4.0
    args = {"request_timeout_secs": 1, "retry_max_retries": 2, "retry_initial_backoff_ms": 10}

    async def main(url):
        async with EngineClient(timeout_s=None, max_retries=0) as client:
            await client.post(url + "/generate", {"input_ids": [1, 2], "sampling_params": {}})

    try:
        with SGLangRouter(worker_urls=[srv.url], router_args=args, log_path=tmp_path / "router.log") as router:
            router.wait_workers_healthy(1, timeout_s=30)
            started = time.perf_counter()
            with pytest.raises(EngineHTTPError) as err:
                asyncio.run(main(router.url))
            elapsed = time.perf_counter() - started
    finally:
        srv.shutdown()
        srv.server_close()
    assert err.value.status == 500 and "call_upstream_request_error" in err.value.body
    assert srv.hits[("POST", "/generate")] == 2  # the cut attempt was sent again
    assert 2.0 <= elapsed < 4.0  # two 1 s attempts, not the worker's 4 s


def test_router_command_and_flag_validation(tmp_path):
    r = SGLangRouter(policy="cache_aware", router_args={"cache_threshold": 0.5, "dp_aware": True,
                                                       "disable_retries": False, "log-level": "warn"},
                     worker_urls=["http://10.0.0.1:30000/"], python="py", port=31000)
    cmd = r.command()
    assert cmd[:9] == ["py", "-m", "sglang_router.launch_router", "--host", "127.0.0.1", "--port", "31000",
                       "--prometheus-host", "127.0.0.1"]
    assert cmd[9] == "--prometheus-port" and int(cmd[10]) != 31000
    assert cmd[11:] == ["--worker-urls", "http://10.0.0.1:30000", "--cache-threshold", "0.5", "--dp-aware",
                        "--log-level", "warn", "--policy", "cache_aware"]
    assert SGLangRouter(router_args={"policy": "random"}).router_args["policy"] == "random"
    assert SGLangRouter().router_args["policy"] == "round_robin"

    with pytest.raises(ConfigError, match="did you mean --router-cache-threshold"):
        check_router_args({"cache_treshold": 0.3})
    with pytest.raises(ConfigError, match="--router-prometheus-port cannot be passed through"):
        SGLangRouter(router_args={"prometheus_port": 29000})
    with pytest.raises(ConfigError, match="given twice"):
        SGLangRouter(policy="random", router_args={"policy": "cache_aware"})


def test_router_start_failure_is_reported(tmp_path):
    """A flag value the router rejects makes it exit at once: EngineStartError with its log, no process left."""
    r = SGLangRouter(router_args={"policy": "no_such_policy"}, log_path=tmp_path / "r.log", startup_timeout_s=30)
    with pytest.raises(EngineError) as err:
        r.start()
    assert "invalid choice" in str(err.value) and "no_such_policy" in str(err.value)
    assert not r.alive
    assert os.path.exists(tmp_path / "r.log")


def test_fleet_router_runs_without_circuit_breaker_unless_configured():
    from slime.engines.fleet import managed_router_args

    assert managed_router_args({}) == {"disable_circuit_breaker": True}
    assert managed_router_args({"policy": "random"}) == {"policy": "random", "disable_circuit_breaker": True}
    assert managed_router_args({"cb_failure_threshold": 50}) == {"cb_failure_threshold": 50}
    assert managed_router_args({"disable-circuit-breaker": False}) == {"disable-circuit-breaker": False}
    # the flag reaches the router's command line
    cmd = SGLangRouter(router_args=managed_router_args({})).command()
    assert "--disable-circuit-breaker" in cmd
