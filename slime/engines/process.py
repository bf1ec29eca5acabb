"""Server subprocesses that never outlive their owner: launch, health wait, process-group stop.

Every engine and router slime starts is a `ServerProcess`. It runs in its own session (so it and
every process it forks share one process group whose id is its PID), appends stdout and stderr to a
log file, and is stopped by signalling that whole group: SIGTERM, a grace period, then SIGKILL. A
SGLang server forks scheduler and detokenizer processes, so stopping only the parent PID would leak
GPU-holding children. Only groups this module created are ever signalled. An `atexit` hook stops any
server that is still running when the interpreter exits normally.
"""

from __future__ import annotations

import atexit
import contextlib
import logging
import os
import signal
import subprocess
import time
from collections import deque
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Self

import httpx

from slime.errors import EngineStartError

logger = logging.getLogger(__name__)

_LOG_TAIL_LINES = 40
_live: set[ServerProcess] = set()  # strong refs: a dropped, unstopped server is still stopped at exit


def local_host(host: str) -> str:
    """The address a server bound to `host` is reached at: 127.0.0.1 for a wildcard bind ("0.0.0.0", "")."""
    return "127.0.0.1" if host in ("0.0.0.0", "") else host


def server_url(host: str, port: int) -> str:
    """`http://host:port` of a server bound to `host` (see `local_host`; an IPv6 address in brackets)."""
    host = local_host(host)
    return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"


def _group_alive(pgid: int) -> bool:
    """Whether any non-zombie process is left in process group `pgid`."""
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # the group id was reused by someone else's processes: not ours any more
        return False
    proc = Path("/proc")
    if not proc.is_dir():
        return True
    for entry in proc.iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        # fields after the ")" that closes the command name: state ppid pgrp ...
        fields = stat[stat.rfind(")") + 2 :].split()
        if len(fields) > 2 and int(fields[2]) == pgid and fields[0] not in ("Z", "X"):
            return True
    return False


class ServerProcess:
    """One server command running in its own process group, logging to `log_path`.

    Use as a context manager (`with ServerProcess(cmd, log_path=p) as proc: proc.wait_healthy(url)`)
    or call `start()` / `stop()`; `stop()` is idempotent and kills every process of the group.
    """

    def __init__(self, cmd: Sequence[str], *, log_path: str | os.PathLike[str],
                 env: Mapping[str, str] | None = None, cwd: str | os.PathLike[str] | None = None,
                 name: str | None = None) -> None:
        if not cmd:
            raise ValueError("ServerProcess needs a non-empty command")
        self.cmd = [str(c) for c in cmd]
        self.log_path = Path(log_path)
        self.env = dict(env or {})
        self.cwd = cwd
        self.name = name or Path(self.cmd[0]).name
        self._popen: subprocess.Popen[bytes] | None = None

    # ------------------------------------------------------------------ lifecycle
    def start(self) -> Self:
        """Launch the command (once); stdout and stderr are appended to `log_path`."""
        if self._popen is not None:
            raise RuntimeError(f"{self.name} was already started (pid {self._popen.pid})")
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        env = {**os.environ, **self.env}
        with open(self.log_path, "ab") as log:
            log.write(f"\n==== {time.strftime('%Y-%m-%d %H:%M:%S')} start: {' '.join(self.cmd)}\n".encode())
            log.flush()
            self._popen = subprocess.Popen(
                self.cmd, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                env=env, cwd=self.cwd, start_new_session=True,
            )
        _live.add(self)
        logger.info("started %s (pid %d), log %s", self.name, self._popen.pid, self.log_path)
        return self

    def stop(self, timeout_s: float = 10.0) -> int | None:
        """SIGTERM the whole process group, wait up to `timeout_s`, then SIGKILL it. Idempotent.

        Returns the leader's exit code (None if it was never started).
        """
        if self._popen is None:
            return None
        pgid = self._popen.pid  # start_new_session: the leader's PID is the group id
        if self._popen.poll() is None or _group_alive(pgid):
            self._signal_group(pgid, signal.SIGTERM)
            if not self._wait_group(pgid, timeout_s):
                logger.warning("%s (pgid %d) still alive %.1f s after SIGTERM; sending SIGKILL",
                               self.name, pgid, timeout_s)
                self._signal_group(pgid, signal.SIGKILL)
                if not self._wait_group(pgid, 5.0):
                    logger.error("%s (pgid %d) survived SIGKILL", self.name, pgid)
        _live.discard(self)
        return self._popen.returncode

    def _signal_group(self, pgid: int, sig: signal.Signals) -> None:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(pgid, sig)

    def _wait_group(self, pgid: int, timeout_s: float) -> bool:
        """Reap the leader and wait until no process of the group is left; False on timeout."""
        assert self._popen is not None
        deadline = time.monotonic() + timeout_s
        while True:
            self._popen.poll()
            if self._popen.returncode is not None and not _group_alive(pgid):
                return True
            if time.monotonic() >= deadline:
                return False
            time.sleep(0.05)

    def __enter__(self) -> Self:
        if self._popen is None:
            self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # ------------------------------------------------------------------ state
    @property
    def pid(self) -> int | None:
        """PID of the launched command (also its process-group id), None before `start()`."""
        return None if self._popen is None else self._popen.pid

    @property
    def alive(self) -> bool:
        """Whether the launched command is still running."""
        return self._popen is not None and self._popen.poll() is None

    @property
    def returncode(self) -> int | None:
        """Exit code once the command has exited, else None."""
        return None if self._popen is None else self._popen.poll()

    def log_tail(self, lines: int = _LOG_TAIL_LINES) -> str:
        """The last `lines` lines of the log file ('' if there is none yet)."""
        try:
            with open(self.log_path, encoding="utf-8", errors="replace") as f:
                return "".join(deque(f, maxlen=lines))
        except FileNotFoundError:
            return ""

    # ------------------------------------------------------------------ readiness
    def wait_healthy(self, url: str, timeout_s: float = 60.0, interval_s: float = 0.25) -> None:
        """Poll `GET url` until it answers 200.

        Raises EngineStartError, with the last log lines, as soon as the process exits or when
        `timeout_s` passes. The process is left running on timeout; stop it (or leave the `with`).
        """
        if self._popen is None:
            raise RuntimeError(f"{self.name} has not been started")
        deadline = time.monotonic() + timeout_s
        last = "no answer yet"
        probe_timeout = max(1.0, min(5.0, timeout_s))
        with httpx.Client(timeout=probe_timeout, trust_env=False) as http:
            while True:
                code = self._popen.poll()
                if code is not None:
                    raise EngineStartError(
                        f"{self.name} (pid {self._popen.pid}) exited with code {code} before {url} "
                        f"answered 200.\ncommand: {' '.join(self.cmd)}\n"
                        f"last lines of {self.log_path}:\n{self.log_tail()}")
                try:
                    response = http.get(url)
                    if response.status_code == 200:
                        logger.info("%s is healthy at %s", self.name, url)
                        return
                    last = f"HTTP {response.status_code}: {response.text[:200]}"
                except httpx.HTTPError as exc:
                    last = f"{type(exc).__name__}: {exc}"
                if time.monotonic() >= deadline:
                    raise EngineStartError(
                        f"{self.name} (pid {self._popen.pid}) did not answer 200 at {url} within "
                        f"{timeout_s:.0f} s (last: {last}).\ncommand: {' '.join(self.cmd)}\n"
                        f"last lines of {self.log_path}:\n{self.log_tail()}")
                time.sleep(min(interval_s, max(0.0, deadline - time.monotonic())))

    def __repr__(self) -> str:
        state = "not started" if self._popen is None else ("alive" if self.alive else f"exited {self.returncode}")
        return f"ServerProcess({self.name!r}, pid={self.pid}, {state}, log={str(self.log_path)!r})"


def start_server(cmd: Sequence[str], *, log_path: str | os.PathLike[str], health_url: str, timeout_s: float,
                 interval_s: float = 0.25, env: Mapping[str, str] | None = None,
                 name: str | None = None) -> ServerProcess:
    """Launch `cmd` as a `ServerProcess` and wait until `GET health_url` answers 200.

    A server that exits first or does not answer within `timeout_s` is stopped (its whole group)
    before the EngineStartError propagates, so a failed start leaves nothing running.
    """
    process = ServerProcess(cmd, log_path=log_path, env=env, name=name).start()
    try:
        process.wait_healthy(health_url, timeout_s=timeout_s, interval_s=interval_s)
    except BaseException:
        process.stop()
        raise
    return process


@atexit.register
def _stop_all() -> None:
    """Stop every server still running at interpreter exit (normal exit only)."""
    for proc in list(_live):
        with contextlib.suppress(Exception):
            proc.stop(timeout_s=5.0)
