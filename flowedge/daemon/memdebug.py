"""Where a long-running node's memory goes: with FLOWEDGE_MEMDEBUG=<file> in its environment the node
traces Python allocations (tracemalloc) from the start, and each SIGUSR2 appends one JSON line to <file>:
RSS, the live objects per type and the allocation sites that grew most since the first snapshot. The soak
(tools/soak.py --memdebug) sends the signals; without the variable nothing is installed and nothing costs.
Python allocations only: what torch or glibc hold outside them shows as RSS growth the sites do not explain."""
from __future__ import annotations

import gc
import json
import logging
import os
import signal
import time
import tracemalloc
from collections import Counter

log = logging.getLogger(__name__)

ENV = "FLOWEDGE_MEMDEBUG"
TOP = 25


class MemDebug:
    def __init__(self, path: str) -> None:
        self.path = path
        self.first: tracemalloc.Snapshot | None = None

    def report(self) -> dict:
        """One line's figures; the first call also takes the baseline snapshot."""
        snap = tracemalloc.take_snapshot().filter_traces((tracemalloc.Filter(False, tracemalloc.__file__),))
        if self.first is None:
            self.first = snap
        grew = snap.compare_to(self.first, "lineno")[:TOP]
        types = Counter(type(o).__name__ for o in gc.get_objects())
        traced, peak = tracemalloc.get_traced_memory()
        return {"t": time.time(), "pid": os.getpid(), "rss_mb": round(_rss_bytes() / 2**20, 2),
                "traced_mb": round(traced / 2**20, 2), "traced_peak_mb": round(peak / 2**20, 2),
                "objects": dict(types.most_common(TOP)),
                "grew": [{"site": str(s.traceback[0]), "kb": round(s.size_diff / 1024, 1), "count": s.count_diff}
                         for s in grew]}

    def on_signal(self, signum, frame) -> None:
        try:
            line = json.dumps(self.report())
            with open(self.path, "a") as f:
                f.write(line + "\n")
        except Exception:   # a debugging aid must never take the node down
            log.exception("memdebug report failed")


def install(env: dict | None = None) -> MemDebug | None:
    """Start tracing and take SIGUSR2 when FLOWEDGE_MEMDEBUG names a file (main thread only)."""
    path = (os.environ if env is None else env).get(ENV)
    if not path:
        return None
    tracemalloc.start(1)
    hook = MemDebug(path)
    signal.signal(signal.SIGUSR2, hook.on_signal)
    log.warning("memdebug on: tracing allocations (slower); SIGUSR2 appends a report to %s", path)
    return hook


def _rss_bytes() -> int:
    with open(f"/proc/{os.getpid()}/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
