"""Handing the heap's free pages back to the OS after each train call (glibc's `malloc_trim`).

A train rank allocates and frees hundreds of MB of host tensors per call (shards read from Arrow, the
step's arrays, on CPU the activations and gradients) from several threads (torch's intra-op pool, Ray's
and megatron's). glibc serves each thread from its own arena and returns an arena's free memory to the
OS only from the top of its heap, so freed chunks in the middle stay resident: over a 500-iteration soak
the train rank's RSS climbed 15% before levelling off (docs/benchmarks.md, "Soak"). `malloc_trim(0)`
walks every arena and releases the free pages wherever they lie (madvise), without moving live data,
so nothing the next call needs is lost and no allocator setting slows the step (`MALLOC_MMAP_THRESHOLD_`
did: every large tensor mapped and faulted in again, train step +50%).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import time
from collections.abc import Callable


@functools.cache
def _malloc_trim() -> Callable[[int], int] | None:
    """glibc's `malloc_trim`, or None where the C library has none (musl, macOS)."""
    name = ctypes.util.find_library("c")
    if name is None:
        return None
    try:
        libc = ctypes.CDLL(name)
        trim = libc.malloc_trim
    except (OSError, AttributeError):
        return None
    trim.argtypes = [ctypes.c_size_t]
    trim.restype = ctypes.c_int
    return trim


def trim_heap() -> float | None:
    """Release the heap's free pages to the OS; the seconds it took, or None where there is no
    `malloc_trim` (then nothing happens)."""
    trim = _malloc_trim()
    if trim is None:
        return None
    t0 = time.monotonic()
    trim(0)
    return time.monotonic() - t0
