"""Where a burst of requests spends its time inside the built-in engine (/server_info's `busy_period`).

A *busy period* runs from the first request that finds the model thread idle until the thread is idle
again (the replies of that period's last requests are still counted into it). For a benchmark that
sends N requests at once and waits for all replies, one period is one run, and its record answers
where the run's time went on the server: how long the N requests took to arrive and be admitted, how
many decode steps ran and with how many rows, how much of the model thread's time was prefill,
decode (split into launching the step, the sampler, waiting for the device's results and recording
the tokens) or neither, and how long the replies took to build. Times are seconds, the moments
relative to the period's first arrival. Counting costs a few `perf_counter` calls per step.
"""

from __future__ import annotations

import contextlib
import gc
import threading
import time
from typing import Any

# Per-period sums (seconds unless named otherwise); moments are kept separately.
_SUMS = ("requests", "prefills", "prefill_rows", "prefill_s", "decode_steps", "decode_rows", "decode_s",
         "launch_s", "sample_s", "wait_s", "record_s", "build_s", "replies", "json_s", "gc_full", "gc_s")


class BusyStats:
    """The current (or last) busy period's counts and moments; written by the model thread (steps) and
    the HTTP thread (arrivals, replies)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._period: dict[str, Any] | None = None
        self._closed = True
        self._start = 0.0
        self._gc_start: float | None = None

    def watch_gc(self) -> None:
        """Count Python's garbage collections in the period (`gc_s`, and `gc_full`: generation-2 ones):
        each holds the GIL, stalling the HTTP thread and the model thread alike."""
        gc.callbacks.append(self._on_gc)

    def unwatch_gc(self) -> None:
        with contextlib.suppress(ValueError):
            gc.callbacks.remove(self._on_gc)

    def _on_gc(self, phase: str, info: dict[str, int]) -> None:
        if phase == "start":
            self._gc_start = time.perf_counter()
            return
        period = self._period
        if period is None or self._closed or self._gc_start is None:
            return
        period["gc_s"] += time.perf_counter() - self._gc_start
        period["gc_full"] += info.get("generation") == 2

    def arrived(self) -> None:
        """A request was submitted: the first one after an idle spell opens a new period."""
        now = time.perf_counter()
        with self._lock:
            if self._closed:
                self._start, self._closed = now, False
                self._period = {name: 0 for name in _SUMS} | {
                    "last_arrival_at": 0.0, "all_admitted_at": None, "first_decode_at": None, "idle_at": None,
                    "last_reply_at": None, "peak_rows": 0, "steps_below_peak": 0}
            self._period["requests"] += 1
            self._period["last_arrival_at"] = now - self._start

    def prefilled(self, rows: int, seconds: float, waiting: int) -> None:
        period = self._period
        if period is None:
            return
        period["prefills"] += 1
        period["prefill_rows"] += rows
        period["prefill_s"] += seconds
        if waiting == 0:
            period["all_admitted_at"] = time.perf_counter() - self._start

    def decoded(self, rows: int, launch_s: float, sample_s: float, wait_s: float, record_s: float,
                total_s: float) -> None:
        period = self._period
        if period is None:
            return
        if period["first_decode_at"] is None:
            period["first_decode_at"] = time.perf_counter() - total_s - self._start
        period["decode_steps"] += 1
        period["decode_rows"] += rows
        if rows > period["peak_rows"]:  # steps before the peak count as below it from then on
            period["steps_below_peak"] = period["decode_steps"] - 1
            period["peak_rows"] = rows
        elif rows < period["peak_rows"]:
            period["steps_below_peak"] += 1
        for name, value in (("launch_s", launch_s), ("sample_s", sample_s), ("wait_s", wait_s),
                            ("record_s", record_s), ("decode_s", total_s)):
            period[name] += value

    def idle(self) -> None:
        """The model thread has nothing to run: the period ends (its replies may still follow)."""
        with self._lock:
            if not self._closed and self._period is not None:
                self._period["idle_at"] = time.perf_counter() - self._start
                self._closed = True

    def built(self, seconds: float) -> None:
        """Response dicts built (detokenized text, log-prob lists) in `seconds`."""
        with self._lock:
            if self._period is not None:
                self._period["build_s"] += seconds

    def replied(self, seconds: float) -> None:
        """One HTTP reply serialised to JSON in `seconds` and handed to the server."""
        now = time.perf_counter()
        with self._lock:
            period = self._period
            if period is None:
                return
            period["replies"] += 1
            period["json_s"] += seconds
            period["last_reply_at"] = now - self._start

    def snapshot(self) -> dict[str, Any] | None:
        """The period's record, with mean rows per decode step; None before the first request."""
        with self._lock:
            if self._period is None:
                return None
            period = dict(self._period)
        period["closed"] = self._closed
        period["mean_rows"] = period["decode_rows"] / period["decode_steps"] if period["decode_steps"] else 0.0
        return {k: round(v, 6) if isinstance(v, float) else v for k, v in period.items()}
