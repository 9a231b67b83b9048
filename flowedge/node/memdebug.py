"""Where a long-running node's memory goes: with FLOWEDGE_MEMDEBUG=<file> in its environment the node
traces Python allocations (tracemalloc) from the start, and each SIGUSR2 appends one JSON line to <file>:
RSS, the live objects per type and the allocation sites that grew most since the first snapshot. The soak
(tools/soak.py --memdebug) sends the signals; without the variable nothing is installed and nothing costs.
Each report also carries glibc's own count (`mallinfo2`): bytes in use vs. freed but kept, so RSS growth
outside Python reads as either live native allocations (a cache or a leak) or a fragmented heap.
FLOWEDGE_MEMDEBUG_PYTHON=0 skips tracemalloc (heap figures only): cheap enough for a long soak, where a
traced head on 2 cores answered HELLO late."""
from __future__ import annotations

import ctypes
import gc
import json
import logging
import os
import signal
import time
import tracemalloc
from collections import Counter
from collections.abc import Mapping

log = logging.getLogger(__name__)

ENV = "FLOWEDGE_MEMDEBUG"
PYTHON_ENV = "FLOWEDGE_MEMDEBUG_PYTHON"
TOP = 25


class _MallInfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in (
        "arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks", "keepcost")]


def heap_figures() -> dict | None:
    """glibc's heap in MB: `in_use` (live allocations, mmapped ones included), `free_kept` (freed, not yet
    returned to the OS), `arena` (the arenas' size); None where the C library is not glibc >= 2.33."""
    try:
        fn = ctypes.CDLL("libc.so.6").mallinfo2
    except (OSError, AttributeError):
        return None
    fn.restype = _MallInfo2
    m = fn()
    mb = lambda b: round(b / 2**20, 2)
    return {"in_use_mb": mb(m.uordblks + m.hblkhd), "free_kept_mb": mb(m.fordblks), "arena_mb": mb(m.arena),
            "mmapped_mb": mb(m.hblkhd)}


class MemDebug:
    def __init__(self, path: str) -> None:
        self.path = path
        self.first: tracemalloc.Snapshot | None = None

    def report(self) -> dict:
        """One line's figures; the first call also takes the baseline snapshot."""
        base = {"t": time.time(), "pid": os.getpid(), "rss_mb": round(_rss_bytes() / 2**20, 2),
                "heap": heap_figures()}
        if not tracemalloc.is_tracing():
            return {**base, "traced_mb": None, "traced_peak_mb": None, "objects": {}, "grew": []}
        snap = tracemalloc.take_snapshot().filter_traces((tracemalloc.Filter(False, tracemalloc.__file__),))
        if self.first is None:
            self.first = snap
        grew = snap.compare_to(self.first, "lineno")[:TOP]
        types = Counter(type(o).__name__ for o in gc.get_objects())
        traced, peak = tracemalloc.get_traced_memory()
        return {**base, "traced_mb": round(traced / 2**20, 2), "traced_peak_mb": round(peak / 2**20, 2),
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


def install(env: Mapping[str, str] | None = None) -> MemDebug | None:
    """Start tracing and take SIGUSR2 when FLOWEDGE_MEMDEBUG names a file (main thread only)."""
    if env is None:
        env = os.environ
    path = env.get(ENV)
    if not path:
        return None
    python = env.get(PYTHON_ENV, "1") != "0"
    if python:
        tracemalloc.start(1)
    hook = MemDebug(path)
    signal.signal(signal.SIGUSR2, hook.on_signal)
    log.warning("memdebug on (%s); SIGUSR2 appends a report to %s",
                "tracing Python allocations: slower" if python else "heap figures only", path)
    return hook


def _rss_bytes() -> int:
    with open(f"/proc/{os.getpid()}/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
