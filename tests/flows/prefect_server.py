"""A real `prefect server start` on 127.0.0.1 with a private PREFECT_HOME, for the slow tests that need
a server outliving one process (deployments, the UI in a browser). The ephemeral API of the
session harness (tests/flows/conftest.py) serves neither a worker nor a browser after the run."""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

from slime.net import find_free_port

ROOT = Path(__file__).resolve().parents[2]
PREFECT = shutil.which("prefect", path=str(Path(sys.executable).parent))


def stop(proc: subprocess.Popen) -> None:
    """SIGINT (what Prefect's server and worker shut down cleanly on), then SIGKILL; only our own PIDs."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=10)


def tail(path: Path, chars: int = 4000) -> str:
    """The end of a log file, for assertion messages ("" before it exists)."""
    return path.read_text(errors="replace")[-chars:] if path.exists() else ""


@dataclass
class PrefectServer:
    """A started server: its base URL, the environment that points clients at it, its process and log."""

    url: str
    env: dict[str, str]
    process: subprocess.Popen
    log: Path

    def api(self, path: str, body: dict[str, Any]) -> Any:
        """POST /api/<path> with offset 0 and limit 50 unless `body` says otherwise; the decoded JSON."""
        response = httpx.post(f"{self.url}/api/{path}", json={"offset": 0, "limit": 50, **body}, timeout=30)
        response.raise_for_status()
        return response.json()


def server_env(home: Path, port: int) -> dict[str, str]:
    """This process's environment plus a private PREFECT_HOME, no telemetry, and the server's API URL."""
    return {**os.environ, "PREFECT_HOME": str(home), "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
            "DO_NOT_TRACK": "1", "PREFECT_API_URL": f"http://127.0.0.1:{port}/api", "PWD": str(ROOT)}


def wait_healthy(server: PrefectServer, timeout_s: float = 180) -> None:
    """Poll /api/health until it answers 200 (about 50 s on the loaded CI machine)."""
    deadline = time.monotonic() + timeout_s
    while True:
        assert server.process.poll() is None, f"prefect server exited:\n{tail(server.log, 3000)}"
        with contextlib.suppress(httpx.HTTPError):
            if httpx.get(f"{server.url}/api/health", timeout=5).status_code == 200:
                return
        assert time.monotonic() < deadline, f"prefect server not healthy after {timeout_s:.0f} s:\n{tail(server.log)}"
        time.sleep(2)


@contextlib.contextmanager
def prefect_server(workdir: Path) -> Iterator[PrefectServer]:
    """`prefect server start` (SQLite under `workdir/prefect-home`, log `workdir/server.log`), healthy
    on entry, stopped by PID on exit."""
    port = find_free_port()
    log_path = workdir / "server.log"
    with open(log_path, "w") as log:
        process = subprocess.Popen([PREFECT, "server", "start", "--host", "127.0.0.1", "--port", str(port)],
                                   cwd=ROOT, env=server_env(workdir / "prefect-home", port), stdout=log,
                                   stderr=subprocess.STDOUT)
        server = PrefectServer(f"http://127.0.0.1:{port}", server_env(workdir / "prefect-home", port), process,
                               log_path)
        try:
            wait_healthy(server)
            yield server
        finally:
            stop(process)
