"""slime/heap.py on this machine's glibc: the mmap threshold pinned (allocations at or above it get their own
mapping, returned whole when freed) and free heap pages handed back by malloc_trim."""

import subprocess
import sys
import textwrap

PROBE = textwrap.dedent("""
    import ctypes, ctypes.util, json, sys
    from slime.heap import MMAP_THRESHOLD_BYTES, pin_mmap_threshold, trim_heap

    libc = ctypes.CDLL(ctypes.util.find_library("c"))
    libc.malloc.restype = ctypes.c_void_p
    libc.free.argtypes = [ctypes.c_void_p]

    def rss():
        return int(open("/proc/self/statm").read().split()[1]) * 4096

    pinned = sys.argv[1] == "pin" and pin_mmap_threshold()
    # what a checkpoint save does: a big host copy, freed; glibc then raises its dynamic threshold to 24 MiB
    big = libc.malloc(24 << 20); ctypes.memset(big, 1, 24 << 20); libc.free(big)
    # then 8 MiB buffers, above the pinned threshold: with it each is its own mapping, gone when freed
    before = rss()
    blocks = [libc.malloc(8 << 20) for _ in range(12)]
    for b in blocks:
        ctypes.memset(b, 1, 8 << 20)
    keep = libc.malloc(1 << 20); ctypes.memset(keep, 1, 1 << 20)  # live, carved above them: the heap top stays
    for b in blocks:
        libc.free(b)
    left = rss() - before
    print(json.dumps({"pinned": pinned, "left_mb": left / 2**20, "trim_s": trim_heap(),
                      "threshold": MMAP_THRESHOLD_BYTES}))
""")


def _probe(mode: str) -> dict:
    import json

    out = subprocess.run([sys.executable, "-c", PROBE, mode], capture_output=True, text=True, check=True)
    return json.loads(out.stdout)


def test_a_pinned_threshold_returns_freed_large_buffers_at_once():
    pinned, dynamic = _probe("pin"), _probe("dynamic")
    assert pinned["pinned"] is True and pinned["threshold"] == 4 << 20
    assert pinned["left_mb"] < 8, pinned  # the 96 MiB went back to the OS with each free
    # without the pin the 24 MiB free raised glibc's threshold: the 8 MiB buffers came from the heap and stay
    assert dynamic["left_mb"] > 48, dynamic


def test_trim_reports_its_time():
    result = _probe("dynamic")
    assert result["trim_s"] is not None and 0 <= result["trim_s"] < 1
