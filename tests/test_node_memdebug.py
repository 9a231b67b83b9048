"""node/memdebug.py: nothing without the variable; with it, SIGUSR2 appends a report that names the
allocation site that grew."""
from __future__ import annotations

import json
import os
import signal
import tracemalloc

import pytest

from flowedge.node import memdebug


@pytest.fixture
def restore_sigusr2():
    old = signal.getsignal(signal.SIGUSR2)
    yield
    signal.signal(signal.SIGUSR2, old)
    tracemalloc.stop()


def test_without_the_variable_nothing_is_installed(restore_sigusr2):
    assert memdebug.install({}) is None
    assert not tracemalloc.is_tracing()


def test_sigusr2_reports_the_site_that_grew(tmp_path, restore_sigusr2):
    out = tmp_path / "mem.jsonl"
    assert memdebug.install({memdebug.ENV: str(out)}) is not None
    os.kill(os.getpid(), signal.SIGUSR2)   # the baseline
    hoard = [list(range(250)) for _ in range(5000)]   # ~10 MB of lists held at this line
    os.kill(os.getpid(), signal.SIGUSR2)
    first, second = [json.loads(line) for line in out.read_text().splitlines()]
    assert first["rss_mb"] > 0 and first["pid"] == os.getpid()
    top = second["grew"][0]
    assert "test_node_memdebug.py" in top["site"] and top["kb"] > 4000, second["grew"][:3]
    assert second["objects"]["list"] - first["objects"]["list"] >= 4500 and len(hoard) == 5000


@pytest.mark.skipif(memdebug.heap_figures() is None, reason="not glibc >= 2.33")
def test_heap_only_reports_glibc_in_use_growth_without_tracing(tmp_path, restore_sigusr2):
    """FLOWEDGE_MEMDEBUG_PYTHON=0: no tracemalloc (the soak's hour-long mode), and live native allocations
    show in `in_use_mb`, apart from memory freed but kept."""
    import ctypes

    out = tmp_path / "mem.jsonl"
    assert memdebug.install({memdebug.ENV: str(out), memdebug.PYTHON_ENV: "0"}) is not None
    assert not tracemalloc.is_tracing()
    libc = ctypes.CDLL("libc.so.6")
    libc.malloc.restype = ctypes.c_void_p
    os.kill(os.getpid(), signal.SIGUSR2)
    blocks = [libc.malloc(1000) for _ in range(20_000)]   # ~20 MB live, in the arena (not mmapped)
    os.kill(os.getpid(), signal.SIGUSR2)
    for b in blocks:
        libc.free(ctypes.c_void_p(b))
    first, second = [json.loads(line) for line in out.read_text().splitlines()]
    assert second["grew"] == [] and second["traced_mb"] is None
    assert second["heap"]["in_use_mb"] - first["heap"]["in_use_mb"] > 15, (first["heap"], second["heap"])
