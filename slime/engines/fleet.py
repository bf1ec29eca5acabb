"""Engine fleets: for stages that sample from one fixed policy (rejection sampling, evaluate: an HF directory,
`slime.stages.export.policy_hf_dir`), and the RL loop's rollout engines.

`EngineFleet` is the one place engines are started: N engines of one model (built-in or SGLang,
`engine.engine`; on GPUs each with `CUDA_VISIBLE_DEVICES` set to its devices) behind a fresh
sglang-router. It knows every engine's URL, process and state, and can replace one by index (stop the
old process group, start a new one on a fresh port: a new URL, so a distributed weight-sync group is
formed anew) and register it with the router again. `serve_policy` runs a fleet for one block and
stops it after, also on errors; the RL loop's rollout manager keeps one for the whole run and replaces
dead engines (`slime.engines.health`).

With `engine.rollout_external_engine_addrs` (slime's flag) the fleet starts no engine: its slots are the
engines a user started, one per address, each waited for (`/health_generate`) and registered with the
router; stopping the fleet stops the router only, and such an engine cannot be restarted.

Engine states: `serving` (registered at the router), `restarting`, `awaiting_sync` (running, not
registered: it holds another weight version than the fleet), `down` (a restart failed; the health
monitor tries again) and `failed` (given up: stopped for good).
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Self

import httpx

from slime.config import Config
from slime.config.engine_flags import external_engine_urls, flag_key
from slime.engines.host import EngineHost, RemoteEngine
from slime.engines.launch import launch_engine
from slime.engines.router import SGLangRouter
from slime.errors import ConfigError, EngineError, EngineStartError

logger = logging.getLogger(__name__)


ROUTER_WAIT_S = 120.0
LIVE = ("serving", "awaiting_sync")  # states of a running engine


@dataclass
class EngineSlot:
    """One engine position of the fleet; its process changes when it is restarted."""

    index: int
    devices: list[int]
    server: Any = None  # ServerProcess (built-in) or SGLangEngine: both have .stop()
    url: str = ""
    state: str = "down"
    restarts: int = 0

    @property
    def pid(self) -> int | None:
        process = getattr(self.server, "process", self.server)  # SGLangEngine wraps a ServerProcess
        return getattr(process, "pid", None)

    def info(self) -> dict[str, Any]:
        return {"index": self.index, "url": self.url, "pid": self.pid, "state": self.state,
                "restarts": self.restarts, "devices": list(self.devices)}


def managed_router_args(router_args: dict[str, Any]) -> dict[str, Any]:
    """The router flags for a fleet: the user's, with the circuit breaker off unless they configure it.

    The fleet watches and replaces its engines itself (`slime.engines.health`). sglang-router's breaker
    (on by default: 10 failed requests within 120 s) takes a worker out of rotation for a minute on its own,
    and with one engine every request is then answered 503 `no_available_workers`: the first GPU pipeline
    run lost its RL stage that way at step 34 of 40. `--router-cb-*` or `--router-disable-circuit-breaker`
    given by the user win.
    """
    keys = {flag_key(str(k)) for k in router_args}
    if any(k.startswith("cb_") or k == "disable_circuit_breaker" for k in keys):
        return dict(router_args)
    return {**router_args, "disable_circuit_breaker": True}


class EngineFleet:
    """Engines of one model behind one router; see the module docstring. `start()`, then `stop()` always.

    Args:
        config: engine kind, SGLang and router pass-through, router address, seed.
        model_dir: HF directory every engine loads at start.
        log_dir: engine{i}.log (a restart appends to it) and router.log.
        devices: GPU ids per engine (`[[]] * n` on CPU); its length is the number of engines.
        hosts: per engine, None (started by this process, on this node) or the Ray actor options of an
            `EngineHost` on the engine's node (`Placement.engine_host_options()`), which starts it there.
    """

    def __init__(self, config: Config, model_dir: str, log_dir: Path, devices: list[list[int]],
                 hosts: list[dict[str, Any] | None] | None = None) -> None:
        self.external = external_engine_urls(config.engine.rollout_external_engine_addrs or [])
        if self.external:  # engines a user started: one slot per address, nothing to place or host
            devices, hosts = [[] for _ in self.external], None
        if not devices:
            raise ConfigError("an engine fleet needs at least one engine")
        if hosts is not None and len(hosts) != len(devices):
            raise ConfigError(f"{len(hosts)} engine hosts for {len(devices)} engines")
        self.hosts = hosts or [None] * len(devices)
        self._host_actors: dict[int, Any] = {}  # engine index -> its EngineHost actor (engines on other nodes)
        self.config = config
        self.model_dir = model_dir
        self.log_dir = Path(log_dir)
        self.slots = [EngineSlot(i, list(d)) for i, d in enumerate(devices)]
        self.router: SGLangRouter | None = None
        self.lock = threading.RLock()  # slot states and router admin calls (the health monitor is a thread)

    # ------------------------------------------------------------------------- lifecycle

    def start(self) -> Self:
        """Start every engine, then the router with all of them; wait until all are healthy there."""
        c = self.config
        try:
            for slot in self.slots:
                self._launch(slot)
            self.router = SGLangRouter(host=c.engine.sglang_router_ip, port=c.engine.sglang_router_port,
                                       worker_urls=[s.url for s in self.slots],
                                       router_args=managed_router_args(c.router),
                                       log_path=self.log_dir / "router.log")
            self.router.start()
            self.router.wait_workers_healthy(len(self.slots), timeout_s=ROUTER_WAIT_S)
        except BaseException:
            self.stop()
            raise
        for slot in self.slots:
            slot.state = "serving"
        return self

    def stop(self) -> None:
        """Stop the router and every engine process (idempotent)."""
        with self.lock:
            if self.router is not None:
                self.router.stop()
                self.router = None
            for slot in reversed(self.slots):
                if slot.server is not None:
                    slot.server.stop()
                    slot.server = None
                slot.state = "down" if slot.state != "failed" else "failed"
            if self._host_actors:
                import ray

                for host in self._host_actors.values():
                    ray.kill(host)
                self._host_actors = {}

    def __enter__(self) -> Self:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def _launch(self, slot: EngineSlot) -> None:
        """Start `slot`'s engine on a free port and wait until it can generate: in this process, or through
        its `EngineHost` actor when it has a host (an engine on another node; a restart reuses the host);
        an external engine (--rollout-external-engine-addrs) is only waited for."""
        if self.external:
            slot.url = self.external[slot.index]
            wait_external_engine(slot.url)
            return
        log = self.log_dir / f"engine{slot.index}.log"
        options = self.hosts[slot.index]
        if options is None:
            def keep(server: Any) -> None:  # stoppable even if start fails half-way
                slot.server = server

            slot.url = launch_engine(self.config, self.model_dir, log, slot.index, slot.devices, keep)
            return
        import ray

        if slot.index not in self._host_actors:
            self._host_actors[slot.index] = ray.remote(EngineHost).options(**options).remote(
                self.config.model_dump(mode="json"))
        host = self._host_actors[slot.index]
        slot.server = RemoteEngine(host)  # stoppable even if start fails half-way
        slot.url, slot.server.pid = ray.get(host.launch.remote(self.model_dir, str(log), slot.index, slot.devices))

    # ------------------------------------------------------------------------- state

    def urls(self, states: Iterable[str] = ("serving",)) -> list[str]:
        """URLs of the engines in `states`, by index."""
        wanted = set(states)
        with self.lock:
            return [s.url for s in self.slots if s.state in wanted]

    def info(self) -> list[dict[str, Any]]:
        """Per engine: index, url, pid, state, restarts, devices."""
        with self.lock:
            return [s.info() for s in self.slots]

    @property
    def restarts(self) -> int:
        """Restarts of all engines so far."""
        return sum(s.restarts for s in self.slots)

    def _router(self) -> SGLangRouter:
        if self.router is None:
            raise EngineError("the engine fleet is not running (start() it first)")
        return self.router

    # ------------------------------------------------------------------------- replacing an engine

    def deregister(self, index: int) -> None:
        """Take engine `index` out of the router (nothing if it is not registered)."""
        slot = self.slots[index]
        with self.lock:
            try:
                self._router().remove_worker(slot.url)
            except EngineError as exc:
                logger.info("engine %d (%s) was not registered at the router: %s", index, slot.url, exc)

    def restart(self, index: int) -> str:
        """Replace engine `index`: out of the router, its process group stopped, a new one started on a
        fresh port (state `awaiting_sync`, not registered). Returns the new URL; on a failed start the
        slot is `down` and EngineStartError is raised."""
        slot = self.slots[index]
        if self.external:
            raise EngineError(f"engine {index} ({slot.url}) was started outside this run "
                              "(rollout_external_engine_addrs): it cannot be restarted here")
        with self.lock:
            old = slot.url
            slot.state = "restarting"
        t0 = time.monotonic()
        self.deregister(index)
        if slot.server is not None:
            slot.server.stop(timeout_s=10.0)
        slot.restarts += 1
        try:
            self._launch(slot)
        except BaseException:
            with self.lock:
                slot.state = "down"
            raise
        with self.lock:
            slot.state = "awaiting_sync"
        logger.info("engine %d restarted in %.1f s: %s -> %s (pid %s)", index, time.monotonic() - t0, old,
                    slot.url, slot.pid)
        return slot.url

    def register(self, index: int, timeout_s: float = ROUTER_WAIT_S) -> None:
        """Add engine `index` to the router and wait until the router lists it healthy (state `serving`)."""
        slot = self.slots[index]
        with self.lock:
            router = self._router()
            router.add_worker(slot.url)
        deadline = time.monotonic() + timeout_s
        while True:
            with self.lock:
                listed = {w["url"].rstrip("/"): w.get("is_healthy") for w in router.list_workers()}
            if listed.get(slot.url.rstrip("/")):
                break
            if time.monotonic() >= deadline:
                raise EngineStartError(f"router {router.url} did not list engine {index} ({slot.url}) as healthy "
                                       f"within {timeout_s:.0f} s (listed: {listed})")
            time.sleep(0.2)
        with self.lock:
            slot.state = "serving"
        logger.info("engine %d (%s) registered with the router again", index, slot.url)

    def retire(self, index: int) -> None:
        """Give engine `index` up: out of the router, stopped, state `failed`."""
        slot = self.slots[index]
        self.deregister(index)
        if slot.server is not None:
            slot.server.stop(timeout_s=10.0)
            slot.server = None
        with self.lock:
            slot.state = "failed"


def wait_external_engine(url: str, timeout_s: float = ROUTER_WAIT_S, interval_s: float = 0.5) -> None:
    """Wait until the engine a user started at `url` answers `/health_generate` (it can generate)."""

    deadline = time.monotonic() + timeout_s
    last = "no answer"
    with httpx.Client(timeout=10.0, trust_env=False) as http:
        while True:
            try:
                reply = http.get(f"{url}/health_generate")
                if reply.status_code == 200:
                    return
                last = f"HTTP {reply.status_code}: {reply.text[:200]}"
            except httpx.HTTPError as exc:
                last = f"{type(exc).__name__}: {exc}"
            if time.monotonic() >= deadline:
                raise EngineStartError(f"external engine {url} (rollout_external_engine_addrs) did not answer "
                                       f"/health_generate within {timeout_s:.0f} s: {last}")
            time.sleep(interval_s)


@contextlib.contextmanager
def serve_policy(config: Config, model_dir: str, log_dir: Path, num_engines: int) -> Iterator[SGLangRouter]:
    """`num_engines` engines for `model_dir` behind a new router (yielded, healthy); all stopped on exit."""
    with EngineFleet(config, model_dir, log_dir, [[] for _ in range(num_engines)]) as fleet:
        yield fleet.router
