"""`python -m flows.serve [--port 4200]` (what `make serve` runs): a local Prefect server, every work pool
and deployment of prefect.yaml, and a worker of the local pool, until one Ctrl-C or SIGTERM.

1. `prefect server start --host 127.0.0.1 --port P` in its own session, log $PREFECT_HOME/prefect-server.log;
   wait for /api/health
2. the work pools of prefect.yaml's `definitions.work_pools` (process pools), each created when missing, and
   the `slime-gpu` task-tag concurrency limit (1: a scheduled eval waits while an RL iteration holds the GPUs)
3. `prefect deploy --all --no-prompt` from the project root
4. `prefect worker start --pool slime-local` in its own session, its output here; the other pools need
   their own worker where their work runs (the pool's description says where; docs/prefect-workers.md)
5. on SIGINT or SIGTERM: the worker is stopped (one SIGINT, about a second), then the server (SIGTERM to
   its process group, SIGKILL after a timeout). Only processes started here are signalled.

Why one signal now suffices where the old Makefile recipe needed Ctrl-C twice: Prefect 3.8.8's worker
(`setup_signal_handlers_worker`, prefect/utilities/processutils) answers its first SIGINT by putting back
the SIGINT handler Python had when the worker started and sending itself SIGINT again; its second SIGINT
is SIGKILL. A worker started with SIGINT ignored (a background job of a non-interactive shell, e.g.
`make serve &` in a script) gets SIG_IGN back, so its first SIGINT does nothing. This process handles
SIGINT itself, and a handled signal is reset to the default in a child at exec, so the worker always
starts with Python's own SIGINT handler and stops on the first one. The worker and the server are in
sessions of their own, so the terminal's Ctrl-C reaches this process only, which stops them in order;
the old recipe's shell died of that Ctrl-C without running its EXIT trap and left the server running.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import shutil
import signal
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import yaml
from prefect.client.orchestration import get_client
from prefect.client.schemas.actions import WorkPoolCreate
from prefect.exceptions import ObjectNotFound
from prefect.settings import PREFECT_API_URL, PREFECT_HOME, temporary_settings
from prefect.workers.process import ProcessWorker

from slime.engines.process import ServerProcess
from slime.errors import EngineStartError
from tasks.evaluate import GPU_TAG  # the eval task's tag, whose slot each RL iteration holds

ROOT = Path(__file__).resolve().parents[1]
PROJECT = ROOT / "prefect.yaml"
PREFECT = shutil.which("prefect", path=str(Path(sys.executable).parent)) or "prefect"
LOCAL_POOL = "slime-local"  # the pool whose worker runs here
HEALTH_TIMEOUT_S = 180  # /api/health answered after ~50 s on the loaded 2-core machine
WORKER_STOP_S = 20  # the worker exits ~1 s after SIGINT; SIGKILL after this
SERVER_STOP_S = 20  # the server (uvicorn) shuts down in ~3 s after SIGTERM; SIGKILL after this


class Stopped(Exception):
    """SIGINT or SIGTERM arrived: stop what was started, then exit with 128 + the signal number."""

    def __init__(self, signum: int) -> None:
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


_deferred: list[int] | None = None  # signals that arrived while a child was being started


def _on_signal(signum: int, frame: Any) -> None:
    # further signals are ignored: a second Ctrl-C must not cut the shutdown of the server short
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, signal.SIG_IGN)
    if _deferred is not None:
        _deferred.append(signum)
        return
    raise Stopped(signum)


@contextlib.contextmanager
def starting_child() -> Iterator[None]:
    """A signal during the block is raised after it, once the child's Popen is held (and will be stopped)."""
    global _deferred
    _deferred = []
    try:
        yield
    finally:
        pending, _deferred = _deferred, None
    if pending:
        raise Stopped(pending[0])


def work_pools(project: Path = PROJECT) -> dict[str, dict[str, Any]]:
    """prefect.yaml's `definitions.work_pools` by pool name (the pools the deployments name)."""
    pools = yaml.safe_load(project.read_text())["definitions"]["work_pools"]
    return {pool["name"]: pool for pool in pools.values()}


def deployments_by_pool(project: Path = PROJECT) -> dict[str, list[str]]:
    """Deployment names of prefect.yaml under the name of their work pool."""
    by_pool: dict[str, list[str]] = {}
    for deployment in yaml.safe_load(project.read_text())["deployments"]:
        by_pool.setdefault(deployment["work_pool"]["name"], []).append(deployment["name"])
    return by_pool


def check_port_free(port: int) -> None:
    """Refuse a port already taken: /api/health of another server there would pass for this one's."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        # as uvicorn binds: connections of a server stopped a moment ago (TIME_WAIT) do not count
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind(("127.0.0.1", port))
        except OSError as exc:
            raise SystemExit(f"error: 127.0.0.1:{port} is in use ({exc.strerror}); another Prefect server? "
                             "Stop it, or pick another port: make serve PORT=4300") from None


def create_pools(pools: dict[str, dict[str, Any]]) -> None:
    """Each pool as a process pool unless one of that name exists, and the `slime-gpu` tag limit of 1."""
    template = ProcessWorker.get_default_base_job_template()
    with get_client(sync_client=True) as client:
        for name, pool in pools.items():
            try:
                client.read_work_pool(name)
                print(f"work pool {name}: exists", flush=True)
            except ObjectNotFound:
                client.create_work_pool(WorkPoolCreate(name=name, type="process", base_job_template=template,
                                                       description=pool.get("description")))
                print(f"work pool {name}: created (process)", flush=True)
        try:
            client.read_concurrency_limit_by_tag(GPU_TAG)
        except ObjectNotFound:
            client.create_concurrency_limit(GPU_TAG, 1)
            print(f"task tag concurrency limit {GPU_TAG}: 1", flush=True)


def where_runs_go(pools: dict[str, dict[str, Any]], url: str) -> str:
    """Which worker serves each pool, the UI, and how to start a run."""
    by_pool = deployments_by_pool()
    lines = [f"\nPrefect UI: {url}   (API: PREFECT_API_URL={url}/api)", "work pools of prefect.yaml:"]
    for name, pool in pools.items():
        lines.append(f"  {name}: {pool.get('description')}. Deployments: {', '.join(by_pool.get(name, [])) or '-'}")
    lines += ["In another shell, from the project root:", f"  export PREFECT_API_URL={url}/api",
              "  .venv/bin/prefect deployment run 'post-training/tiny-cpu' --watch",
              "One Ctrl-C stops the worker, then the server.\n"]
    return "\n".join(lines)


def stop_worker(worker: subprocess.Popen[bytes]) -> None:
    """SIGINT (the worker stops polling and exits); SIGKILL to its process group after WORKER_STOP_S."""
    if worker.poll() is None:
        worker.send_signal(signal.SIGINT)
        try:
            worker.wait(WORKER_STOP_S)
        except subprocess.TimeoutExpired:
            print(f"worker (pid {worker.pid}) still running {WORKER_STOP_S} s after SIGINT: SIGKILL", flush=True)
            with contextlib.suppress(ProcessLookupError):
                os.killpg(worker.pid, signal.SIGKILL)  # its own session: the group is the worker's
            worker.wait()
    print(f"worker (pid {worker.pid}) stopped", flush=True)


def serve(port: int) -> int:
    """Steps 1-5 of the module docstring; returns the exit code."""
    url = f"http://127.0.0.1:{port}"
    pools = work_pools()
    if LOCAL_POOL not in pools:
        raise SystemExit(f"error: {PROJECT} defines no work pool {LOCAL_POOL} for this machine's worker")
    check_port_free(port)
    env = {**os.environ, "PREFECT_API_URL": f"{url}/api", "PWD": str(ROOT)}  # PWD: prefect.yaml's pull step
    log = Path(PREFECT_HOME.value()) / "prefect-server.log"
    server = ServerProcess([PREFECT, "server", "start", "--host", "127.0.0.1", "--port", str(port)],
                           log_path=log, env=env, cwd=ROOT, name="prefect server")
    worker: subprocess.Popen[bytes] | None = None
    try:
        with starting_child():
            server.start()
        print(f"prefect server (pid {server.pid}) starting on {url}, log {log}", flush=True)
        server.wait_healthy(f"{url}/api/health", timeout_s=HEALTH_TIMEOUT_S, interval_s=1.0)
        with temporary_settings(updates={PREFECT_API_URL: f"{url}/api"}):
            create_pools(pools)
        deployed = subprocess.run([PREFECT, "deploy", "--all", "--no-prompt"], cwd=ROOT, env=env)
        if deployed.returncode != 0:
            print(f"error: prefect deploy --all --no-prompt exited {deployed.returncode}", file=sys.stderr)
            return 1
        print(where_runs_go(pools, url), flush=True)
        with starting_child():
            worker = subprocess.Popen([PREFECT, "worker", "start", "--pool", LOCAL_POOL], cwd=ROOT, env=env,
                                      start_new_session=True)
        print(f"worker (pid {worker.pid}) serving work pool {LOCAL_POOL}", flush=True)
        code = worker.wait()
        print(f"error: the worker exited by itself ({code})", file=sys.stderr)
        return 1
    except Stopped as stop:
        print(f"\n{stop}: stopping the worker, then the server", flush=True)
        return 128 + stop.signum
    except EngineStartError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    finally:
        for sig in (signal.SIGINT, signal.SIGTERM):  # a signal during the shutdown changes nothing
            signal.signal(sig, signal.SIG_IGN)
        if worker is not None:
            stop_worker(worker)
        if server.pid is not None:
            server.stop(timeout_s=SERVER_STOP_S)
            print(f"prefect server (pid {server.pid}) stopped", flush=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m flows.serve", description=__doc__.split("\n\n")[0])
    parser.add_argument("--port", type=int, default=4200, help="the server's port on 127.0.0.1 (default 4200)")
    args = parser.parse_args(argv)
    for sig in (signal.SIGINT, signal.SIGTERM):  # before any child starts: see the module docstring
        signal.signal(sig, _on_signal)
    return serve(args.port)


if __name__ == "__main__":
    sys.exit(main())
