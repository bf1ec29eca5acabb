"""Run N ranks of a script as separate processes (gloo over 127.0.0.1) and collect their JSON lines.

    rows = run_ranks(Path("my_rank_script.py"), world_size=2, args=["--steps", "3"])
    rows[r]  # the JSON objects rank r printed, one per stdout line that starts with "{"

Each rank runs `python SCRIPT ARGS...` with RANK, WORLD_SIZE and INIT_METHOD (tcp://127.0.0.1:PORT) in
its environment; `rank_env()` reads them back inside the script (rank 0 of 1 when they are absent).
On a timeout or a failed rank every rank still running is killed, with anything it started (each
rank leads its own process group), and the error carries each rank's stderr tail.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from slime.net import find_free_port

ROOT = Path(__file__).resolve().parents[3]


class RankFailure(RuntimeError):
    """A rank exited non-zero or the ranks ran past the timeout."""


def rank_env() -> tuple[int, int, str | None]:
    """(rank, world_size, init_method) of this process as `run_ranks` set them."""
    return int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1)), os.environ.get("INIT_METHOD")


def run_ranks(script: Path, world_size: int, args: list[str] | None = None, timeout: float = 600,
              env: dict[str, str] | None = None) -> list[list[dict[str, Any]]]:
    """Start `world_size` ranks of `script`, wait for all, return each rank's JSON lines."""
    init_method = f"tcp://127.0.0.1:{find_free_port()}"
    procs: list[subprocess.Popen] = []
    with contextlib.ExitStack() as files:
        logs = [(files.enter_context(tempfile.TemporaryFile("w+")), files.enter_context(tempfile.TemporaryFile("w+")))
                for _ in range(world_size)]
        try:
            for rank, (out, err) in enumerate(logs):
                rank_vars = {"RANK": str(rank), "WORLD_SIZE": str(world_size), "INIT_METHOD": init_method}
                procs.append(subprocess.Popen([sys.executable, str(script), *(args or [])], stdout=out, stderr=err,
                                              cwd=ROOT, env={**os.environ, **(env or {}), **rank_vars},
                                              start_new_session=True))
            _wait(procs, logs, time.monotonic() + timeout, timeout)
            rows = []
            for out, _ in logs:
                out.seek(0)
                rows.append([json.loads(line) for line in out.read().splitlines() if line.startswith("{")])
            return rows
        finally:
            for p in procs:
                if p.poll() is None:
                    _kill(p)


def _wait(procs: list[subprocess.Popen], logs: list[tuple[Any, Any]], deadline: float, timeout: float) -> None:
    while any(p.poll() is None for p in procs):
        if any(p.returncode not in (None, 0) for p in procs):
            raise RankFailure(_report("a rank failed", procs, logs))
        if time.monotonic() > deadline:
            raise RankFailure(_report(f"ranks still running after {timeout:.0f} s", procs, logs))
        time.sleep(0.2)
    if any(p.returncode for p in procs):
        raise RankFailure(_report("a rank failed", procs, logs))


def _kill(proc: subprocess.Popen) -> None:
    """Kill one rank and its process group (it leads it: start_new_session), then reap it."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait(timeout=30)


def _report(what: str, procs: list[subprocess.Popen], logs: list[tuple[Any, Any]]) -> str:
    parts = [what]
    for rank, (proc, (_, err)) in enumerate(zip(procs, logs, strict=True)):
        err.seek(0)
        parts.append(f"--- rank {rank} (exit {proc.poll()}) stderr tail:\n{err.read()[-3000:]}")
    return "\n".join(parts)
