"""glibc's heap, kept from creeping in a process that runs for months.

A node allocates and frees tensors of many sizes from several threads (torch's pool, ZeroMQ's I/O thread,
the kernels' scratch buffers). glibc gives each thread that contends a new arena (up to 8 per core) and
returns a freed page to the OS only when it sits at the top of its arena, so the resident size of a busy
head rose steadily (+17%/h over a 5-minute soak) while its Python allocations stayed flat. Two arenas and
a periodic `malloc_trim` (which also releases free pages inside every arena) keep it level, at the cost
of a millisecond or so per trim. Everything here is a no-op where the C library is not glibc.

Python's side: an engine (a draft tree, its view, its strategy) is a reference cycle, freed only by the
cyclic collector's full pass, which runs rarely in a process holding a loaded model's ~200k objects: the
head's heap rose ~30 MB a minute and fell back every few minutes (the tiny pair; a real pair's draft
caches are larger). `settle` freezes what a load left (the full pass then skips it: 115 ms -> ~0 on this
box), and the trimmer runs a full pass before every trim.
"""
from __future__ import annotations

import ctypes
import functools
import gc
import logging
import threading

log = logging.getLogger(__name__)

M_ARENA_MAX = -8          # mallopt parameter number (glibc's malloc.h)
DEFAULT_ARENAS = 2
DEFAULT_TRIM_EVERY_S = 30.0


@functools.cache   # looked up once, not at every trim
def _libc() -> ctypes.CDLL | None:
    try:
        libc = ctypes.CDLL("libc.so.6")
        libc.malloc_trim, libc.mallopt   # both exist only in glibc
        return libc
    except (OSError, AttributeError):
        return None


def limit_arenas(arenas: int = DEFAULT_ARENAS) -> bool:
    """Cap glibc's malloc arenas; call before the process starts its threads. True where it applied."""
    libc = _libc()
    return bool(libc and libc.mallopt(M_ARENA_MAX, arenas) == 1)


def trim_heap() -> None:
    """Hand freed heap pages back to the OS now (after a model load, and periodically)."""
    libc = _libc()
    if libc is not None:
        libc.malloc_trim(0)


def settle() -> None:
    """After a model load: collect, freeze the survivors out of the cyclic collector's passes, trim."""
    gc.collect()
    gc.freeze()
    trim_heap()


class HeapTrimmer:
    """A daemon thread that trims the heap every `every_s` until `stop` is set.

    A thread rather than a hook in the node's loop: the trim takes the arenas' locks itself, so it is safe
    beside any thread, and no event loop has to know about it."""

    def __init__(self, stop: threading.Event, every_s: float = DEFAULT_TRIM_EVERY_S) -> None:
        self.stop, self.every_s = stop, every_s
        self.trims = 0
        self.thread = threading.Thread(target=self._run, name="heap-trim", daemon=True)

    def start(self) -> "HeapTrimmer":
        self.thread.start()
        return self

    def _run(self) -> None:
        while not self.stop.wait(self.every_s):
            gc.collect()   # the cycles ended engines left, before their pages can be returned
            trim_heap()
            self.trims += 1
