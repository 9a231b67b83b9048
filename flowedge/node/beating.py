"""Long work on a worker thread while the node's own thread keeps heartbeating.

A node's liveness is its heartbeats (membership.py: 500 ms x 4 by default). A forward that takes longer
than that — a long prompt's prefill, four requests' draft trees on a slow CPU, repacking a W4A16 shard —
must not look like a dead node to its peers. So the work runs on one worker thread and the calling
thread, which owns the sockets, keeps sending heartbeats while it waits (torch releases the GIL inside
its kernels, so the heartbeats go out on time).

A bound stays: work that runs past `give_up_s` is taken for a hung node. The beats then stop, so the
peers drop the node and systemd's watchdog (fed by the same `beat`) restarts it: liveness must not
hide a node stuck in an endless loop.
"""
from __future__ import annotations

import logging
import time
from concurrent.futures import ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from typing import Callable, TypeVar

log = logging.getLogger(__name__)

T = TypeVar("T")


class BeatingWorker:
    """One worker thread (kept for the node's life: a thread per step would cost more than small steps)."""

    def __init__(self, name: str) -> None:
        self.name = name
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix=name)
        self.longest_s = 0.0   # the longest piece of work so far (status, logs)

    def run(self, work: Callable[[], T], beat: Callable[[], None], period_s: float,
            give_up_s: float | None = None) -> T:
        """`work()`'s result (or its exception), calling `beat()` every `period_s` while it runs, up to
        `give_up_s` of work (then the beats stop; the work is left to finish, if it ever does)."""
        t0 = time.monotonic()
        future = self._pool.submit(work)
        warned = False
        while True:
            try:
                result = future.result(timeout=period_s)
                break
            except FutureTimeout:
                if future.done():   # the work itself raised a TimeoutError
                    raise
                running_s = time.monotonic() - t0
                if give_up_s is None or running_s <= give_up_s:
                    beat()
                elif not warned:
                    warned = True
                    log.error("%s: one piece of work has run %.0f s (limit %.0f s): taken for hung, "
                              "heartbeats stop", self.name, running_s, give_up_s)
        self.longest_s = max(self.longest_s, time.monotonic() - t0)
        return result

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
