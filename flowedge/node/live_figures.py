"""The head's live figures for `flowedge status`, `/metrics` and the dashboard: tokens a second as they
stream, and the head process's own CPU load. Each is read from one object that lives as long as the
head, so two readers at any moment see the same number. And the one fixed figure beside them: the
version of flowedge the head runs.
"""
from __future__ import annotations

import functools
import importlib.metadata
import time
from collections import deque
from collections.abc import Callable
from pathlib import Path

import psutil

RATE_WINDOW_S = 3.0     # tokens/s over the last few seconds: moves within a second, steady enough to read
LOAD_SAMPLE_S = 1.0     # the CPU load is measured over at least this long (a shorter span is mostly noise)


class TokenRate:
    """Tokens a second over the last `window_s`, counted as they stream (all requests together)."""

    def __init__(self, window_s: float = RATE_WINDOW_S) -> None:
        self.window_s = window_s
        self.events: deque[tuple[float, int]] = deque()   # (when, how many tokens)

    def add(self, tokens: int, now: float) -> None:
        self.events.append((now, tokens))
        self._forget(now)

    def per_s(self, now: float) -> float:
        """The rate now: tokens within the window over the window (0 once the stream has stopped). Reads
        only, so a status request never races the compute thread's `add`."""
        return round(sum(n for t, n in list(self.events) if now - t <= self.window_s) / self.window_s, 3)

    def _forget(self, now: float) -> None:
        while self.events and now - self.events[0][0] > self.window_s:
            self.events.popleft()


class CpuLoad:
    """This process's CPU use in cores (1.0 = one core busy), from one long-lived psutil.Process: its
    first `cpu_percent` reading is primed here, and every later one covers the time since the one before,
    never less than `sample_s` (readers in between get the last figure)."""

    def __init__(self, sample_s: float = LOAD_SAMPLE_S, clock: Callable[[], float] = time.monotonic,
                 process: psutil.Process | None = None) -> None:
        self.process = process or psutil.Process()
        self.sample_s, self.clock = sample_s, clock
        self.process.cpu_percent(None)   # primes the counter: the next reading covers the time from now
        self.sampled_s = clock()
        self.load = 0.0

    def read(self) -> float:
        now = self.clock()
        if now - self.sampled_s >= self.sample_s:
            self.load = round(self.process.cpu_percent(None) / 100, 3)
            self.sampled_s = now
        return self.load

    def rss_bytes(self) -> int:
        return self.process.memory_info().rss


@functools.cache
def flowedge_version() -> str:
    """This flowedge's version as installed (the head's status; the dashboard shows it)."""
    try:
        return importlib.metadata.version("flowedge")
    except importlib.metadata.PackageNotFoundError:
        return "unknown"


def model_created(model: str, started_unix: float) -> int:
    """When the served model was made, for /v1/models: its files' modification time when the model is
    a path here, else (a registry name) when this head started."""
    try:
        return int(Path(model).stat().st_mtime)
    except (OSError, ValueError):
        return int(started_unix)

