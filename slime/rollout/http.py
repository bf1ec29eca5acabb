"""The rollout's HTTP client and the router/worker calls generation relies on.

slime's plugins (`generate(args, sample, sampling_params)`) receive no client, so the rollout keeps
one `EngineClient` per running event loop here: `engine_client()` hands it to the default generate
function, the multi-turn helper and user plugins alike, and the rollout closes it when it ends.

The router forwards `/generate` but answers 404 for `/abort_request` (research/engines.md), so abort
goes to every worker URL directly, listed from the router's `GET /workers`; "idle" is read from each
worker's `GET /get_load` (SGLang and the built-in engine both serve it).

sglang-router 0.3.2 re-serialises a `/generate` body through its own request type, which has no
`return_routed_experts` nor `routed_experts_start_len`: it drops them, and the engine answers without routed
experts (a known gap of SGLang's router, sgl-project/sglang#20696; slime sends R3 through its own router). So a
`/generate` that asks for them goes to a healthy worker directly, the workers taken in turn (`generate_url`).

Timeouts: a non-streaming `/generate` sends nothing until the whole response is done, so the client's
read timeout bounds a generation. It is `rollout_http_timeout_s`, by default None (no limit, as slime's
client): the router bounds every request it forwards (`--sglang-router-request-timeout-secs` per attempt,
and its own retries) and a request it gives up on comes back as an HTTP error that the sample reports.
The control calls here (`/workers`, `/get_load`, `/abort_request`) answer at once from a live server and
get `CONTROL_TIMEOUT_S`.
"""

from __future__ import annotations

import asyncio
import logging
import weakref
from typing import Any

from slime.engines.client import EngineClient
from slime.errors import EngineError

logger = logging.getLogger(__name__)

# a live router or engine answers these at once; a dead one must not hold up an abort for long
CONTROL_TIMEOUT_S = 30.0
TIMEOUT_ADVICE = ("for longer generations raise rollout_http_timeout_s (--rollout-http-timeout-s), or leave it "
                  "unset: no client limit, the router's --sglang-router-request-timeout-secs bounds each request")

# per event loop: {read timeout: client}; one entry unless plugins ask for clients of other settings
_CLIENTS: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, dict[float | None, EngineClient]] = (
    weakref.WeakKeyDictionary())


def read_timeout_s(args: Any) -> float | None:
    """The read timeout of a rollout `/generate` call: `args.rollout_http_timeout_s` (None: no limit)."""
    given = getattr(args, "rollout_http_timeout_s", None)
    return None if given is None else float(given)


def rollout_client(args: Any, **options: Any) -> EngineClient:
    """A new `EngineClient` for generate calls, its read timeout from `args` (`read_timeout_s`)."""
    return EngineClient(timeout_s=read_timeout_s(args), timeout_advice=TIMEOUT_ADVICE, **options)


def engine_client(args: Any = None) -> EngineClient:
    """The shared client of the running event loop (created on first use).

    With `args`, the one whose read timeout is `read_timeout_s(args)`; without (a plugin that has no
    `args` at hand), the loop's first client, else one with the field's default (no read limit)."""
    clients = _CLIENTS.setdefault(asyncio.get_running_loop(), {})
    for key in [k for k, c in clients.items() if c.closed]:
        del clients[key]
    if args is None and clients:
        return next(iter(clients.values()))
    timeout = read_timeout_s(args)
    client = clients.get(timeout)
    if client is None:
        client = clients[timeout] = rollout_client(args)
    return client


async def close_engine_client() -> None:
    """Close the running loop's clients, if any (the next `engine_client()` makes a new one)."""
    for client in _CLIENTS.pop(asyncio.get_running_loop(), {}).values():
        await client.aclose()


def router_url(args: Any) -> str:
    """`http://{sglang_router_ip}:{sglang_router_port}` from slime's `args`."""
    port = getattr(args, "sglang_router_port", None)
    if not port:
        raise EngineError("args.sglang_router_port is not set: start the router (SGLangRouter) and put its "
                          "port in args before running a rollout")
    return f"http://{getattr(args, 'sglang_router_ip', None) or '127.0.0.1'}:{port}"


# per event loop: how many `/generate` calls `generate_url` sent past the router (its round robin)
_DIRECT_SENT: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, list[int]] = weakref.WeakKeyDictionary()


async def generate_url(args: Any, *, return_routed_experts: bool = False) -> str:
    """Where a rollout `/generate` goes: the router's, or (`return_routed_experts`, which the router drops) a
    healthy worker's of the router's listing, taken in turn."""
    if not return_routed_experts:
        return f"{router_url(args)}/generate"
    healthy = sorted(await worker_urls(engine_client(args), router_url(args), healthy_only=True))
    if not healthy:
        raise EngineError(f"no healthy worker at the router {router_url(args)} to send a /generate with "
                          "return_routed_experts to")
    sent = _DIRECT_SENT.setdefault(asyncio.get_running_loop(), [0])
    sent[0] += 1
    return f"{healthy[(sent[0] - 1) % len(healthy)]}/generate"


async def worker_urls(client: EngineClient, url: str, *, healthy_only: bool = False) -> list[str]:
    """Every worker registered at the router `url` (healthy or not: an abort must reach them all), or with
    `healthy_only` those the router reports healthy (a listing without `is_healthy` counts as healthy)."""
    listing = await client.get(f"{url}/workers", timeout_s=CONTROL_TIMEOUT_S)
    return [w["url"].rstrip("/") for w in listing["workers"] if not healthy_only or w.get("is_healthy", True)]


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
    loads = await asyncio.gather(*(client.get(f"{u}/get_load", timeout_s=CONTROL_TIMEOUT_S) for u in urls))
    return {u: num_requests(load) for u, load in zip(urls, loads, strict=True)}


async def abort_all(client: EngineClient, urls: list[str]) -> dict[str, BaseException]:
    """`POST /abort_request {"abort_all": true}` on every worker at once; {url: error} of those that
    could not be reached (a dead engine stays listed at the router, marked unhealthy)."""
    results = await asyncio.gather(*(client.post(f"{u}/abort_request", {"abort_all": True}, timeout_s=CONTROL_TIMEOUT_S)
                                     for u in urls), return_exceptions=True)
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
