"""daemon/memdebug.py: nothing without the variable; with it, SIGUSR2 appends a report that names the
allocation site that grew."""
from __future__ import annotations

import json
import os
import signal
import tracemalloc

import pytest

from flowedge.daemon import memdebug


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
    assert "test_daemon_memdebug.py" in top["site"] and top["kb"] > 4000, second["grew"][:3]
    assert second["objects"]["list"] - first["objects"]["list"] >= 4500 and len(hoard) == 5000
