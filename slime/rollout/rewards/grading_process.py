"""Run a grading function with a time limit, from any thread: in a child process that is killed when late.

sympy (`simplify`, LaTeX parsing) can run for minutes on a hostile answer (`9^{9^{9}}`, a huge
polynomial). slime bounds nothing; math-verify bounds its work with SIGALRM, which only the main thread
of a process may set, and rewards here run in Prefect task threads, Ray actor threads and event loops.
A Python thread cannot be stopped from outside, so the work goes to one child process per parent
process (`python -c "from slime.rollout.rewards.grading_process import serve; serve()"`), spoken to in JSON lines over its stdin
and stdout: `{"fn": "pkg.mod.function", "args": [...]}` -> `{"result": ...}` or `{"error": "..."}`.
A call that is not answered within its limit kills the child (by its PID) and raises GradingTimeout;
the next call starts a fresh one (~0.5 s: Python, sympy, math-verify imports).

The child never outlives its parent: it exits at EOF on stdin (the parent closed the pipe or died)
and, should a grandchild hold the pipe open, when it finds itself re-parented. An `atexit` hook in
the parent stops it on a normal exit.
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


_lock = threading.Lock()
_child: _Child | None = None


def call_with_timeout(fn: str, args: list[Any], timeout_s: float | None = None) -> Any:
    """`fn(*args)` run in the grading child (`fn` a dotted path, `args` and result JSON values).

    Raises GradingTimeout after `timeout_s` (default GRADE_TIMEOUT_S; the child is killed and replaced
    on the next call), and GradingProcessError when `fn` raises or the child dies. Calls from several
    threads take turns.
    """
    global _child
    timeout_s = GRADE_TIMEOUT_S if timeout_s is None else timeout_s
    with _lock:
        # a forked copy of this process must not share its parent's child (their answers would mix)
        if _child is None or _child.owner != os.getpid() or _child.popen.poll() is not None:
            _child = _Child()
        try:
            return _child.call(fn, args, timeout_s)
        except GradingTimeout:
            _child.stop()
            _child = None
            raise
        except OSError as exc:  # a broken pipe: the child died between calls
            _child.stop()
            _child = None
            raise GradingProcessError(f"the grading process died: {exc}") from exc
        except GradingProcessError:
            if _child.popen.poll() is not None:  # it died; a grader that raised leaves it running
                _child.stop()
                _child = None
            raise


@atexit.register
def stop_grading_process() -> None:
    """Stop the grading child, if one runs (also at interpreter exit)."""
    global _child
    with _lock:
        if _child is not None and _child.owner == os.getpid():
            _child.stop()
        _child = None


def _exit_when_orphaned(parent: int) -> None:
    while os.getppid() == parent:
        time.sleep(_PARENT_CHECK_S)
    os._exit(0)


def serve() -> None:
    """The child's loop: one JSON request per stdin line, one JSON answer per stdout line."""
    # answers go to the real stdout; anything a grader prints goes to stderr instead of into the protocol
    answers = os.fdopen(os.dup(sys.stdout.fileno()), "w")
    os.dup2(sys.stderr.fileno(), sys.stdout.fileno())
    from slime.plugins import load_function

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
