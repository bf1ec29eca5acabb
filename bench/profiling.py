"""What the benchmarks share to read a step the same way: one step under torch.profiler, printed as torch's table
(bench/train_step.py and bench/decode_step.py `--profile ROWS`), and an A/B of a switch interleaved step by step in
one process (bench/train_step.py and bench/host_cost.py `--ab NAME`), and one step's host (Python) time under cProfile
(bench/train_step.py `--host-profile ROWS`)."""

from __future__ import annotations

import cProfile
import io
import pstats
import statistics
import time
from collections.abc import Callable

import torch


def interleaved_ab(step: Callable[[], object], toggle: Callable[[bool], object], rounds: int, *,
                   clock: Callable[[], float] = time.perf_counter,
                   sync: Callable[[], object] = lambda: None) -> dict[str, float]:
    """Median seconds (`clock`) of `step()` with `toggle(True)` and with `toggle(False)`, alternating step by step,
    `rounds` steps each, in one process: a machine that drifts (clocks, a neighbour) moves both arms alike, where
    runs one after the other can differ by more than the change (docs/benchmarks.md, 2026-11-26 call 7). `sync`
    ends each timed step (a CUDA synchronize for GPU work); `toggle(True)` is left in place."""
    times: dict[bool, list[float]] = {True: [], False: []}
    for i in range(2 * rounds):
        on = i % 2 == 0
        toggle(on)
        sync()
        start = clock()
        step()
        sync()
        times[on].append(clock() - start)
    toggle(True)
    return {"on": statistics.median(times[True]), "off": statistics.median(times[False])}


def print_profile(step: Callable[[], object], rows: int, title: str = "profiled step") -> None:
    """One `step()` under torch.profiler: the device time of the whole step and its kernel count, then the `rows`
    operations with the most device self time (where a kernel is launched from, not what called it), as torch's
    table prints them. Kernels replayed from a CUDA graph are listed too (CUPTI traces a graph's kernels).
    Without CUDA (the tests) the same table of CPU time."""
    from torch.profiler import ProfilerActivity, profile

    cuda = torch.cuda.is_available()
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    sync()
    with profile(activities=[ProfilerActivity.CPU, *([ProfilerActivity.CUDA] if cuda else [])]) as prof:
        step()
        sync()
    events = prof.key_averages()
    key = "self_device_time_total" if cuda else "self_cpu_time_total"
    total = sum(getattr(e, key) for e in events) / 1e3
    device = torch.autograd.DeviceType.CUDA if cuda else torch.autograd.DeviceType.CPU
    kernels = sum(e.count for e in events if getattr(e, "device_type", device) == device) if cuda else \
        sum(e.count for e in events)
    print(f"{title}: {total:.2f} ms of {'GPU' if cuda else 'CPU'} time, {kernels} "
          f"{'kernels' if cuda else 'operations'}", flush=True)
    print(events.table(sort_by=key, row_limit=rows, max_name_column_width=70), flush=True)


def print_host_profile(step: Callable[[], object], rows: int, title: str = "host profile") -> None:
    """One `step()` under cProfile: the `rows` functions with the most own (tottime) host time, then by cumulative
    time. On a GPU a host-bound step's time is this: what Python and the dispatcher spend issuing kernels (the
    kernels run asynchronously; the closing synchronize shows up as the wait it is)."""
    sync = torch.cuda.synchronize if torch.cuda.is_available() else (lambda: None)
    sync()
    profiler = cProfile.Profile()
    start = time.perf_counter()
    profiler.enable()
    step()
    sync()
    profiler.disable()
    wall = time.perf_counter() - start
    for order in ("tottime", "cumulative"):
        out = io.StringIO()
        pstats.Stats(profiler, stream=out).sort_stats(order).print_stats(rows)
        print(f"{title} ({wall:.3f} s wall under cProfile), by {order}:\n{out.getvalue()}", flush=True)
