"""Run a grading function with a time limit, from any thread: in a child process that is killed when late.

sympy (`simplify`, LaTeX parsing) can run for minutes on a hostile answer (`9^{9^{9}}`, a huge
polynomial). slime bounds nothing; math-verify bounds its work with SIGALRM, which only the main thread
of a process may set, and rewards here run in Prefect task threads, Ray actor threads and event loops.
A Python thread cannot be stopped from outside, so the work goes to child processes
(`python -c "from slime.rollout.rewards.grading_process import serve; serve()"`), spoken to in JSON
lines over their stdin and stdout: `{"fn": "pkg.mod.function", "args": [...]}` -> `{"result": ...}` or
`{"error": "..."}`. A call takes an idle child of a small pool (`reward.grading_processes`, default half
the cores up to 8), so that the answers of a rollout, which often finish together, are graded in
parallel. A call that is not answered within its limit kills its child (by its PID) and raises
GradingTimeout; a later call starts a fresh one (~0.5 s: Python, sympy, math-verify imports).

A child never outlives its parent: it exits at EOF on stdin (the parent closed the pipe or died)
and, should a grandchild hold the pipe open, when it finds itself re-parented. An `atexit` hook in
the parent stops them on a normal exit.
"""

from __future__ import annotations

import atexit
import contextlib
import json
import logging
import os
import queue
import subprocess
import sys
import threading
import time
from typing import IO, Any

from slime.plugins import load_function

logger = logging.getLogger(__name__)

# How long one grading call (parse + compare of one answer) may take; math-verify's own default is 5 s.
GRADE_TIMEOUT_S = 5.0
# Starting the child and importing a grader's module (sympy, math-verify) is not part of any call's limit.
_LOAD_TIMEOUT_S = 120.0
_PARENT_CHECK_S = 1.0


class GradingTimeout(TimeoutError):
    """A grading call took longer than its limit; its child process was killed."""


class GradingProcessError(RuntimeError):
    """The grading child died or answered with an error (a bug in a grader, not a wrong answer)."""


class _Child:
    """One grading child process and the thread that reads its answers."""

    def __init__(self) -> None:
        self.popen = subprocess.Popen([sys.executable, "-c", f"from {__name__} import serve; serve()"],
                                      stdin=subprocess.PIPE,
                                      stdout=subprocess.PIPE, text=True, bufsize=1)
        self.answers: queue.Queue[str | None] = queue.Queue()
        self.loaded: set[str] = set()
        self.owner = os.getpid()
        threading.Thread(target=self._read, args=(self.popen.stdout,), daemon=True,
                         name=f"grading-reader-{self.popen.pid}").start()

    def _read(self, stream: IO[str]) -> None:
        for line in stream:
            self.answers.put(line)
        self.answers.put(None)  # EOF: the child is gone

    def call(self, fn: str, args: list[Any], timeout_s: float) -> Any:
        if fn not in self.loaded:  # import first, outside the call's limit
            self._ask({"load": fn}, fn, _LOAD_TIMEOUT_S)
            self.loaded.add(fn)
        return self._ask({"fn": fn, "args": args}, fn, timeout_s)

    def _ask(self, request: dict[str, Any], fn: str, timeout_s: float) -> Any:
        assert self.popen.stdin is not None
        self.popen.stdin.write(json.dumps(request) + "\n")
        self.popen.stdin.flush()
        try:
            line = self.answers.get(timeout=timeout_s)
        except queue.Empty:
            what = "starting it and importing" if "load" in request else "grading with"
            raise GradingTimeout(f"{what} {fn} took more than {timeout_s:g} s in grading process "
                                 f"{self.popen.pid}; it was killed") from None
        if line is None:
            raise GradingProcessError(f"the grading process (pid {self.popen.pid}) exited with "
                                      f"{self.popen.wait()} while grading with {fn}")
        answer = json.loads(line)
        if "error" in answer:
            raise GradingProcessError(f"{fn} raised in the grading process: {answer['error']}")
        return answer["result"]

    def stop(self) -> None:
        with contextlib.suppress(OSError):
            self.popen.kill()  # by PID: this process started it
        with contextlib.suppress(Exception):
            self.popen.wait(timeout=10)
        for stream in (self.popen.stdin, self.popen.stdout):
            with contextlib.suppress(OSError):
                stream.close()


def default_max_processes() -> int:
    """Half the machine's cores, 1 to 8: a rollout's samples often finish together (every response cut at
    the same length), and one child grading 256 answers one after another was seconds of the step."""
    return max(1, min(8, (os.cpu_count() or 2) // 2))


_available = threading.Condition()  # guards the pool below; waited on while every child is busy
_idle: list[_Child] = []  # children waiting for a call, the most recently used last
_started: set[_Child] = set()  # every child of this pool, idle or busy
_pool_pid = os.getpid()
_max_processes = default_max_processes()


def set_max_processes(n: int | None) -> None:
    """Size the pool (`reward.grading_processes`; None: `default_max_processes()`). Children beyond a
    smaller size are stopped as they come back idle."""
    global _max_processes
    with _available:
        _max_processes = default_max_processes() if n is None else max(1, int(n))
        _available.notify_all()


def _acquire() -> _Child:
    """An idle child, a new one while the pool has room, or the next one a caller gives back."""
    global _pool_pid
    with _available:
        if _pool_pid != os.getpid():  # a forked copy of this process: its parent's children are not ours
            _idle.clear()
            _started.clear()
            _pool_pid = os.getpid()
        while True:
            while _idle and len(_started) > _max_processes:  # the pool was made smaller
                extra = _idle.pop(0)
                _started.discard(extra)
                extra.stop()
            while _idle:
                child = _idle.pop()
                if child.popen.poll() is None:
                    return child
                _started.discard(child)  # died between calls
                child.stop()
            if len(_started) < _max_processes:
                break
            _available.wait()
    child = _Child()  # outside the lock: starting Python takes a while
    with _available:
        _started.add(child)
    return child


def _release(child: _Child, alive: bool) -> None:
    with _available:
        if alive and child in _started and len(_started) <= _max_processes:
            _idle.append(child)
        else:
            _started.discard(child)
            if alive:
                child.stop()
        _available.notify()


def call_with_timeout(fn: str, args: list[Any], timeout_s: float | None = None) -> Any:
    """`fn(*args)` run in a grading child (`fn` a dotted path, `args` and result JSON values).

    Raises GradingTimeout after `timeout_s` (default GRADE_TIMEOUT_S; that child is killed and replaced
    on a later call), and GradingProcessError when `fn` raises or the child dies. Calls from several
    threads run in parallel on up to `set_max_processes` children and wait for one beyond that.
    """
    timeout_s = GRADE_TIMEOUT_S if timeout_s is None else timeout_s
    child = _acquire()
    alive = True
    try:
        return child.call(fn, args, timeout_s)
    except GradingTimeout:
        alive = False
        raise
    except OSError as exc:  # a broken pipe: the child died between calls
        alive = False
        raise GradingProcessError(f"the grading process died: {exc}") from exc
    except GradingProcessError:
        alive = child.popen.poll() is None  # a grader that raised leaves it running
        raise
    finally:
        if not alive:
            child.stop()
        _release(child, alive)


@atexit.register
def stop_grading_process() -> None:
    """Stop every grading child of this process (also at interpreter exit)."""
    with _available:
        children = list(_started) if _pool_pid == os.getpid() else []
        _idle.clear()
        _started.clear()
    for child in children:
        child.stop()


def _exit_when_orphaned(parent: int) -> None:
    while os.getppid() == parent:
        time.sleep(_PARENT_CHECK_S)
    os._exit(0)


def serve() -> None:
    """The child's loop: one JSON request per stdin line, one JSON answer per stdout line."""
    # answers go to the real stdout; anything a grader prints goes to stderr instead of into the protocol
    answers = os.fdopen(os.dup(sys.stdout.fileno()), "w")
    os.dup2(sys.stderr.fileno(), sys.stdout.fileno())

    threading.Thread(target=_exit_when_orphaned, args=(os.getppid(),), daemon=True).start()
    for line in sys.stdin:
        request = json.loads(line)
        try:
            if "load" in request:
                load_function(request["load"])
                answer = {"result": None}
            else:
                answer = {"result": load_function(request["fn"])(*request["args"])}
        except Exception as exc:  # reported to the caller, which raises it there
            answer = {"error": f"{type(exc).__name__}: {exc}"}
        answers.write(json.dumps(answer) + "\n")
        answers.flush()
