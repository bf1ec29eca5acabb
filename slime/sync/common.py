"""What every weight-sync mode shares: the error type, the result record, buckets, and calls to all
engines at once that name every engine that failed."""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from slime.engines.client import EngineClient
from slime.errors import EngineError, EngineHTTPError

NamedTensors = Iterable[tuple[str, torch.Tensor]]


class WeightSyncError(EngineError):
    """A weight sync failed. `failures` maps each engine URL that refused or could not be reached to
    the reason, `phase` says which step failed, and `state` what the engines are left in."""

    def __init__(self, message: str, *, phase: str, failures: dict[str, str] | None = None, state: str = "") -> None:
        detail = "".join(f"\n  {url}: {reason}" for url, reason in (failures or {}).items())
        super().__init__(f"weight sync failed in phase {phase!r}: {message}{detail}" + (f"\n{state}" if state else ""))
        self.phase = phase
        self.failures = dict(failures or {})
        self.state = state

    def __reduce__(self):  # keep the attributes across pickling (Ray, Prefect)
        return (_rebuild_error, (str(self), self.__dict__))


def _rebuild_error(message: str, attrs: dict[str, Any]) -> WeightSyncError:
    error = WeightSyncError.__new__(WeightSyncError)
    Exception.__init__(error, message)
    error.__dict__.update(attrs)
    return error


@dataclass
class SyncResult:
    """What one sync did: mode, version, sizes and seconds per phase (also the step's metrics)."""

    mode: str
    weight_version: str
    urls: list[str]
    bytes: int = 0
    tensors: int = 0
    buckets: int = 0
    skipped: int = 0  # delta modes: tensors left out because the engines already hold them
    seconds: dict[str, float] = field(default_factory=dict)

    def metrics(self) -> dict[str, float]:
        out = {f"sync/{name}_s": value for name, value in self.seconds.items()}
        out.update({"sync/bytes": float(self.bytes), "sync/buckets": float(self.buckets),
                    "sync/tensors": float(self.tensors), "sync/tensors_skipped": float(self.skipped)})
        if self.seconds.get("total"):
            out["sync/gb_per_s"] = self.bytes / 1e9 / self.seconds["total"]
        return out


class Timer:
    """Accumulates seconds per phase: `with timer("transfer"): ...`."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = {}

    def __call__(self, phase: str) -> _Phase:
        return _Phase(self, phase)


class _Phase:
    def __init__(self, timer: Timer, phase: str) -> None:
        self.timer, self.phase = timer, phase

    def __enter__(self) -> None:
        self.start = time.perf_counter()

    def __exit__(self, *exc: object) -> None:
        self.timer.seconds[self.phase] = self.timer.seconds.get(self.phase, 0.0) + time.perf_counter() - self.start


def nbytes(tensor: torch.Tensor) -> int:
    return tensor.numel() * tensor.element_size()


def buckets(named: NamedTensors, max_bytes: int) -> Iterator[list[tuple[str, torch.Tensor]]]:
    """Group (name, tensor) pairs in order into lists of at most `max_bytes` (a bigger tensor alone)."""
    bucket: list[tuple[str, torch.Tensor]] = []
    size = 0
    for name, tensor in named:
        if bucket and size + nbytes(tensor) > max_bytes:
            yield bucket
            bucket, size = [], 0
        bucket.append((name, tensor))
        size += nbytes(tensor)
    if bucket:
        yield bucket


def _reason(exc: BaseException) -> str:
    if isinstance(exc, EngineHTTPError) and exc.status is not None:
        return f"HTTP {exc.status}: {exc.body}"
    return f"{type(exc).__name__}: {exc}"


async def post_all(client: EngineClient, urls: Sequence[str], path: str, payloads: Sequence[Any] | Any, *,
                   phase: str, state: str, method: str = "POST") -> dict[str, Any]:
    """`method path` on every engine concurrently (one payload each, or one for all); all run to the end,
    then WeightSyncError names every engine that failed."""
    bodies = payloads if isinstance(payloads, list | tuple) else [payloads] * len(urls)
    results = await asyncio.gather(*(client.request(method, url + path, json=body)
                                     for url, body in zip(urls, bodies, strict=True)), return_exceptions=True)
    failures = {url: _reason(r) for url, r in zip(urls, results, strict=True) if isinstance(r, BaseException)}
    if failures:
        raise WeightSyncError(f"{method} {path} failed on {len(failures)}/{len(urls)} engine(s)", phase=phase,
                              failures=failures, state=state)
    return dict(zip(urls, results, strict=True))


def in_thread(fn: Callable[[], Any]) -> asyncio.Future:
    """Start blocking `fn` now on a daemon thread; await the returned future for its result. (A
    collective that may wait for a missing peer must not hold up interpreter exit the way the default
    executor would.)"""
    loop = asyncio.get_running_loop()
    future = loop.create_future()

    def settle(error: BaseException | None, value: Any = None) -> None:
        if not future.done():
            future.set_exception(error) if error is not None else future.set_result(value)

    def run() -> None:
        try:
            value, error = fn(), None
        except BaseException as exc:  # handed to the awaiting coroutine
            value, error = None, exc
        with contextlib.suppress(RuntimeError):  # the event loop is gone: nobody waits for this any more
            loop.call_soon_threadsafe(settle, error, value)

    threading.Thread(target=run, name="weight-sync", daemon=True).start()
    return future
