"""SIGTERM handling for the long-running entry points: SIGTERM becomes `SystemExit(143)` in the main
thread, so `finally` blocks and `atexit` hooks stop what the process started (engines, router, Ray, a
Prefect ephemeral API server), and `ray.init` is not allowed to replace that.

Why: `ray.init` installs its own SIGTERM handler (`sys.exit`) plus a C-level failure handler that
aborts the process (SIGABRT) right after; measured: `slime rl` left its engines behind, and
`python -m flows.pipeline` aborted mid-RL leaving the Prefect API server running.
"""

from __future__ import annotations

import contextlib
import signal
import threading
from collections.abc import Iterator
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
