"""The one async HTTP client that rollout code uses to talk to the router and the engines.

A single pooled `aiohttp.ClientSession` (bounded connections, so thousands of concurrent generate
calls queue for a connection instead of opening thousands of sockets), a read timeout (the client's,
or one given per request: a generate call may take as long as the router allows, an abort or a load
query should answer at once), and bounded retries with exponential backoff and jitter. Retried:
connection failures (refused, connect timeout, reset, dropped mid-response) and HTTP 429 / 5xx, which
is what a restarting engine or a router without a healthy worker answers. Never retried: other 4xx
(the request itself is wrong) and read timeouts (the engine may still be working on the request).
After the last attempt an `EngineHTTPError` names the method, URL, status and the start of the body.

Why aiohttp and not httpx: httpcore 1.0.9's pool re-scans every connection for every queued request
(encode/httpcore#1035, unmerged), so N concurrent requests cost O(N^2) client CPU: 256 concurrent
generate calls with 128-token replies took ~3 s of client time against a server that answers at
once, 64 took 0.15 s. aiohttp's connector took 0.35 s for 256 on the same 2-core machine
(docs/engines.md, "Client").

Event loops: an `EngineClient` belongs to the event loop that first uses it (its session is opened
there, lazily). Create one per loop, share it among all coroutines of that loop, and `aclose()` it
(or use `async with`) before the loop ends. Using it from another loop raises RuntimeError.
"""

from __future__ import annotations

import asyncio
import contextlib
import json as jsonlib
import logging
import random
from types import EllipsisType
from typing import Any, Self

import aiohttp
import pydantic_core

from slime.errors import EngineHTTPError

logger = logging.getLogger(__name__)

_BODY_CHARS = 500
# Failures where the request never reached the server or the connection broke: safe to retry.
# (A read timeout, `aiohttp.SocketTimeoutError`, is a `ClientConnectionError` too and is checked first.)
_RETRY_EXCEPTIONS = (
    aiohttp.ConnectionTimeoutError,
    aiohttp.ClientConnectorError,
    aiohttp.ServerDisconnectedError,
    aiohttp.ClientOSError,
    aiohttp.ClientPayloadError,
)


def _decode(body: bytes) -> Any:
    """JSON body when there is one, else the text ('' for an empty body).

    Parsed by pydantic-core (a pydantic dependency, Rust): a 128-token generate reply with log-probs
    took 0.021 ms against the standard library's 0.064 ms (2-core CPU), which is the client's largest
    cost when 256 replies arrive together. Same values (floats round-trip exactly, big integers,
    -Infinity and NaN accepted); what it refuses goes to the standard library as before."""
    if not body:
        return ""
    try:
        return pydantic_core.from_json(body)
    except ValueError:
        pass
    try:
        return jsonlib.loads(body)
    except (jsonlib.JSONDecodeError, UnicodeDecodeError):
        return body.decode("utf-8", errors="replace")


class EngineClient:
    """Pooled async HTTP client with bounded retries; see the module docstring for the policy."""

    def __init__(self, *, max_connections: int = 1024, timeout_s: float | None = 600.0,
                 connect_timeout_s: float = 10.0, max_retries: int = 3, backoff_base_s: float = 0.5,
                 backoff_max_s: float = 8.0, trust_env: bool = False, timeout_advice: str = "") -> None:
        """
        Args:
            max_connections: pooled connections in all (requests beyond it wait for a free one).
            timeout_s: read timeout of one attempt (None: no limit): the longest the server may stay
                silent. Generation can be slow.
            connect_timeout_s: TCP connect timeout of one attempt (waiting for a pooled connection
                is not limited: the pool size is the queue).
            max_retries: extra attempts after the first (0: no retry).
            backoff_base_s, backoff_max_s: delay before retry k (k = 1, 2, ...) is
                min(backoff_max_s, backoff_base_s * 2**(k-1)), of which a random half is jitter.
            trust_env: honour HTTP(S)_PROXY etc.; off by default since engines are cluster-internal.
            timeout_advice: appended to the error of a request cut by `timeout_s` (not by a per-request
                timeout): which setting the caller's user raises.
        """
        if max_connections < 1:
            raise ValueError(f"max_connections must be >= 1, got {max_connections}")
        if max_retries < 0:
            raise ValueError(f"max_retries must be >= 0, got {max_retries}")
        if backoff_base_s < 0 or backoff_max_s < 0:
            raise ValueError("backoff_base_s and backoff_max_s must be >= 0")
        self.max_connections = max_connections
        self.max_retries = max_retries
        self.backoff_base_s = backoff_base_s
        self.backoff_max_s = backoff_max_s
        self.timeout_s = timeout_s
        self.connect_timeout_s = connect_timeout_s
        self.trust_env = trust_env
        self.timeout_advice = timeout_advice
        self._session: aiohttp.ClientSession | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._closed = False

    # ------------------------------------------------------------------ public API
    async def post(self, url: str, json: Any = None, *, timeout_s: float | None | EllipsisType = ...) -> Any:
        """POST `json` to `url`; the decoded JSON body (a dict for SGLang endpoints) or the text."""
        return await self.request("POST", url, json=json, timeout_s=timeout_s)

    async def get(self, url: str, *, timeout_s: float | None | EllipsisType = ...) -> Any:
        """GET `url`; the decoded JSON body, or the text when the body is not JSON."""
        return await self.request("GET", url, timeout_s=timeout_s)

    async def delete(self, url: str, *, timeout_s: float | None | EllipsisType = ...) -> Any:
        """DELETE `url`; the decoded JSON body or the text."""
        return await self.request("DELETE", url, timeout_s=timeout_s)

    async def request(self, method: str, url: str, *, json: Any = None,
                      timeout_s: float | None | EllipsisType = ...) -> Any:
        """One request with retries; raises EngineHTTPError when the last attempt fails.

        `timeout_s`: this request's read timeout per attempt (None: no limit); `...`: the client's."""
        self._check_loop()
        data = None if json is None else jsonlib.dumps(json).encode()  # encoded once for every attempt
        if isinstance(timeout_s, EllipsisType):
            read_s, timeout = self.timeout_s, None  # the session's
        else:
            read_s, timeout = timeout_s, self._timeout(timeout_s)
        attempts = self.max_retries + 1
        for attempt in range(1, attempts + 1):
            try:
                status, headers, body = await self._attempt(method, url, data, timeout)
            except aiohttp.SocketTimeoutError as exc:
                advice = f"; {self.timeout_advice}" if timeout is None and self.timeout_advice else ""
                raise EngineHTTPError(
                    f"{method} {url} timed out (no reply within the read timeout of {read_s} s); "
                    f"not retried because the server may still be processing it{advice}",
                    method=method, url=url) from exc
            except _RETRY_EXCEPTIONS as exc:
                if attempt == attempts:
                    raise EngineHTTPError(
                        f"{method} {url} failed after {attempts} attempt(s): {type(exc).__name__}: {exc}. "
                        "Is the engine/router running and reachable at that address?",
                        method=method, url=url) from exc
                delay = self._delay(attempt, None)
                logger.debug("%s %s: %s (attempt %d/%d), retrying in %.2f s",
                             method, url, type(exc).__name__, attempt, attempts, delay)
            except (aiohttp.ClientError, TimeoutError) as exc:
                raise EngineHTTPError(f"{method} {url} failed: {type(exc).__name__}: {exc}",
                                      method=method, url=url) from exc
            else:
                if status < 400:
                    return _decode(body)
                text = body.decode("utf-8", errors="replace")[:_BODY_CHARS]
                retryable = status == 429 or status >= 500
                if not retryable or attempt == attempts:
                    tried = f" after {attempt} attempt(s)" if retryable else ""
                    raise EngineHTTPError(f"{method} {url} returned HTTP {status}{tried}: {text}",
                                          method=method, url=url, status=status, body=text)
                delay = self._delay(attempt, headers.get("Retry-After"))
                logger.debug("%s %s: HTTP %d (attempt %d/%d), retrying in %.2f s",
                             method, url, status, attempt, attempts, delay)
            await asyncio.sleep(delay)
        raise AssertionError("unreachable")  # pragma: no cover

    async def aclose(self) -> None:
        """Close every pooled connection."""
        self._closed = True
        if self._session is not None:
            await self._session.close()

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    @property
    def closed(self) -> bool:
        """Whether `aclose()` has been called."""
        return self._closed

    # ------------------------------------------------------------------ internals
    async def _attempt(self, method: str, url: str, data: bytes | None,
                       timeout: aiohttp.ClientTimeout | None) -> tuple[int, Any, bytes]:
        """One HTTP exchange: status, headers and the whole body."""
        headers = {"Content-Type": "application/json"} if data is not None else None
        extra = {} if timeout is None else {"timeout": timeout}
        async with self._open().request(method, url, data=data, headers=headers, **extra) as response:
            return response.status, response.headers, await response.read()

    def _timeout(self, read_s: float | None) -> aiohttp.ClientTimeout:
        """No total limit (a pooled connection may be waited for), connect and read per attempt."""
        return aiohttp.ClientTimeout(total=None, connect=None, sock_connect=self.connect_timeout_s, sock_read=read_s)

    def _open(self) -> aiohttp.ClientSession:
        if self._closed:
            raise RuntimeError("EngineClient is closed")
        if self._session is None:
            self._session = aiohttp.ClientSession(
                connector=aiohttp.TCPConnector(limit=self.max_connections, limit_per_host=0),
                timeout=self._timeout(self.timeout_s),
                trust_env=self.trust_env,
            )
        return self._session

    def _delay(self, attempt: int, retry_after: str | None) -> float:
        """Exponential backoff with equal jitter; a numeric Retry-After raises it (capped at the max)."""
        ceiling = min(self.backoff_max_s, self.backoff_base_s * 2 ** (attempt - 1))
        delay = ceiling / 2 + random.uniform(0, ceiling / 2)
        if retry_after is not None:
            with contextlib.suppress(ValueError):  # an HTTP date instead of seconds: keep the backoff
                delay = max(delay, min(float(retry_after), self.backoff_max_s))
        return delay

    def _check_loop(self) -> None:
        loop = asyncio.get_running_loop()
        if self._loop is None:
            self._loop = loop
        elif self._loop is not loop:
            raise RuntimeError("EngineClient is bound to the event loop that first used it; "
                               "create one EngineClient per event loop")
