"""Each link's round trip, timed by the heartbeats the head and its peers exchange anyway.

The head numbers each heartbeat round (`RttProbe.stamp`, on its monotonic clock); a peer keeps the latest
number it read and when (`Echo`), and its next heartbeat returns the number with the time it held it. The
head's round trip is then (now - sent) - held: each side reads only its own clock. It includes the time a
busy peer takes to read the ping (at most one step): what a message on that link really waits. A link's
figure is the median of its recent samples (`RttSamples`), so one late heartbeat does not move it.
"""
from __future__ import annotations

import statistics
import time
from collections import OrderedDict, deque
from dataclasses import dataclass, field
from typing import Callable

KEEP_PINGS = 64      # numbers the head still recognises: 32 s of heartbeats at 500 ms
KEEP_SAMPLES = 16    # round trips a link's median is taken over


class RttProbe:
    """Head side: numbers heartbeat rounds and turns a peer's echo into one round-trip sample."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self.clock = clock
        self.sent: OrderedDict[int, float] = OrderedDict()
        self.next = 1

    def stamp(self) -> int:
        """The number for the heartbeat round sent now."""
        n, self.next = self.next, self.next + 1
        self.sent[n] = self.clock()
        while len(self.sent) > KEEP_PINGS:
            self.sent.popitem(last=False)
        return n

    def sample_ms(self, echo: int | None, held_ms: float) -> float | None:
        """The round trip a peer's heartbeat shows (None: it echoed nothing, or a number not ours)."""
        sent = self.sent.get(echo) if echo is not None else None
        if sent is None:
            return None
        rtt_ms = (self.clock() - sent) * 1e3 - held_ms
        return rtt_ms if rtt_ms >= 0 else None


@dataclass
class RttSamples:
    """One link's recent round trips."""
    samples: deque = field(default_factory=lambda: deque(maxlen=KEEP_SAMPLES))

    def add(self, rtt_ms: float | None) -> None:
        if rtt_ms is not None:
            self.samples.append(rtt_ms)

    def median_ms(self) -> float | None:
        """The link's round trip in ms, to 0.01 ms (None: no sample yet, e.g. a peer older than 1.8)."""
        return round(statistics.median(self.samples), 2) if self.samples else None


@dataclass
class Echo:
    """Peer side: the latest heartbeat number read from the head, and when, for the next heartbeat."""
    clock: Callable[[], float] = time.monotonic
    ping: int | None = None
    read_at: float = 0.0

    def read(self, ping: int | None) -> None:
        if ping is not None:
            self.ping, self.read_at = ping, self.clock()

    def fields(self) -> dict:
        """`echo` and `held_ms` for the heartbeat sent now (each number is echoed once)."""
        if self.ping is None:
            return {}
        out = {"echo": self.ping, "held_ms": max(0.0, (self.clock() - self.read_at) * 1e3)}
        self.ping = None
        return out
