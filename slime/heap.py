"""Keeping a long-lived train rank's heap from creeping: glibc's mmap threshold pinned, free pages handed back.

A train rank allocates and frees hundreds of MB of host tensors per call (shards read from Arrow, the
step's arrays, on CPU the activations and gradients) from several threads (torch's intra-op pool, Ray's
and megatron's). glibc serves each thread from its own arena and returns an arena's free memory to the
OS only from the top of its heap, so freed chunks in the middle stay resident: over a 500-iteration soak
the train rank's RSS climbed 15% before levelling off (docs/benchmarks.md, "Soak"). `malloc_trim(0)`
walks every arena and releases the free pages wherever they lie (madvise), without moving live data,
so nothing the next call needs is lost.

The trim alone left a climb (x1.11 over a 150-iteration soak, x1.25 over 300) whose steps came with the
checkpoint saves: glibc's *dynamic* mmap threshold. A freed mmapped chunk raises the threshold to its size (up to
32 MiB), so after the first save had freed its multi-MB host copies, every later allocation below that size came
from the arenas instead of its own mapping, and the arenas fragmented. `pin_mmap_threshold` sets the threshold
once (which also turns the dynamic adjustment off): allocations of 4 MiB and more always get their own mapping,
returned whole when freed; smaller ones stay in the arenas, cheap to reuse. The same soak with it: flat (687 ->
706 MB over 150 iterations; docs/benchmarks.md "Soak"). 64 KiB, tried before, mapped every mid-size tensor and
made the train step 50% slower.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import time
from collections.abc import Callable

MMAP_THRESHOLD_BYTES = 4 << 20
_M_MMAP_THRESHOLD = -3  # mallopt's parameter number (glibc malloc.h)


@functools.cache
def _libc() -> ctypes.CDLL | None:
    """The C library, or None where there is none to load."""
    name = ctypes.util.find_library("c")
    if name is None:
        return None
    try:
        return ctypes.CDLL(name)
    except OSError:
        return None


def pin_mmap_threshold(nbytes: int = MMAP_THRESHOLD_BYTES) -> bool:
    """Fix glibc's mmap threshold at `nbytes` for this process (mallopt M_MMAP_THRESHOLD); False where the C
    library has no `mallopt` or refuses the value (nothing changes then)."""
    libc = _libc()
    mallopt = getattr(libc, "mallopt", None) if libc is not None else None
    if mallopt is None:
        return False
    mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    mallopt.restype = ctypes.c_int
    return mallopt(_M_MMAP_THRESHOLD, nbytes) == 1


@functools.cache
def _malloc_trim() -> Callable[[int], int] | None:
    """glibc's `malloc_trim`, or None where the C library has none (musl, macOS)."""
    trim = getattr(_libc(), "malloc_trim", None)
    if trim is None:
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
