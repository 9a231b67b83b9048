"""The heap of a long-running node: two arenas, trimmed periodically (glibc only)."""
from __future__ import annotations

import subprocess
import sys
import threading
import time

import pytest

from flowedge import allocator

glibc = pytest.mark.skipif(allocator._libc() is None, reason="not glibc")


@glibc
def test_freed_memory_returns_to_the_os_after_a_trim():
    """Freed small blocks stay resident in glibc's arenas until trimmed: the trim is what gives them back."""
    code = """
import ctypes, psutil
from flowedge.allocator import trim_heap
libc = ctypes.CDLL("libc.so.6"); libc.malloc.restype = ctypes.c_void_p
libc.mallopt(-1, 1 << 30)   # M_TRIM_THRESHOLD high: no automatic return, as in a fragmented heap
rss = lambda: psutil.Process().memory_info().rss
blocks = [libc.malloc(4000) for _ in range(100_000)]          # ~400 MB of small blocks
for b in blocks: ctypes.memset(b, 1, 4000)
keep = blocks[-1]
for b in blocks[:-1]: libc.free(ctypes.c_void_p(b))            # the last one pins the heap's top
before = rss(); trim_heap(); after = rss()
print(before - after)
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True)
    assert int(out.stdout) > 300e6, out   # before the trim the ~400 MB stayed resident


@glibc
def test_arenas_are_limited_in_a_fresh_process():
    code = "from flowedge.allocator import limit_arenas; print(limit_arenas(2))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True)
    assert out.stdout.strip() == "True"


@glibc
def test_the_trimmer_trims_until_stopped():
    stop = threading.Event()
    trimmer = allocator.HeapTrimmer(stop, every_s=0.02).start()
    deadline = time.monotonic() + 10
    while trimmer.trims < 3 and time.monotonic() < deadline:
        time.sleep(0.01)
    stop.set()
    trimmer.thread.join(timeout=5)
    assert trimmer.trims >= 3 and not trimmer.thread.is_alive()


def test_settle_freezes_what_a_load_left_so_a_full_collection_skips_it():
    code = """
import gc
from flowedge.allocator import settle
loaded = [{"w": [i]} for i in range(300_000)]       # a model's worth of Python objects
settle()
print(gc.get_freeze_count() >= 300_000, len(gc.get_objects(generation=2)) < 10_000)
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True)
    assert out.stdout.split() == ["True", "True"], out
