"""The one async HTTP client that rollout code uses to talk to the router and the engines.

A single pooled `httpx.AsyncClient` (bounded connections, so thousands of concurrent generate calls
queue for a connection instead of opening thousands of sockets), a per-request timeout, and bounded
retries with exponential backoff and jitter. Retried: connection failures (refused, reset, dropped
mid-response) and HTTP 429 / 5xx, which is what a restarting engine or a router without a healthy
worker answers. Never retried: other 4xx (the request itself is wrong) and read timeouts (the engine
may still be working on the request). After the last attempt an `EngineHTTPError` names the method,
URL, status and the start of the body.

Event loops: an `EngineClient` belongs to the event loop that first uses it (httpx pools are bound
to one loop). Create one per loop, share it among all coroutines of that loop, and `aclose()` it
(or use `async with`) before the loop ends. Using it from another loop raises RuntimeError.
"""

from __future__ import annotations

import asyncio
import contextlib
import json as jsonlib
import logging
import random
from typing import Any, Self

import httpx

from slime.errors import EngineHTTPError

logger = logging.getLogger(__name__)

_BODY_CHARS = 500
# Failures where the request never reached the server or the connection broke: safe to retry.
_RETRY_EXCEPTIONS = (
    httpx.ConnectError,
    httpx.ConnectTimeout,
    httpx.PoolTimeout,
    httpx.ReadError,
    httpx.WriteError,
    httpx.RemoteProtocolError,
)


def _decode(response: httpx.Response) -> Any:
    """JSON body when there is one, else the text ('' for an empty body)."""
    if not response.content:
        return ""
    try:
        return response.json()
    except (jsonlib.JSONDecodeError, UnicodeDecodeError):
        return response.text


class EngineClient:
    """Pooled async HTTP client with bounded retries; see the module docstring for the policy."""

    def __init__(self, *, max_connections: int = 1024, timeout_s: float | None = 600.0,
                 connect_timeout_s: float = 10.0, max_retries: int = 3, backoff_base_s: float = 0.5,
                 backoff_max_s: float = 8.0, trust_env: bool = False) -> None:
        """
        Args:
            max_connections: pooled connections in all (requests beyond it wait for a free one).
            timeout_s: read/write timeout of one attempt (None: no limit). Generation can be slow.
            connect_timeout_s: TCP connect timeout of one attempt.
            max_retries: extra attempts after the first (0: no retry).
            backoff_base_s, backoff_max_s: delay before retry k (k = 1, 2, ...) is
                min(backoff_max_s, backoff_base_s * 2**(k-1)), of which a random half is jitter.
            trust_env: honour HTTP(S)_PROXY etc.; off by default since engines are cluster-internal.
        """
        if max_connections < 1:
            raise ValueError(f"max_connections must be >= 1, got {max_connections}")
        if max_retries < 0:
            raise ValueError(f"max_retries must be >= 0, got {max_retries}")
        if backoff_base_s < 0 or backoff_max_s < 0:
            raise ValueError("backoff_base_s and backoff_max_s must be >= 0")
        self.max_retries = max_retries
        self.backoff_base_s = backoff_base_s
        self.backoff_max_s = backoff_max_s
        self.timeout_s = timeout_s
        self._client = httpx.AsyncClient(
            limits=httpx.Limits(max_connections=max_connections, max_keepalive_connections=max_connections),
            # pool=None: wait as long as needed for a pooled connection; the limit is the queue.
            timeout=httpx.Timeout(timeout_s, connect=connect_timeout_s, pool=None),
            trust_env=trust_env,
        )
        self._loop: asyncio.AbstractEventLoop | None = None

    # ------------------------------------------------------------------ public API
    async def post(self, url: str, json: Any = None) -> Any:
        """POST `json` to `url`; the decoded JSON body (a dict for SGLang endpoints) or the text."""
        return await self.request("POST", url, json=json)

    async def get(self, url: str) -> Any:
        """GET `url`; the decoded JSON body, or the text when the body is not JSON."""
        return await self.request("GET", url)

    async def delete(self, url: str) -> Any:
        """DELETE `url`; the decoded JSON body or the text."""
        return await self.request("DELETE", url)

    async def request(self, method: str, url: str, *, json: Any = None) -> Any:
        """One request with retries; raises EngineHTTPError when the last attempt fails."""
        self._check_loop()
        attempts = self.max_retries + 1
        for attempt in range(1, attempts + 1):
            try:
                response = await self._client.request(method, url, json=json)
            except _RETRY_EXCEPTIONS as exc:
                if attempt == attempts:
                    raise EngineHTTPError(
                        f"{method} {url} failed after {attempts} attempt(s): {type(exc).__name__}: {exc}. "
                        "Is the engine/router running and reachable at that address?",
                        method=method, url=url) from exc
                delay = self._delay(attempt, None)
                logger.debug("%s %s: %s (attempt %d/%d), retrying in %.2f s",
                             method, url, type(exc).__name__, attempt, attempts, delay)
            except httpx.TimeoutException as exc:
                raise EngineHTTPError(
                    f"{method} {url} timed out ({type(exc).__name__}, timeout {self.timeout_s} s); "
                    "not retried because the server may still be processing it",
                    method=method, url=url) from exc
            except httpx.HTTPError as exc:
                raise EngineHTTPError(f"{method} {url} failed: {type(exc).__name__}: {exc}",
                                      method=method, url=url) from exc
            else:
                status = response.status_code
                if status < 400:
                    return _decode(response)
                body = response.text[:_BODY_CHARS]
                retryable = status == 429 or status >= 500
                if not retryable or attempt == attempts:
                    tried = f" after {attempt} attempt(s)" if retryable else ""
                    raise EngineHTTPError(f"{method} {url} returned HTTP {status}{tried}: {body}",
                                          method=method, url=url, status=status, body=body)
                delay = self._delay(attempt, response.headers.get("retry-after"))
                logger.debug("%s %s: HTTP %d (attempt %d/%d), retrying in %.2f s",
                             method, url, status, attempt, attempts, delay)
            await asyncio.sleep(delay)
        raise AssertionError("unreachable")  # pragma: no cover

    async def aclose(self) -> None:
        """Close every pooled connection."""
        await self._client.aclose()

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    @property
    def closed(self) -> bool:
        """Whether `aclose()` has been called."""
        return self._client.is_closed

    # ------------------------------------------------------------------ internals
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
