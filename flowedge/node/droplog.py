"""Counting and logging what a node drops, without letting a noisy peer flood the log.

Every drop is counted under a short rule name (reported in heartbeat stats and `flowedge status`);
the first `burst` drops are logged in full, later ones are summarised once per `interval_s`.
"""
from __future__ import annotations

import logging
import time
from collections.abc import Callable


class DropLog:
    def __init__(self, logger: logging.Logger, burst: int = 10, interval_s: float = 60.0,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.logger = logger
        self.burst = burst
        self.interval_s = interval_s
        self.clock = clock
        self.counts: dict[str, int] = {}
        self._logged = 0
        self._suppressed = 0
        self._window_start_s = clock()

    def drop(self, rule: str, text: str, *, level: int = logging.WARNING, exc_info: bool = False) -> None:
        """Count one drop under `rule`; log it unless this window's burst is spent."""
        self.counts[rule] = self.counts.get(rule, 0) + 1
        now = self.clock()
        if now - self._window_start_s >= self.interval_s:
            self._flush(now)
        if self._logged < self.burst:
            self._logged += 1
            self.logger.log(level, "dropped (%s): %s", rule, text, exc_info=exc_info)
        else:
            self._suppressed += 1

    def tick(self) -> None:
        """Call from the poll loop: emits the summary of a window that has ended."""
        now = self.clock()
        if now - self._window_start_s >= self.interval_s:
            self._flush(now)

    def _flush(self, now: float) -> None:
        if self._suppressed:
            self.logger.warning("dropped %d more messages in the last %.0f s without logging them "
                                "(totals by rule: %s)", self._suppressed, now - self._window_start_s, self.counts)
        self._logged = self._suppressed = 0
        self._window_start_s = now

    def snapshot(self) -> dict[str, int]:
        return dict(self.counts)
