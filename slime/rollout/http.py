"""The rollout's HTTP client and the router/worker calls generation relies on.

slime's plugins (`generate(args, sample, sampling_params)`) receive no client, so the rollout keeps
one `EngineClient` per running event loop here: `engine_client()` hands it to the default generate
function, the multi-turn helper and user plugins alike, and the rollout closes it when it ends.

The router forwards `/generate` but answers 404 for `/abort_request` (research/engines.md), so abort
goes to every worker URL directly, listed from the router's `GET /workers`; "idle" is read from each
worker's `GET /get_load` (SGLang and the built-in engine both serve it).
"""

from __future__ import annotations

import asyncio
import logging
import weakref
from typing import Any

from slime.engines.client import EngineClient
from slime.errors import EngineError

logger = logging.getLogger(__name__)

_CLIENTS: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, EngineClient] = weakref.WeakKeyDictionary()


def engine_client() -> EngineClient:
    """The shared client of the running event loop (created on first use)."""
    loop = asyncio.get_running_loop()
    client = _CLIENTS.get(loop)
    if client is None or client.closed:
        client = _CLIENTS[loop] = EngineClient()
    return client


async def close_engine_client() -> None:
    """Close the running loop's client, if any (the next `engine_client()` makes a new one)."""
    client = _CLIENTS.pop(asyncio.get_running_loop(), None)
    if client is not None:
        await client.aclose()


def router_url(args: Any) -> str:
    """`http://{sglang_router_ip}:{sglang_router_port}` from slime's `args`."""
    port = getattr(args, "sglang_router_port", None)
    if not port:
        raise EngineError("args.sglang_router_port is not set: start the router (SGLangRouter) and put its "
                          "port in args before running a rollout")
    return f"http://{getattr(args, 'sglang_router_ip', None) or '127.0.0.1'}:{port}"


async def worker_urls(client: EngineClient, url: str) -> list[str]:
    """Every worker registered at the router `url` (healthy or not: an abort must reach them all)."""
    listing = await client.get(f"{url}/workers")
    return [w["url"].rstrip("/") for w in listing["workers"]]


def num_requests(load: Any) -> int:
    """Requests (running + waiting) in a `/get_load` answer: a dict or a list of per-DP-rank dicts."""
    if isinstance(load, list):
        return sum(num_requests(item) for item in load)
    if not isinstance(load, dict):
        return 0
    if isinstance(load.get("num_reqs"), int):
        return load["num_reqs"]
    running = load.get("num_running_reqs", 0)
    waiting = load.get("num_waiting_reqs", 0)
    return (running if isinstance(running, int) else 0) + (waiting if isinstance(waiting, int) else 0)


async def running_requests(client: EngineClient, urls: list[str]) -> dict[str, int]:
    """{worker url: requests it holds}."""
    loads = await asyncio.gather(*(client.get(f"{u}/get_load") for u in urls))
    return {u: num_requests(load) for u, load in zip(urls, loads, strict=True)}


async def abort_all(client: EngineClient, urls: list[str]) -> dict[str, BaseException]:
    """`POST /abort_request {"abort_all": true}` on every worker at once; {url: error} of those that
    could not be reached (a dead engine stays listed at the router, marked unhealthy)."""
    results = await asyncio.gather(*(client.post(f"{u}/abort_request", {"abort_all": True}) for u in urls),
                                   return_exceptions=True)
    failed = {u: r for u, r in zip(urls, results, strict=True) if isinstance(r, BaseException)}
    for u, exc in failed.items():
        if not isinstance(exc, EngineError):
            raise exc
        logger.warning("abort_request to %s failed: %s", u, exc)
    return failed


def rollout_args(config: Any, router: Any) -> Any:
    """slime's flat `args` for plugins: `config.as_namespace()` (every setting, sampling included) with
    `sglang_router_ip` / `sglang_router_port` of the running `router` (an `SGLangRouter`), so a plugin
    can call the router itself."""
    args = config.as_namespace()
    args.sglang_router_ip = "127.0.0.1" if router.host in ("0.0.0.0", "") else router.host
    args.sglang_router_port = router.port
    return args
