"""Which connections to drop, hold back or let in, so that one client cannot lock others out of the HTTP API.

A connection that has not yet sent a complete request head costs the server a slot and proves
nothing: a slowloris client opens many and trickles bytes into each. uvicorn's one cap
(`limit_concurrency`) is shared by every client, so ~130 such connections from one address left
legitimate requests a 503. Here connections still waiting for their head are counted, per client
address and in all. When a new one would pass either limit, the waiting connections (of that address,
or of all) that have waited longer than `grace_s` are closed, oldest first: a real client sends its head
within milliseconds of connecting, while a trickler loses its connections as fast as it opens them. When
none has waited that long the newcomer is part of a burst (a client opening many connections at once),
and closing any of them would cut a legitimate request; it is queued instead (the server stops reading
it and does not count it) and let in, oldest first, as the waiting ones finish their heads (or, asking
again every grace, as soon as one of those has waited past the grace: a trickler). Only past
`queue_limit` queued connections is the newest closed. Connections whose head is complete are not
counted: an unauthenticated request is answered 401 at once, so what holds a slot for long is an
authenticated request or `/health` — the room is kept for those (and the whole-head and whole-body
deadlines bound the rest in time).

No sockets here: the h11 protocol (`header_deadline.py`) reports each connection's waits, and closes,
pauses and resumes what this says.
"""
from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable, Hashable
from dataclasses import dataclass, field

from flowedge.errors import ConfigError

GRACE_S = 0.75   # how long a new connection may take to send its head before it can be closed for another


@dataclass
class Verdict:
    """What to do on a new wait: close these (older tricklers, or the newcomer itself past the queue),
    and whether the newcomer is queued rather than let in."""
    close: list = field(default_factory=list)
    queued: bool = False


class Admission:
    def __init__(self, per_address: int, total: int, grace_s: float = GRACE_S, queue_limit: int | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        if per_address < 1 or total < 1:
            raise ConfigError(f"connection limits must be >= 1, got {per_address} per address, {total} in all")
        if not grace_s >= 0:
            raise ConfigError(f"the admission grace must be >= 0 s, got {grace_s}")
        self.per_address, self.total, self.grace_s, self.clock = per_address, total, grace_s, clock
        self.queue_limit = 4 * total if queue_limit is None else queue_limit
        self.waiting: OrderedDict[Hashable, tuple[str, float]] = OrderedDict()   # conn -> (address, since)
        self.queue: OrderedDict[Hashable, str] = OrderedDict()                   # conn -> address, oldest first
        self.evicted = self.refused = 0

    def waits(self, conn: Hashable, address: str) -> Verdict:
        """`conn` (from `address`) starts waiting for a request head."""
        self.waiting.pop(conn, None)
        self.queue.pop(conn, None)
        now = self.clock()
        verdict = Verdict(close=self._evict_stale(address, now))
        if self._room(address):
            self.waiting[conn] = (address, now)
        elif len(self.queue) < self.queue_limit:
            self.queue[conn] = address
            verdict.queued = True
        else:
            verdict.close.append(conn)
            self.refused += 1
        return verdict

    def retry(self, conn: Hashable) -> Verdict:
        """A queued `conn` asks again (the server asks every grace): the ones that have waited past the
        grace make room for it now. `queued` is false once it is in (or no longer queued)."""
        if conn not in self.queue:
            return Verdict()
        address, now = self.queue[conn], self.clock()
        verdict = Verdict(close=self._evict_stale(address, now), queued=True)
        if self._room(address):
            del self.queue[conn]
            self.waiting[conn] = (address, now)
            verdict.queued = False
        return verdict

    def done(self, conn: Hashable) -> list[Hashable]:
        """`conn` sent its head, or closed; returns the queued connections let in in its place."""
        self.waiting.pop(conn, None)
        self.queue.pop(conn, None)
        let_in = []
        for c, address in list(self.queue.items()):
            if self._room(address):
                del self.queue[c]
                self.waiting[c] = (address, self.clock())
                let_in.append(c)
        return let_in

    def count(self, address: str | None = None) -> int:
        return sum(1 for a, _ in self.waiting.values() if address is None or a == address)

    def _room(self, address: str) -> bool:
        return self.count(address) < self.per_address and len(self.waiting) < self.total

    def _evict_stale(self, address: str, now: float) -> list[Hashable]:
        """Close the oldest connections that waited past the grace while `address`, or all, is full."""
        close = []
        for c, (a, since) in list(self.waiting.items()):
            full = self.count(address) >= self.per_address if a == address else False
            if now - since < self.grace_s:
                break   # oldest first: the rest are newer still
            if full or len(self.waiting) >= self.total:
                del self.waiting[c]
                close.append(c)
        self.evicted += len(close)
        return close
