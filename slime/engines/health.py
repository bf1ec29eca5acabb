"""Engine health monitor for fault tolerance (slime's `--use-fault-tolerance`, `RolloutHealthMonitor`).

A daemon thread calls `GET {engine}/health_generate` on every monitored engine each
`rollout_health_check_interval` seconds, with `rollout_health_check_timeout` as the limit. An engine whose
checks fail `rollout_health_check_failures` times in a row is handed to `on_dead(index)` (the rollout
manager restarts, re-syncs and re-registers it); one that has been restarted `rollout_max_engine_restarts`
times already goes to `on_give_up(index)` instead and stays down.

The decisions are in `FailureTracker` (pure, unit-tested); `HealthMonitor` only adds the thread, the
probes and pausing. `pause()` returns only once a check round in progress (a restart included) has
finished, so an offload or a weight sync never overlaps a restart. Where it departs from slime: slime
restarts on the first failed check; here the threshold is a setting (default 1, as slime).
"""

from __future__ import annotations

import logging
import threading
from collections import defaultdict
from collections.abc import Callable
from typing import Literal

import httpx

logger = logging.getLogger(__name__)

Decision = Literal["ok", "wait", "restart", "give_up"]


class FailureTracker:
    """Counts failed checks in a row and restarts per engine index; says what to do after each check."""

    def __init__(self, failure_threshold: int, max_restarts: int) -> None:
        if failure_threshold < 1:
            raise ValueError(f"failure_threshold must be >= 1, got {failure_threshold}")
        if max_restarts < 0:
            raise ValueError(f"max_restarts must be >= 0, got {max_restarts}")
        self.failure_threshold = failure_threshold
        self.max_restarts = max_restarts
        self.failures: defaultdict[int, int] = defaultdict(int)
        self.restarts: defaultdict[int, int] = defaultdict(int)

    def record(self, index: int, healthy: bool) -> Decision:
        """One check of engine `index`: ok (healthy), wait (failing, below the threshold), restart, or
        give_up (at the threshold with no restart left). Restart and give_up reset the failure count."""
        if healthy:
            self.failures[index] = 0
            return "ok"
        self.failures[index] += 1
        if self.failures[index] < self.failure_threshold:
            return "wait"
        self.failures[index] = 0
        if self.restarts[index] >= self.max_restarts:
            return "give_up"
        self.restarts[index] += 1
        return "restart"


def probe(http: httpx.Client, url: str, timeout_s: float) -> bool:
    """Whether `GET {url}/health_generate` answers 200 within `timeout_s`."""
    try:
        return http.get(f"{url}/health_generate", timeout=timeout_s).status_code == 200
    except httpx.HTTPError as exc:
        logger.warning("health check of %s failed: %s: %s", url, type(exc).__name__, exc)
        return False


class HealthMonitor:
    """Polls the engines that `targets()` names ({index: url}) on a daemon thread; see the module docstring."""

    def __init__(self, targets: Callable[[], dict[int, str]], on_dead: Callable[[int], None],
                 on_give_up: Callable[[int], None], *, interval_s: float, timeout_s: float,
                 first_wait_s: float = 0.0, failure_threshold: int = 1, max_restarts: int = 3) -> None:
        self.targets = targets
        self.on_dead = on_dead
        self.on_give_up = on_give_up
        self.interval_s = interval_s
        self.timeout_s = timeout_s
        self.first_wait_s = first_wait_s
        self.tracker = FailureTracker(failure_threshold, max_restarts)
        self._stop = threading.Event()
        self._running = threading.Event()  # set while checks are enabled (not paused)
        self._round = threading.Lock()  # held for a whole check round, restarts included
        self._first_wait = True
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        """Start the thread, checking at once (after `first_wait_s`)."""
        if self._thread is not None:
            return
        self._running.set()
        self._thread = threading.Thread(target=self._run, name="engine-health-monitor", daemon=True)
        self._thread.start()
        logger.info("engine health monitor started: every %.1f s, timeout %.1f s, restart after %d failure(s), "
                    "at most %d restart(s) per engine", self.interval_s, self.timeout_s,
                    self.tracker.failure_threshold, self.tracker.max_restarts)

    def pause(self) -> None:
        """Stop checking (engines offloaded or being synced); returns after a round in progress ended."""
        self._running.clear()
        with self._round:
            pass

    def resume(self) -> None:
        """Check again, after `first_wait_s`."""
        self._first_wait = True
        self._running.set()

    def stop(self) -> None:
        """End the thread (idempotent); waits for a round in progress."""
        self._stop.set()
        self._running.set()  # wake a paused thread so that it sees the stop
        if self._thread is not None:
            self._thread.join()
            self._thread = None

    def check_once(self, http: httpx.Client) -> dict[int, Decision]:
        """One round: probe every target, act on the decisions; {index: decision}."""
        decisions: dict[int, Decision] = {}
        with self._round:
            for index, url in self.targets().items():
                if self._stop.is_set() or not self._running.is_set():
                    break
                decision = self.tracker.record(index, probe(http, url, self.timeout_s))
                decisions[index] = decision
                if decision == "restart":
                    logger.error("engine %d at %s failed %d health check(s) in a row: restarting it (restart %d/%d)",
                                 index, url, self.tracker.failure_threshold, self.tracker.restarts[index],
                                 self.tracker.max_restarts)
                    self.on_dead(index)
                elif decision == "give_up":
                    logger.error("engine %d at %s is dead and was restarted %d time(s) already: it stays down",
                                 index, url, self.tracker.max_restarts)
                    self.on_give_up(index)
        return decisions

    def _run(self) -> None:
        with httpx.Client(trust_env=False) as http:
            while not self._stop.is_set():
                self._running.wait()
                if self._stop.is_set():
                    break
                if self._first_wait:
                    self._first_wait = False
                    if self._stop.wait(self.first_wait_s):
                        break
                    continue  # paused meanwhile? go round again
                try:
                    self.check_once(http)
                except Exception:  # a failed restart must not end monitoring of the other engines
                    logger.exception("engine health check round failed")
                self._stop.wait(self.interval_s)
