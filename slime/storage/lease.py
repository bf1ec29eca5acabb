"""One writer per run: a lease file `{store}/{run_id}/.lease.json` held while a process writes the run.

Two processes on one run id (two `slime rl`, two deployment runs, a scheduled eval beside training) would
otherwise move each other's outputs aside, resume each other's checkpoints or interleave metrics lines.
The lease names its holder (host, pid, since, command); a second writer is refused with that name.

* Created exclusively on any fsspec store: a hard link of a fully written file on a local filesystem, a
  conditional write (`pipe_file(mode="create")`, S3's `If-None-Match: *`) elsewhere.
* Renewed by a daemon thread every `ttl_s / 4` seconds. A lease is stale when its holder ran on this host
  and that process is gone, or when it was not renewed for `ttl_s` seconds (a holder on another host, or
  a hung one); a stale lease is taken over, with a warning naming the old holder.
* Re-entrant within a process: the pipeline flow holds it and each stage flow inside it takes it again.
* Evaluation has a lease of its own, `.lease-evaluate.json`: a scheduled eval of a run's newest checkpoint
  takes only that one, so it runs beside the run's training but never beside another eval (`hold_stage`).
* Released (deleted, if still ours) on exit from `hold_run`, also on errors and SIGTERM (slime.signals).

Takeover on an object store re-reads the lease just before deleting it; two processes taking over the
same stale lease at the same instant are then separated by the exclusive create.
"""

from __future__ import annotations

import contextlib
import datetime as dt
import json
import logging
import os
import socket
import sys
import threading
import time
import uuid
from collections.abc import Iterator
from typing import Any

import psutil

from slime.errors import RunInUseError
from slime.storage.fs import is_local, join_uri, open_fs

logger = logging.getLogger(__name__)

LEASE_NAME = ".lease.json"  # a leading dot: never a stage name
LEASE_TTL_S = 120.0

_held: dict[str, tuple[RunLease, int]] = {}  # lease URI -> (lease, depth) of this process
_held_lock = threading.Lock()


def _now() -> dt.datetime:
    return dt.datetime.now(dt.UTC)


def _pid_alive(pid: int) -> bool:
    """Whether process `pid` of this host runs (a zombie, killed but not yet reaped by its parent, does not)."""
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False
    except psutil.Error:  # someone else's process we may not inspect: it exists
        return True


def _command() -> str:
    """This process's command line, short: `slime rl --config x.yaml`, `python -m flows.pipeline ...`."""
    argv = list(sys.argv) or ["python"]
    program = os.path.basename(argv[0])
    if program == "__main__.py":  # python -m package
        program = f"python -m {os.path.basename(os.path.dirname(argv[0]))}"
    elif "/" in argv[0] and argv[0].endswith(".py"):  # python -m package.module, or a script
        program = f"python {program}"
    return " ".join([program, *argv[1:8]])[:200]


def describe_holder(holder: dict[str, Any]) -> str:
    return (f"{holder.get('command') or 'a process'} (host {holder.get('host')}, pid {holder.get('pid')}, "
            f"since {holder.get('since')})")


class RunLease:
    """The lease of one run directory (`run_uri`); `acquire()` then `release()`, or `hold_run`."""

    def __init__(self, run_uri: str, storage_options: dict[str, Any] | None = None, *,
                 ttl_s: float = LEASE_TTL_S, name: str = LEASE_NAME) -> None:
        self.run_uri = run_uri
        self.uri = join_uri(run_uri, name)
        self.storage_options = storage_options or {}
        self.ttl_s = ttl_s
        self.fs, self.path = open_fs(self.uri, self.storage_options)
        self.record = {"host": socket.gethostname(), "pid": os.getpid(), "since": _now().isoformat(),
                       "renewed_at": _now().isoformat(), "token": uuid.uuid4().hex, "command": _command()}
        self._stop = threading.Event()
        self._renewer: threading.Thread | None = None

    # ------------------------------------------------------------------------- acquire / release

    def acquire(self) -> None:
        """Take the lease, taking over a stale one; `RunInUseError` naming the holder when it is held."""
        self.fs.makedirs(self.path.rsplit("/", 1)[0], exist_ok=True)
        for _ in range(5):
            self.record["since"] = self.record["renewed_at"] = _now().isoformat()
            if self._create():
                self._start_renewing()
                return
            holder = self.read()
            if holder is None:  # released (or half-written) between our create and read: look again
                time.sleep(0.2)
                if (holder := self.read()) is None:
                    holder = {"token": None}
            reason = self.stale_reason(holder)
            if reason is None:
                raise self.in_use(holder)
            logger.warning("taking over the stale lease of run %s held by %s: %s", self.run_uri,
                           describe_holder(holder), reason)
            self._remove_if(holder.get("token"))
        raise RunInUseError(f"run {self.run_uri}: could not take its lease {self.uri} (other writers kept taking it)")

    def in_use(self, holder: dict[str, Any]) -> RunInUseError:
        """The error that refuses this writer, naming the lease's `holder`."""
        what = "run" if self.uri.endswith(f"/{LEASE_NAME}") else f"the {self.uri.rsplit('/', 1)[-1]} of run"
        return RunInUseError(
            f"{what} {self.run_uri} is in use by {describe_holder(holder)}: one writer per run. Wait for it "
            f"to finish or use another --run-id (lease {self.uri}; a lease whose process is gone, or that "
            f"was not renewed for {self.ttl_s:.0f} s, is taken over)")

    def release(self) -> None:
        """Stop renewing and delete the lease if it is still ours."""
        self._stop.set()
        if self._renewer is not None:
            self._renewer.join(timeout=5)
        self._remove_if(self.record["token"])

    def read(self) -> dict[str, Any] | None:
        """The lease as stored, None when there is none (or it is not complete JSON)."""
        try:
            holder = json.loads(self.fs.cat_file(self.path))
        except (FileNotFoundError, ValueError):
            return None
        return holder if isinstance(holder, dict) else None

    def stale_reason(self, holder: dict[str, Any]) -> str | None:
        """Why `holder` no longer holds the run (None: it does)."""
        if holder.get("token") is None:
            return "the lease file is unreadable"
        if holder.get("host") == socket.gethostname() and isinstance(holder.get("pid"), int):
            if not _pid_alive(holder["pid"]):
                return f"process {holder['pid']} is gone"
            held = _held.get(self.uri)
            if holder["pid"] == os.getpid() and (held is None or held[0].record["token"] != holder.get("token")):
                return "left by this process, which no longer holds it"
        try:
            age = (_now() - dt.datetime.fromisoformat(holder["renewed_at"])).total_seconds()
        except (KeyError, TypeError, ValueError):
            return "the lease has no renewal time"
        return f"not renewed for {age:.0f} s (limit {self.ttl_s:.0f} s)" if age > self.ttl_s else None

    # ------------------------------------------------------------------------- store operations

    def _blob(self) -> bytes:
        return json.dumps(self.record, indent=1, sort_keys=True).encode()

    def _create(self) -> bool:
        """Write the lease unless one exists (atomically: no reader sees a partial lease on a local disk)."""
        if is_local(self.fs):
            tmp = f"{self.path}.tmp-{self.record['token']}"
            with open(tmp, "wb") as f:
                f.write(self._blob())
            try:
                os.link(tmp, self.path)
            except FileExistsError:
                return False
            finally:
                os.unlink(tmp)
            return True
        try:
            self.fs.pipe_file(self.path, self._blob(), mode="create")
        except FileExistsError:
            return False
        return True

    def _remove_if(self, token: str | None) -> None:
        """Delete the lease if it still carries `token` (a lease file without one: if still unreadable)."""
        if is_local(self.fs):
            # move it aside atomically first, so that only one of several removers gets it; a lease that
            # turns out to be another one (taken in between) is put back
            aside = f"{self.path}.removing-{uuid.uuid4().hex}"
            try:
                os.rename(self.path, aside)
            except FileNotFoundError:
                return
            try:
                with open(aside, "rb") as f:
                    found = json.loads(f.read()).get("token")
            except (OSError, ValueError, AttributeError):
                found = None
            if found != token:
                with contextlib.suppress(FileExistsError):
                    os.link(aside, self.path)
            os.unlink(aside)
            return
        current = self.read()
        if (current or {}).get("token") == token:
            with contextlib.suppress(FileNotFoundError):
                self.fs.rm_file(self.path)

    def _renew(self) -> bool:
        """Write a new renewal time if the lease is still ours; False once another process holds it."""
        current = self.read()
        if (current or {}).get("token") != self.record["token"]:
            return False
        self.record["renewed_at"] = _now().isoformat()
        if is_local(self.fs):
            tmp = f"{self.path}.renew-{self.record['token']}"
            with open(tmp, "wb") as f:
                f.write(self._blob())
            os.replace(tmp, self.path)
        else:
            self.fs.pipe_file(self.path, self._blob())
        return True

    def _start_renewing(self) -> None:
        def renew() -> None:
            while not self._stop.wait(self.ttl_s / 4):
                try:
                    if not self._renew():
                        logger.error("the lease of run %s was taken over by another process while this one "
                                     "still runs: %s", self.run_uri, describe_holder(self.read() or {}))
                        return
                except Exception as exc:  # a store hiccup (OSError, a botocore error): the next renewal tries again
                    logger.warning("could not renew the lease of run %s: %s", self.run_uri, exc)

        self._stop.clear()
        self._renewer = threading.Thread(target=renew, name="slime-run-lease", daemon=True)
        self._renewer.start()


@contextlib.contextmanager
def hold_run_uri(run_uri: str, storage_options: dict[str, Any] | None = None, *,
                 ttl_s: float = LEASE_TTL_S, name: str = LEASE_NAME) -> Iterator[RunLease]:
    """Hold the lease `name` of `run_uri` for the block (re-entrant in one process)."""
    key = join_uri(run_uri, name)
    with _held_lock:
        lease, depth = _held.get(key, (None, 0))
        if lease is None:
            lease = RunLease(run_uri, storage_options, ttl_s=ttl_s, name=name)
            lease.acquire()
        _held[key] = (lease, depth + 1)
    try:
        yield lease
    finally:
        with _held_lock:
            lease, depth = _held[key]
            if depth == 1:
                del _held[key]
                lease.release()
            else:
                _held[key] = (lease, depth - 1)


@contextlib.contextmanager
def hold_run(config: Any, scope: str | None = None) -> Iterator[RunLease | None]:
    """Hold the lease of the config's run (`{run.store}/{run.run_id}`) for the block; nothing without a run id.
    `scope` names a lease of one part of the run instead (`.lease-<scope>.json`), see `hold_stage`."""
    from slime.storage import ArtifactStore

    if config.run.run_id is None:
        yield None
        return
    store = ArtifactStore.from_config(config)
    with hold_run_uri(store.uri(config.run.run_id), store.storage_options, name=_lease_name(scope)) as lease:
        yield lease


def _scopes(stage: str, watch: bool) -> list[str | None]:
    """The leases a writer of `stage` needs: the run's own (None) and, for evaluate, the evaluate lease too. A
    scheduled eval of a run's newest checkpoint (`watch`) needs only the latter: it writes under
    `{run}/evaluate/` beside the run's writer (training), never beside another eval."""
    return [*([] if watch and stage == "evaluate" else [None]), *(["evaluate"] if stage == "evaluate" else [])]


@contextlib.contextmanager
def hold_stage(config: Any, stage: str, *, watch: bool = False) -> Iterator[None]:
    """Hold the leases a writer of `stage` needs (`_scopes`) for the block."""
    with contextlib.ExitStack() as held:
        for scope in _scopes(stage, watch):
            held.enter_context(hold_run(config, scope=scope))
        yield


def check_free(config: Any, stage: str, *, watch: bool = False) -> None:
    """`RunInUseError` now if another live process holds a lease a writer of `stage` needs: an early refusal,
    before a command starts anything (the lease itself is taken when the writing starts)."""
    from slime.storage import ArtifactStore

    if config.run.run_id is None:
        return
    store = ArtifactStore.from_config(config)
    for scope in _scopes(stage, watch):
        lease = RunLease(store.uri(config.run.run_id), store.storage_options, name=_lease_name(scope))
        holder = lease.read()
        if holder is not None and lease.stale_reason(holder) is None:
            raise lease.in_use(holder)


def _lease_name(scope: str | None) -> str:
    return LEASE_NAME if scope is None else f".lease-{scope}.json"
