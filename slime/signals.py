"""SIGTERM handling for the long-running entry points: SIGTERM becomes `SystemExit(143)` in the main
thread, so `finally` blocks and `atexit` hooks stop what the process started (engines, router, Ray, a
Prefect ephemeral API server), and `ray.init` is not allowed to replace that.

Why: `ray.init` installs its own SIGTERM handler (`sys.exit`) plus a C-level failure handler that
aborts the process (SIGABRT) right after; measured: `slime rl` left its engines behind, and
`python -m flows.pipeline` aborted mid-RL leaving the Prefect API server running.
"""

from __future__ import annotations

import contextlib
import functools
import signal
import threading
from collections.abc import Callable, Iterator
from typing import Any


def _exit(signum: int, frame: Any) -> None:
    raise SystemExit(128 + signum)


@contextlib.contextmanager
def sigterm_as_exit() -> Iterator[None]:
    """Within the block SIGTERM raises `SystemExit(143)` in the main thread; the previous handler is
    restored after. Outside the main thread (handlers cannot be set there) nothing changes."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = signal.signal(signal.SIGTERM, _exit)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


@contextlib.contextmanager
def keep_sigterm_handler() -> Iterator[None]:
    """Put back, after the block, the SIGTERM handler that was installed before it (wrap `ray.init` in
    it): the caller's handler (`sigterm_as_exit`, Prefect's flow-engine bridge) stays in charge."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    before = signal.getsignal(signal.SIGTERM)
    try:
        yield
    finally:
        if before is not None:
            signal.signal(signal.SIGTERM, before)


def unwrap_signal_errors(fn: Callable[..., Any]) -> Callable[..., Any]:
    """Let a signal handler's exception out of `fn` as itself. Ray's Cython `CoreWorker.wait` reports an
    exception raised by a handler while it blocks (SIGTERM during a train step: `SystemExit`, or Prefect's
    `TerminationSignal`) as `SystemError("... returned a result with an exception set")`, the handler's
    exception as its cause; Prefect then records an ordinary failure and the process exits 1 instead of
    stopping as the handler asked (measured with `python -m flows.rl`)."""

    @functools.wraps(fn)
    def call(*args: Any, **kwargs: Any) -> Any:
        try:
            return fn(*args, **kwargs)
        except SystemError as exc:
            inner = exc.__cause__ or exc.__context__
            if isinstance(inner, BaseException) and not isinstance(inner, Exception):
                raise inner from exc
            raise

    return call
