"""Run a real sglang-router in front of the engines, register workers, and reach every worker directly.

The router (`python -m sglang_router.launch_router`, sglang-router 0.3.2) is the single URL rollout
code sends `/generate` to. Facts this module is built on, measured against 0.3.2:

* it listens on `--host/--port` and also binds a Prometheus exporter (`--prometheus-port`, default
  29000, host 0.0.0.0): a second router on one host panics unless each gets its own port, so both
  ports are picked free here and both bind the router host;
* `GET /liveness` is 200 once it serves; `/health` and `/readiness` are 503 until a worker is healthy;
* workers at runtime: `POST /workers {"url"}` -> 202 `{"worker_id", ...}` (queued: the worker is
  listed once the router's probe of `/health`, `/server_info`, `/model_info` passes);
  `GET /workers` -> `{"workers": [{"id", "url", "is_healthy", "load", ...}], "total", "stats"}`;
  `DELETE /workers/{id}` -> 202 (the id, not the URL);
* it forwards `/generate` and the OpenAI routes to one worker and broadcasts `POST /flush_cache`, but
  answers 404 for `/abort_request`, `/update_weights_*`, `/init_weights_update_group`,
  `/pause_generation`, `/continue_generation`, `/release_memory_occupation`,
  `/resume_memory_occupation` and `/update_weight_version`: those go to each worker directly (a
  worker's weight version is in its `GET /model_info`; SGLang 0.5.23 has no `/get_weight_version`)
  (`broadcast`).
"""

from __future__ import annotations

import asyncio
import logging
import os
import sys
import tempfile
import time
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any, Self

import httpx

from slime.config.engine_flags import check_router_args, flag_key, flags_to_argv
from slime.engines.client import EngineClient
from slime.engines.process import ServerProcess, local_host, server_url, start_server
from slime.errors import ConfigError, EngineError, EngineHTTPError, EngineStartError
from slime.net import find_free_port

logger = logging.getLogger(__name__)

DEFAULT_POLICY = "round_robin"
def _norm_url(url: str) -> str:
    return url.rstrip("/")


async def broadcast_to_workers(client: EngineClient, urls: Iterable[str], path: str, payload: Any = None,
                               *, method: str = "POST") -> dict[str, Any]:
    """Send one request to every worker URL concurrently; {url: decoded response}.

    Every request runs to completion; if any failed, EngineError lists each failing worker (the
    first failure is the cause), because a weight update or abort that reached only some engines
    must not pass silently.
    """
    urls = [_norm_url(u) for u in urls]
    if not urls:
        raise EngineError(f"no worker to send {method} {path} to")
    path = path if path.startswith("/") else "/" + path

    async def one(url: str) -> Any:
        if method == "POST":
            return await client.post(url + path, payload if payload is not None else {})
        return await client.request(method, url + path, json=payload)

    results = await asyncio.gather(*(one(u) for u in urls), return_exceptions=True)
    failed = {u: r for u, r in zip(urls, results, strict=True) if isinstance(r, BaseException)}
    if failed:
        detail = "\n  ".join(f"{u}: {e}" for u, e in failed.items())
        raise EngineError(f"{method} {path} failed on {len(failed)}/{len(urls)} worker(s):\n  {detail}") \
            from next(iter(failed.values()))
    return dict(zip(urls, results, strict=True))


class SGLangRouter:
    """A sglang-router process on `host` (127.0.0.1 by default) with its own free ports."""

    def __init__(self, *, host: str = "127.0.0.1", port: int | None = None, policy: str | None = None,
                 worker_urls: Sequence[str] = (), health_check_interval_secs: float | None = None,
                 health_failure_threshold: int | None = None, router_args: Mapping[str, Any] | None = None,
                 log_path: str | os.PathLike[str] | None = None, env: Mapping[str, str] | None = None,
                 python: str = sys.executable, startup_timeout_s: float = 60.0,
                 request_timeout_s: float = 30.0) -> None:
        """
        Args:
            policy: routing policy (random, round_robin, cache_aware, power_of_two, manual);
                default round_robin. May also come from `router_args["policy"]`, not both.
            worker_urls: engines registered at launch (more with `add_worker`).
            health_check_interval_secs, health_failure_threshold: the router's worker probing.
            router_args: any other router flag, underscored: `{"cache_threshold": 0.5}` ->
                `--cache-threshold 0.5`; True -> bare flag; False/None -> omitted; list -> values.
            startup_timeout_s: how long to wait for `GET /liveness` after launch.
            request_timeout_s: timeout of this class's own admin requests (workers list/add/remove).
        """
        self.router_args = {flag_key(str(k)): v for k, v in (router_args or {}).items()}
        check_router_args(self.router_args)
        for key, value in (("policy", policy), ("health_check_interval_secs", health_check_interval_secs),
                           ("health_failure_threshold", health_failure_threshold)):
            if value is None:
                continue
            if key in self.router_args and self.router_args[key] != value:
                raise ConfigError(f"router {key} given twice with different values: {value!r} (argument) "
                                  f"and {self.router_args[key]!r} (--router-{key.replace('_', '-')})")
            self.router_args[key] = value
        self.router_args.setdefault("policy", DEFAULT_POLICY)
        self.host = host
        self.port = port
        self.prometheus_port: int | None = None
        self.initial_worker_urls = [_norm_url(u) for u in worker_urls]
        self.log_path = Path(log_path) if log_path is not None else None
        self.env = dict(env or {})
        self.python = python
        self.startup_timeout_s = startup_timeout_s
        self.request_timeout_s = request_timeout_s
        self.process: ServerProcess | None = None
        self._http: httpx.Client | None = None
        self._added: dict[str, str] = {}  # url -> worker id returned by POST /workers

    # ------------------------------------------------------------------ lifecycle
    @property
    def url(self) -> str:
        """Base URL of the router (`http://host:port`); set once `start()` picked the port."""
        if self.port is None:
            raise RuntimeError("SGLangRouter has no port yet: call start() first")
        return server_url(self.host, self.port)

    def command(self) -> list[str]:
        """The launch command (picks free router and Prometheus ports first where none was given)."""
        bind = local_host(self.host)
        if self.port is None:
            self.port = find_free_port(bind)
        if self.prometheus_port is None:
            self.prometheus_port = find_free_port(bind)
            while self.prometheus_port == self.port:
                self.prometheus_port = find_free_port(bind)
        cmd = [self.python, "-m", "sglang_router.launch_router", "--host", self.host, "--port", str(self.port),
               "--prometheus-host", self.host, "--prometheus-port", str(self.prometheus_port)]
        if self.initial_worker_urls:
            cmd += ["--worker-urls", *self.initial_worker_urls]
        return cmd + flags_to_argv(self.router_args)

    def start(self) -> Self:
        """Launch the router and wait until `GET /liveness` is 200; on failure stop it and raise."""
        cmd = self.command()
        log_path = self.log_path or Path(tempfile.gettempdir()) / f"slime-router-{self.port}.log"
        self.process = start_server(cmd, log_path=log_path, health_url=self.url + "/liveness",
                                    timeout_s=self.startup_timeout_s, interval_s=0.2, env=self.env,
                                    name=f"sglang-router@{self.port}")
        logger.info("sglang-router ready at %s (policy %s)", self.url, self.router_args.get("policy"))
        return self

    def stop(self, timeout_s: float = 15.0) -> None:
        """Stop the router process group (idempotent)."""
        if self._http is not None:
            self._http.close()
            self._http = None
        if self.process is not None:
            self.process.stop(timeout_s=timeout_s)

    @property
    def alive(self) -> bool:
        return self.process is not None and self.process.alive

    def __enter__(self) -> Self:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # ------------------------------------------------------------------ worker registry (sync admin calls)
    def _request(self, method: str, path: str, *, json: Any = None, ok: tuple[int, ...] = (200,)) -> Any:
        if self._http is None:
            self._http = httpx.Client(timeout=self.request_timeout_s, trust_env=False)
        url = self.url + path
        try:
            response = self._http.request(method, url, json=json)
        except httpx.HTTPError as exc:
            state = "" if self.alive else f" (router process is not running; log: {self.process and self.process.log_path})"
            raise EngineHTTPError(f"{method} {url} failed: {type(exc).__name__}: {exc}{state}",
                                  method=method, url=url) from exc
        if response.status_code not in ok:
            body = response.text[:500]
            raise EngineHTTPError(f"{method} {url} returned HTTP {response.status_code}: {body}",
                                  method=method, url=url, status=response.status_code, body=body)
        try:
            return response.json() if response.content else None
        except ValueError as exc:
            raise EngineHTTPError(f"{method} {url} answered non-JSON: {response.text[:500]}", method=method,
                                  url=url, status=response.status_code, body=response.text[:500]) from exc

    def list_workers(self) -> list[dict[str, Any]]:
        """Registered workers as the router reports them: `{"id", "url", "is_healthy", "load", ...}`."""
        return list(self._request("GET", "/workers")["workers"])

    def worker_urls(self, healthy_only: bool = False) -> list[str]:
        """URLs of the registered workers (only the healthy ones if asked)."""
        return [w["url"] for w in self.list_workers() if w.get("is_healthy") or not healthy_only]

    def add_worker(self, url: str) -> str:
        """Register an engine (`POST /workers`); returns its worker id. A listed URL is not added twice.

        Registration is asynchronous: the worker is listed once the router's probe passes; use
        `wait_workers_healthy` to wait for it.
        """
        url = _norm_url(url)
        for worker in self.list_workers():
            if _norm_url(worker["url"]) == url:
                return str(worker["id"])
        answer = self._request("POST", "/workers", json={"url": url}, ok=(200, 201, 202))
        worker_id = str(answer["worker_id"])
        self._added[url] = worker_id
        logger.info("router %s: adding worker %s (id %s)", self.url, url, worker_id)
        return worker_id

    def remove_worker(self, url: str, timeout_s: float = 10.0) -> None:
        """Deregister the engine at `url` (`DELETE /workers/{id}`) and wait until it is no longer listed."""
        url = _norm_url(url)
        listed = self.list_workers()
        ids = [str(w["id"]) for w in listed if _norm_url(w["url"]) == url]
        if not ids and url in self._added:  # added by us but still being probed: not listed yet
            ids = [self._added[url]]
        if not ids:
            raise EngineError(f"worker {url} is not registered at router {self.url}; "
                              f"registered: {[w['url'] for w in listed]}")
        for worker_id in ids:
            self._request("DELETE", f"/workers/{worker_id}", ok=(200, 202, 204))
        self._added.pop(url, None)
        deadline = time.monotonic() + timeout_s
        while any(_norm_url(w["url"]) == url for w in self.list_workers()):
            if time.monotonic() >= deadline:
                raise EngineError(f"router {self.url} still lists worker {url} {timeout_s:.0f} s after DELETE")
            time.sleep(0.1)
        logger.info("router %s: removed worker %s", self.url, url)

    def wait_workers_healthy(self, n: int, timeout_s: float = 60.0, interval_s: float = 0.2) -> list[dict[str, Any]]:
        """Wait until at least `n` registered workers are healthy; returns the healthy ones."""
        deadline = time.monotonic() + timeout_s
        while True:
            if self.process is not None and not self.alive:
                raise EngineStartError(f"sglang-router at {self.url} exited (code {self.process.returncode}); "
                                       f"last lines of {self.process.log_path}:\n{self.process.log_tail()}")
            workers = self.list_workers()
            healthy = [w for w in workers if w.get("is_healthy")]
            if len(healthy) >= n:
                return healthy
            if time.monotonic() >= deadline:
                state = ", ".join(f"{w['url']} healthy={w.get('is_healthy')}" for w in workers) or "none listed"
                pending = sorted(set(self._added) - {_norm_url(w["url"]) for w in workers})
                raise EngineStartError(
                    f"router {self.url}: {len(healthy)}/{n} workers healthy after {timeout_s:.0f} s "
                    f"(workers: {state}; still being probed: {pending or 'none'}). A worker must answer "
                    f"GET /health, /server_info and /model_info.")
            time.sleep(interval_s)

    # ------------------------------------------------------------------ direct-to-worker calls
    async def broadcast(self, client: EngineClient, path: str, payload: Any = None, *, method: str = "POST",
                        healthy_only: bool = False) -> dict[str, Any]:
        """Send `method path` to every registered worker directly (what the router does not route).

        Use for `/abort_request`, `/update_weights_from_*`, `/pause_generation`,
        `/continue_generation`, `/release_memory_occupation`, `/resume_memory_occupation`,
        `/update_weight_version` and `GET /model_info` (each worker's weight version). The worker list
        is read from the router through `client`.
        """
        listing = await client.get(self.url + "/workers")
        urls = [w["url"] for w in listing["workers"] if w.get("is_healthy") or not healthy_only]
        if not urls:
            raise EngineError(f"router {self.url} has no {'healthy ' if healthy_only else ''}worker "
                              f"to send {method} {path} to")
        return await broadcast_to_workers(client, urls, path, payload, method=method)
