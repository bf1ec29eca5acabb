"""EngineClient against real local HTTP servers: retries, no retry on 4xx, connection failures, pooling."""

import asyncio
import json
import socket
import threading
import time
from collections import Counter
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from slime.engines.client import EngineClient
from slime.errors import EngineHTTPError
from slime.net import find_free_port

pytestmark = pytest.mark.timeout(60)


class _Handler(BaseHTTPRequestHandler):
    """Behaviour by path; every hit is counted in `server.hits`."""

    protocol_version = "HTTP/1.1"

    def log_message(self, *args):  # keep pytest output clean
        pass

    def _send(self, status: int, body: bytes, ctype: str = "application/json", headers=()):
        self.send_response(status)
        self.send_header("Content-Type", ctype)
        self.send_header("Content-Length", str(len(body)))
        for key, value in headers:
            self.send_header(key, value)
        self.end_headers()
        self.wfile.write(body)

    def _handle(self):
        server = self.server
        length = int(self.headers.get("Content-Length") or 0)
        body = self.rfile.read(length) if length else b""
        with server.lock:
            server.hits[self.path] += 1
            n = server.hits[self.path]
            server.bodies.append(body)
        if self.path == "/flaky":  # 503 twice, then 200
            if n <= 2:
                return self._send(503, b'{"error": "no healthy worker"}')
            return self._send(200, json.dumps({"ok": True, "attempt": n}).encode())
        if self.path == "/busy":  # 429 once
            if n == 1:
                return self._send(429, b"slow down", "text/plain", [("Retry-After", "0")])
            return self._send(200, b'{"ok": true}')
        if self.path == "/always503":
            return self._send(503, b"engine restarting " + b"x" * 2000, "text/plain")
        if self.path == "/bad":
            return self._send(400, b'{"error": "input_ids must be a list of ints"}')
        if self.path == "/text":
            return self._send(200, b"Cache flushed.", "text/plain")
        if self.path == "/echo":
            return self._send(200, body or b"{}")
        if self.path == "/slow":
            with server.lock:
                server.inflight += 1
                server.max_inflight = max(server.max_inflight, server.inflight)
            time.sleep(server.slow_s)
            with server.lock:
                server.inflight -= 1
            return self._send(200, b'{"ok": true}')
        return self._send(404, b'{"error": "not found"}')

    do_GET = _handle
    do_POST = _handle


@pytest.fixture
def server():
    srv = ThreadingHTTPServer(("127.0.0.1", 0), _Handler)
    srv.daemon_threads = True
    srv.block_on_close = False
    srv.hits, srv.bodies, srv.lock = Counter(), [], threading.Lock()
    srv.inflight = srv.max_inflight = 0
    srv.slow_s = 0.2
    thread = threading.Thread(target=srv.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
    thread.start()
    srv.url = f"http://127.0.0.1:{srv.server_address[1]}"
    yield srv
    srv.shutdown()
    srv.server_close()


def _client(**kw) -> EngineClient:
    kw.setdefault("backoff_base_s", 0.01)
    kw.setdefault("backoff_max_s", 0.05)
    return EngineClient(**kw)


def test_retries_5xx_then_succeeds(server):
    async def main():
        async with _client(max_retries=3) as client:
            return await client.post(server.url + "/flaky", {"input_ids": [1, 2, 3]})

    assert asyncio.run(main()) == {"ok": True, "attempt": 3}
    assert server.hits["/flaky"] == 3
    assert all(json.loads(b) == {"input_ids": [1, 2, 3]} for b in server.bodies)  # same body every attempt


def test_retries_429(server):
    async def main():
        async with _client(max_retries=1) as client:
            return await client.get(server.url + "/busy")

    assert asyncio.run(main()) == {"ok": True}
    assert server.hits["/busy"] == 2


def test_5xx_bounded_retries_then_error(server):
    async def main():
        async with _client(max_retries=2) as client:
            await client.post(server.url + "/always503", {})

    with pytest.raises(EngineHTTPError) as err:
        asyncio.run(main())
    assert server.hits["/always503"] == 3
    e = err.value
    assert e.status == 503 and e.method == "POST" and e.url == server.url + "/always503"
    assert e.body.startswith("engine restarting") and len(e.body) == 500
    assert "HTTP 503 after 3 attempt(s)" in str(e) and server.url + "/always503" in str(e)


def test_4xx_not_retried(server):
    async def main():
        async with _client(max_retries=5) as client:
            await client.post(server.url + "/bad", {"input_ids": "oops"})

    with pytest.raises(EngineHTTPError) as err:
        asyncio.run(main())
    assert server.hits["/bad"] == 1
    assert err.value.status == 400
    assert "input_ids must be a list of ints" in err.value.body
    assert "HTTP 400" in str(err.value) and "input_ids must be a list of ints" in str(err.value)


def test_connection_refused_bounded_retries():
    port = find_free_port()  # nothing listens there
    url = f"http://127.0.0.1:{port}/generate"
    attempts = 0

    async def main():
        nonlocal attempts
        async with _client(max_retries=2) as client:
            inner = client._attempt

            async def counting(*args, **kwargs):
                nonlocal attempts
                attempts += 1
                return await inner(*args, **kwargs)

            client._attempt = counting
            await client.post(url, {"text": "hi"})

    with pytest.raises(EngineHTTPError) as err:
        asyncio.run(main())
    assert attempts == 3
    assert err.value.url == url and err.value.status is None
    assert url in str(err.value) and "ClientConnectorError" in str(err.value) and "3 attempt(s)" in str(err.value)


def test_dropped_connections_are_retried():
    """A listener that accepts and closes at once: every attempt reaches it, then the client gives up."""
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(16)
    accepted = 0
    stop = threading.Event()

    def accept_and_close():
        nonlocal accepted
        listener.settimeout(0.1)
        while not stop.is_set():
            try:
                conn, _ = listener.accept()
            except TimeoutError:
                continue
            accepted += 1
            conn.close()

    thread = threading.Thread(target=accept_and_close, daemon=True)
    thread.start()
    url = f"http://127.0.0.1:{listener.getsockname()[1]}/generate"

    async def main():
        async with _client(max_retries=3) as client:
            await client.post(url, {})

    try:
        with pytest.raises(EngineHTTPError, match="4 attempt"):
            asyncio.run(main())
    finally:
        stop.set()
        thread.join()
        listener.close()
    assert accepted == 4


def test_read_timeout_not_retried(server):
    server.slow_s = 1.0

    async def main():
        async with _client(max_retries=3, timeout_s=0.2) as client:
            await client.get(server.url + "/slow")

    with pytest.raises(EngineHTTPError, match="timed out"):
        asyncio.run(main())
    assert server.hits["/slow"] == 1


def test_per_request_timeout_overrides_the_clients_and_only_the_clients_names_the_advice(server):
    """A generate-style client without a read limit still gives a control call its own short one; the
    advice (which setting to raise) is for the client's own timeout only."""
    server.slow_s = 0.8

    async def main():
        async with _client(max_retries=0, timeout_s=None, timeout_advice="raise the_field") as unlimited:
            with pytest.raises(EngineHTTPError) as short:
                await unlimited.get(server.url + "/slow", timeout_s=0.2)
            waited = await unlimited.get(server.url + "/slow")  # no limit: waits the 0.8 s out
        async with _client(max_retries=0, timeout_s=0.2, timeout_advice="raise the_field") as limited:
            with pytest.raises(EngineHTTPError) as own:
                await limited.post(server.url + "/slow", {})
            longer = await limited.get(server.url + "/slow", timeout_s=None)  # this request: no limit
        return short.value, waited, own.value, longer

    short, waited, own, longer = asyncio.run(main())
    assert "read timeout of 0.2 s" in str(short) and "the_field" not in str(short)
    assert waited == {"ok": True} and longer == {"ok": True}
    assert "read timeout of 0.2 s" in str(own) and str(own).endswith("; raise the_field")
    assert server.hits["/slow"] == 4


def test_text_body_and_json_roundtrip(server):
    async def main():
        async with _client() as client:
            return await client.get(server.url + "/text"), await client.post(server.url + "/echo", {"a": [1, 2]})

    text, echoed = asyncio.run(main())
    assert text == "Cache flushed."
    assert echoed == {"a": [1, 2]}


def test_connection_pool_bounds_concurrency(server):
    server.slow_s = 0.1

    async def main():
        async with _client(max_connections=3) as client:
            return await asyncio.gather(*(client.get(server.url + "/slow") for _ in range(12)))

    results = asyncio.run(main())
    assert results == [{"ok": True}] * 12
    assert server.max_inflight == 3  # pooled: never more than 3 at once, and all 3 used


def test_bound_to_one_event_loop(server):
    client = _client()

    async def use_then_close():
        result = await client.get(server.url + "/echo")
        await client.aclose()
        return result

    assert asyncio.run(use_then_close()) == {}
    assert client.closed
    with pytest.raises(RuntimeError, match="one EngineClient per event loop"):
        asyncio.run(use_then_close())


def test_bad_arguments():
    with pytest.raises(ValueError, match="max_retries"):
        EngineClient(max_retries=-1)
    with pytest.raises(ValueError, match="max_connections"):
        EngineClient(max_connections=0)


def test_reply_bodies_decode_as_the_standard_library_does():
    """The fast parser gives exactly `json.loads`'s values, including what SGLang's own (Python json)
    replies may hold: -Infinity log-probs, NaN, big integers, escapes; non-JSON stays text."""
    import json
    import math

    from slime.engines.client import _decode

    reply = {"text": "a\u00e9\\\"\n\u4e2d", "output_ids": [151643, 0, 2**70],
             "meta_info": {"output_token_logprobs": [[-0.1234567890123456789, 5, None], [-1e-300, 6, None],
                                                      [float("-inf"), 7, None]], "e2e_latency": 0.5}}
    body = json.dumps(reply).encode()
    decoded = _decode(body)
    assert decoded == json.loads(body)
    assert [type(x) for x in decoded["output_ids"]] == [int, int, int]
    assert math.isnan(_decode(b"[NaN]")[0])
    assert _decode(b'{"a": "\\ud800"}') == {"a": "\ud800"}  # a lone surrogate: the standard library's value
    assert _decode(b"Cache flushed.\n") == "Cache flushed.\n"
    assert _decode(b"") == ""
