"""ServerProcess with real children: health wait, log capture, process-group stop, start failures."""

import os
import sys
import time
from pathlib import Path

import pytest
from proc_checks import port_free, running

from slime.config.engine_flags import flags_to_argv
from slime.engines.process import ServerProcess, server_url, start_server
from slime.errors import EngineStartError
from slime.net import find_free_port

pytestmark = pytest.mark.timeout(60)






def _wait_for_file(path: Path, timeout_s: float = 10.0) -> str:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if path.exists() and path.read_text().strip():
            return path.read_text().strip()
        time.sleep(0.02)
    raise AssertionError(f"{path} was not written")


def test_find_free_port_is_bindable():
    port = find_free_port()
    assert 1024 <= port <= 65535
    assert port_free(port)


def test_http_server_healthy_logged_and_stopped(tmp_path):
    port = find_free_port()
    log = tmp_path / "logs" / "http.log"
    cmd = [sys.executable, "-u", "-m", "http.server", "--bind", "127.0.0.1", str(port)]
    with ServerProcess(cmd, log_path=log, cwd=tmp_path, name="http.server") as proc:
        assert proc.alive and proc.pid is not None
        proc.wait_healthy(f"http://127.0.0.1:{port}/", timeout_s=20, interval_s=0.05)
        assert not port_free(port)
        pid = proc.pid
    assert not proc.alive and not running(pid)
    assert port_free(port)
    text = log.read_text()
    assert "start: " in text and "http.server" in text  # the command line header
    assert '"GET / HTTP/1.1" 200' in text  # the child's own stderr went to the log
    assert proc.stop() == proc.returncode  # idempotent


def test_stop_kills_grandchild(tmp_path):
    pidfile = tmp_path / "grandchild.pid"
    proc = ServerProcess(["sh", "-c", f"sleep 300 & echo $! > {pidfile}; wait"], log_path=tmp_path / "sh.log")
    proc.start()
    grandchild = int(_wait_for_file(pidfile))
    assert running(grandchild) and grandchild != proc.pid
    assert os.getpgid(grandchild) == proc.pid  # same (new) process group as the leader
    proc.stop(timeout_s=5)
    assert not proc.alive
    assert not running(grandchild)


def test_stop_kills_orphans_after_leader_exited(tmp_path):
    """The leader exits at once and leaves a child behind in its group: stop() still kills it."""
    pidfile = tmp_path / "orphan.pid"
    proc = ServerProcess(["sh", "-c", f"sleep 300 & echo $! > {pidfile}"], log_path=tmp_path / "sh.log").start()
    orphan = int(_wait_for_file(pidfile))
    deadline = time.monotonic() + 5
    while proc.alive and time.monotonic() < deadline:
        time.sleep(0.02)
    assert not proc.alive and running(orphan)
    proc.stop(timeout_s=5)
    assert not running(orphan)


def test_sigterm_ignored_escalates_to_sigkill(tmp_path):
    pidfile = tmp_path / "stubborn.pid"
    script = f"trap '' TERM; sleep 300 & echo $! > {pidfile}; wait"
    proc = ServerProcess(["sh", "-c", script], log_path=tmp_path / "sh.log").start()
    child = int(_wait_for_file(pidfile))
    start = time.monotonic()
    proc.stop(timeout_s=0.5)
    elapsed = time.monotonic() - start
    assert elapsed >= 0.5  # it waited for the grace period first
    assert not proc.alive and not running(child)
    assert proc.returncode == -9


def test_early_exit_raises_with_log_tail(tmp_path):
    code = "import sys; [print('noise', i) for i in range(100)]; print('fatal: no such model /x'); sys.exit(3)"
    proc = ServerProcess([sys.executable, "-c", code], log_path=tmp_path / "bad.log", name="bad-engine")
    with proc, pytest.raises(EngineStartError) as err:
        proc.wait_healthy(f"http://127.0.0.1:{find_free_port()}/health", timeout_s=30)
    msg = str(err.value)
    assert "bad-engine" in msg and "code 3" in msg
    assert "fatal: no such model /x" in msg
    assert "noise 59" not in msg and "noise 99" in msg  # only the tail (40 lines), not the whole log


def test_timeout_raises_and_names_url(tmp_path):
    port = find_free_port()
    url = f"http://127.0.0.1:{port}/health"
    with ServerProcess([sys.executable, "-c", "import time; time.sleep(60)"], log_path=tmp_path / "s.log") as proc:
        start = time.monotonic()
        with pytest.raises(EngineStartError, match="did not answer 200") as err:
            proc.wait_healthy(url, timeout_s=1.0, interval_s=0.1)
        assert 1.0 <= time.monotonic() - start < 5
        assert url in str(err.value)
        assert proc.alive  # the caller decides; leaving the with-block stops it
    assert not proc.alive


def test_env_override_reaches_child(tmp_path):
    out = tmp_path / "env.txt"
    code = f"import os; open({str(out)!r}, 'w').write(os.environ['SLIME_TEST_VAR'])"
    proc = ServerProcess([sys.executable, "-c", code], log_path=tmp_path / "e.log", env={"SLIME_TEST_VAR": "v42"})
    with proc:
        assert _wait_for_file(out) == "v42"


def test_not_started_and_double_start(tmp_path):
    proc = ServerProcess(["sleep", "30"], log_path=tmp_path / "x.log")
    assert proc.pid is None and not proc.alive and proc.stop() is None
    with pytest.raises(RuntimeError, match="not been started"):
        proc.wait_healthy("http://127.0.0.1:1/", timeout_s=0.1)
    with proc, pytest.raises(RuntimeError, match="already started"):
        proc.start()
    assert not proc.alive


def test_start_server_returns_the_healthy_server(tmp_path):
    port = find_free_port()
    cmd = [sys.executable, "-u", "-m", "http.server", "--bind", "127.0.0.1", str(port)]
    proc = start_server(cmd, log_path=tmp_path / "h.log", health_url=f"http://127.0.0.1:{port}/", timeout_s=20,
                        interval_s=0.05, name="http.server")
    try:
        assert proc.alive and proc.name == "http.server" and not port_free(port)
        assert '"GET / HTTP/1.1" 200' in proc.log_tail()  # it returned after a 200, not before
    finally:
        proc.stop()
    assert port_free(port)


def test_start_server_stops_the_whole_group_when_never_healthy(tmp_path):
    """A server that never answers: start_server raises and leaves no process of its group behind."""
    pidfile = tmp_path / "child.pid"
    cmd = ["sh", "-c", f"sleep 300 & echo $! > {pidfile}; wait"]
    url = f"http://127.0.0.1:{find_free_port()}/health"
    with pytest.raises(EngineStartError, match="did not answer 200") as err:
        start_server(cmd, log_path=tmp_path / "s.log", health_url=url, timeout_s=1.0, interval_s=0.1, name="mute")
    assert "mute" in str(err.value) and url in str(err.value)
    assert not running(int(_wait_for_file(pidfile)))


@pytest.mark.parametrize(("host", "url"), [("127.0.0.1", "http://127.0.0.1:8000"), ("0.0.0.0", "http://127.0.0.1:8000"),
                                           ("", "http://127.0.0.1:8000"), ("::1", "http://[::1]:8000"),
                                           ("10.1.2.3", "http://10.1.2.3:8000")])
def test_server_url(host, url):
    assert server_url(host, 8000) == url


def test_flags_to_argv():
    argv = flags_to_argv({"a_b": 1, "flag": True, "off": False, "none": None, "many": [1, "x"],
                          "obj": {"k": 1}, "dashed-key": "v"})
    assert argv == ["--a-b", "1", "--flag", "--many", "1", "x", "--obj", '{"k": 1}', "--dashed-key", "v"]


def test_unstopped_server_is_stopped_at_interpreter_exit(tmp_path):
    """A program that forgets stop(): the atexit hook still kills the whole group."""
    pidfile = tmp_path / "child.pid"
    script = (
        "from slime.engines.process import ServerProcess\n"
        f"p = ServerProcess(['sh', '-c', 'sleep 300 & echo $! > {pidfile}; wait'], log_path={str(tmp_path / 'a.log')!r})\n"
        "p.start()\n"
        "import time\n"
        f"while not open({str(pidfile)!r}, 'a+').tell(): time.sleep(0.02)\n"
        "print(p.pid, flush=True)\n"
        "del p\n"
    )
    import subprocess

    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=30, check=True)
    leader = int(out.stdout.strip())
    child = int(pidfile.read_text())
    assert not running(leader) and not running(child)
