"""The grading process: a per-call time limit that holds off the main thread, and a child that never
outlives its parent."""

from __future__ import annotations

import logging
import subprocess
import sys
import textwrap
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import psutil
import pytest

from slime.rollout.rewards import grading_process
from slime.rollout.rewards.grading_process import GradingProcessError, GradingTimeout, call_with_timeout
from slime.rollout.rewards.math_rm import math_reward, math_verify_reward


def _in_thread(fn):
    """fn() run on a worker thread (where SIGALRM cannot be used): its result or the exception it raised."""
    out = {}

    def run():
        try:
            out["value"] = fn()
        except BaseException as exc:
            out["error"] = exc

    thread = threading.Thread(target=run)
    thread.start()
    thread.join(timeout=60)
    assert not thread.is_alive()
    return out


def _child_pid() -> int:
    call_with_timeout("os.getpid", [])
    return call_with_timeout("os.getpid", [])


def test_a_late_call_is_stopped_on_a_worker_thread_and_the_next_call_gets_a_fresh_process():
    before = _child_pid()
    start = time.monotonic()
    out = _in_thread(lambda: call_with_timeout("time.sleep", [60], timeout_s=0.5))
    elapsed = time.monotonic() - start
    assert isinstance(out.get("error"), GradingTimeout), out
    assert "time.sleep took more than 0.5 s" in str(out["error"])
    assert elapsed < 10  # not the 60 s the call would have taken
    assert not psutil.pid_exists(before) or psutil.Process(before).status() == psutil.STATUS_ZOMBIE
    after = _child_pid()
    assert after != before and call_with_timeout("math.hypot", [3, 4]) == 5.0


def test_threads_take_turns_and_each_gets_its_own_answer():
    with ThreadPoolExecutor(8) as pool:
        results = list(pool.map(lambda n: call_with_timeout("math.factorial", [n]), range(40)))
    import math

    assert results == [math.factorial(n) for n in range(40)]


def test_a_raising_function_is_an_error_and_the_process_stays():
    pid = _child_pid()
    with pytest.raises(GradingProcessError, match="math.sqrt raised in the grading process: TypeError"):
        call_with_timeout("math.sqrt", ["x"])
    with pytest.raises(GradingProcessError, match="no attribute 'nope'"):
        call_with_timeout("math.nope", [])
    assert _child_pid() == pid


def test_an_answer_that_would_hang_math_verify_scores_0_in_time_on_a_worker_thread(monkeypatch, caplog):
    """9^{9^{9}} has 370 million digits: math-verify evaluates it when comparing, in C, where no signal
    reaches it (in-process it ran for minutes). The grading process is killed at the limit instead."""
    assert math_verify_reward(r"\boxed{12}", "12") == 1.0  # the process is up and math-verify warm
    monkeypatch.setattr(grading_process, "GRADE_TIMEOUT_S", 1.0)
    start = time.monotonic()
    with caplog.at_level(logging.WARNING):
        out = _in_thread(lambda: math_verify_reward(r"\boxed{9^{9^{9}}}", "1"))
    assert out == {"value": 0.0}
    assert time.monotonic() - start < 15
    assert "scored 0" in caplog.text and "took more than 1 s" in caplog.text
    monkeypatch.undo()
    assert math_verify_reward(r"\boxed{\frac{3}{4}}", "0.75") == 1.0  # a fresh process grades the next one
    assert math_reward(r"\boxed{9^{9^{9}}}", "1") == 0.0  # slime's sympy grader never tries such powers


def test_the_child_exits_when_its_parent_is_killed():
    parent = subprocess.Popen([sys.executable, "-c", textwrap.dedent("""
        import os, sys, time
        from slime.rollout.rewards.grading_process import call_with_timeout
        print(call_with_timeout("os.getpid", []), flush=True)
        time.sleep(600)
    """)], stdout=subprocess.PIPE, text=True)
    try:
        child = int(parent.stdout.readline())
        assert psutil.Process(child).ppid() == parent.pid
        parent.kill()  # no atexit hook runs
        parent.wait(timeout=30)
        deadline = time.monotonic() + 30
        while psutil.pid_exists(child) and psutil.Process(child).status() != psutil.STATUS_ZOMBIE:
            assert time.monotonic() < deadline, "the grading child outlived its parent"
            time.sleep(0.1)
    finally:
        if parent.poll() is None:
            parent.kill()


def test_the_pool_grades_in_parallel_up_to_its_size(monkeypatch):
    """Two children: two slow calls overlap, and eight callers share the two processes."""
    monkeypatch.setattr(grading_process, "_max_processes", grading_process._max_processes)
    grading_process.set_max_processes(2)
    with ThreadPoolExecutor(2) as pool:  # both children up (and warm) before timing
        list(pool.map(lambda _: call_with_timeout("time.sleep", [0.2]), range(2)))
    start = time.monotonic()
    with ThreadPoolExecutor(2) as pool:
        list(pool.map(lambda _: call_with_timeout("time.sleep", [1.0]), range(2)))
    assert time.monotonic() - start < 1.8  # in turn they would take 2 s
    with ThreadPoolExecutor(8) as pool:
        pids = set(pool.map(lambda _: call_with_timeout("os.getpid", []), range(40)))
    assert 1 <= len(pids) <= 2
    grading_process.set_max_processes(1)  # a smaller pool stops the extra child as it comes back
    assert len({call_with_timeout("os.getpid", []) for _ in range(4)}) == 1
    assert len(grading_process._started) == 1
