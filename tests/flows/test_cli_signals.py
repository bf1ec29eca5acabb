"""`python -m flows.<stage>` stopped by a signal sent to its whole process group: the ephemeral Prefect API
server goes with it, and Prefect's client must not retry it for minutes (flows/_cli.py)."""

import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import psutil
import pytest
from prefect.client.base import PrefectHttpxSyncClient
from prefect.exceptions import TerminationSignal
from prefect.server.api.server import SubprocessASGIServer
from prefect.settings import (
    PREFECT_API_URL,
    PREFECT_CLIENT_MAX_RETRIES,
    PREFECT_SERVER_EPHEMERAL_ENABLED,
    temporary_settings,
)

from flows._cli import signal_behind, watch_ephemeral_api
from slime.backends.megatron.checkpoint import latest_checkpoint
from slime.config import load_config
from slime.storage import is_committed
from tasks.convert import convert

ROOT = Path(__file__).resolve().parents[2]
TINY_CPU = ROOT / "deployments" / "tiny-cpu.yaml"


def free_port() -> int:
    with contextlib.closing(socket.socket()) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.fixture
def stand_in_server(monkeypatch, tmp_path):
    """An HTTP server process on 127.0.0.1 registered as this process's (already started) ephemeral Prefect
    API server: what `SubprocessASGIServer()` returns, without Prefect's minute-long start."""
    port = free_port()
    process = subprocess.Popen([sys.executable, "-m", "http.server", "--bind", "127.0.0.1", str(port)],
                               cwd=tmp_path, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 30
        while True:
            with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), timeout=1):
                break
            assert time.monotonic() < deadline and process.poll() is None, "stand-in server did not start"
            time.sleep(0.1)
        monkeypatch.setattr(SubprocessASGIServer, "_instances", {})  # the test's own singleton
        server = SubprocessASGIServer()
        server.port, server.server_process, server.running = port, process, True
        yield server
    finally:
        process.kill()
        process.wait()


def test_prefect_stops_retrying_once_the_ephemeral_server_has_exited(stand_in_server):
    with temporary_settings(updates={PREFECT_SERVER_EPHEMERAL_ENABLED: True},
                            restore_defaults={PREFECT_API_URL}) as settings:
        watch_ephemeral_api(settings)
        assert PREFECT_CLIENT_MAX_RETRIES.value() == 5  # Prefect's default while the server lives
        with PrefectHttpxSyncClient(base_url=stand_in_server.address) as client:
            assert client.get("/").status_code == 200  # connected once: Prefect retries ConnectError from now on
            stand_in_server.server_process.terminate()
            deadline = time.monotonic() + 10
            while PREFECT_CLIENT_MAX_RETRIES.value() != 0:
                assert time.monotonic() < deadline, "retries still on after the server exited"
                time.sleep(0.05)
            start = time.monotonic()
            with pytest.raises(httpx.ConnectError):
                client.get("/")
            assert time.monotonic() - start < 2  # with retries: 2+4+8+16+32 s of back-off first


def test_a_server_of_prefect_api_url_keeps_its_retries(monkeypatch):
    monkeypatch.setattr(SubprocessASGIServer, "_instances", {})
    with temporary_settings(updates={PREFECT_API_URL: "http://127.0.0.1:9/api"}) as settings:
        watch_ephemeral_api(settings)  # it may restart: nothing started, nothing watched
        assert SubprocessASGIServer._instances == {} and settings.client.max_retries == 5


def raised_while_handling(signal_exc: BaseException) -> Exception:
    """An httpx.ConnectError raised as Prefect's crash report raises it: while handling `signal_exc`, from a
    refused connection, re-raised `from None` on the way as httpcore does."""
    try:
        try:
            raise signal_exc
        except BaseException:
            try:
                raise ConnectionRefusedError(111, "Connection refused")
            except OSError as refused:
                try:
                    raise httpx.ConnectError("[Errno 111] Connection refused") from refused
                except httpx.ConnectError as exc:
                    raise exc from None
    except httpx.ConnectError as exc:
        return exc


def test_the_signal_behind_an_api_error_is_found_in_its_context():
    assert signal_behind(raised_while_handling(TerminationSignal(signal.SIGTERM))) == signal.SIGTERM
    assert signal_behind(raised_while_handling(KeyboardInterrupt())) == signal.SIGINT
    assert signal_behind(raised_while_handling(ValueError("not a signal"))) is None


def descendants_alive(procs: list[psutil.Process]) -> list[str]:
    alive = []
    for proc in procs:
        with contextlib.suppress(psutil.Error):
            if proc.is_running() and proc.status() != psutil.STATUS_ZOMBIE:
                alive.append(f"{proc.pid} {' '.join(proc.cmdline())[:160]}")
    return alive


@pytest.mark.slow  # ~1 min: an ephemeral Prefect API server start, then SFT until its first checkpoint
def test_sigterm_to_the_process_group_stops_a_stage_flow_within_seconds(tiny_kit, tmp_path):
    """SIGTERM to the whole group (a shell, a supervisor) of `python -m flows.sft`, as it trains: its ephemeral
    API server dies at once; the flow exits 143 within 30 s (it retried the dead API ~150 s and exited 1)
    with nothing of the group left, its committed checkpoint intact and the run's lease released."""
    store = tmp_path / "store"
    overrides = ["--hf-checkpoint", str(tiny_kit.model_dir), "--sft-data", str(tiny_kit.sft), "--sft-num-epoch", "20",
                 "--global-batch-size", "8", "--micro-batch-size", "8", "--sft-save-interval", "2"]
    convert.fn(load_config(str(TINY_CPU), overrides), "s", {"hf_checkpoint": str(tiny_kit.model_dir)},
               str(store / "s" / "convert" / "checkpoint"))  # the flow starts from the run's convert checkpoint
    env = {k: v for k, v in os.environ.items() if k != "PREFECT_API_URL"}  # its own ephemeral API server
    env.update({"PREFECT_HOME": str(tmp_path / "prefect-home"), "PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS": "180"})
    log = tmp_path / "flow.log"
    save = str(store / "s" / "sft" / "checkpoint")
    started: list[psutil.Process] = []
    with open(log, "ab") as out:
        child = subprocess.Popen([sys.executable, "-m", "flows.sft", "--config", str(TINY_CPU), "--store", str(store),
                                  "--run-id", "s", *overrides], env=env, cwd=ROOT, stdout=out,
                                 stderr=subprocess.STDOUT, start_new_session=True)
    try:
        deadline = time.monotonic() + 600
        while latest_checkpoint(save) is None:  # the sft task is training
            assert child.poll() is None, log.read_text()[-3000:]
            assert time.monotonic() < deadline, "no SFT checkpoint in time"
            time.sleep(0.2)
        started = psutil.Process(child.pid).children(recursive=True)
        assert any("uvicorn" in " ".join(p.cmdline()) for p in started)  # the ephemeral API server
        committed = latest_checkpoint(save)
        before = log.stat().st_size
        os.killpg(child.pid, signal.SIGTERM)
        stopped = time.monotonic()
        try:
            code = child.wait(timeout=30)
        except subprocess.TimeoutExpired:
            pytest.fail(f"still running 30 s after SIGTERM:\n{log.read_text()[before:][-3000:]}")
        after = log.read_text()[before:]
        assert code == 128 + signal.SIGTERM, after[-3000:]
        print(f"exited {code} {time.monotonic() - stopped:.1f} s after SIGTERM to the group")
        assert "stopped by SIGTERM" in after and "Traceback" not in after, after[-3000:]
        deadline = time.monotonic() + 30
        while descendants_alive(started) and time.monotonic() < deadline:
            time.sleep(0.5)
        assert not descendants_alive(started)
    finally:
        if child.poll() is None:
            os.killpg(child.pid, signal.SIGKILL)
            child.wait()
        for proc in started:
            with contextlib.suppress(psutil.Error):
                proc.kill()
    assert is_committed(committed)  # what SFT committed before the signal stands
    assert not (store / "s" / ".lease.json").exists()  # released by the stage's finally
