"""Which connections to drop so that one client cannot lock others out of the HTTP API.

A connection that has not yet sent a complete request head costs the server a slot and proves
nothing: a slowloris client opens many and trickles bytes into each. uvicorn's one cap
(`limit_concurrency`) is shared by every client, so ~130 such connections from one address left
legitimate requests a 503. Here connections still waiting for their head are counted, per
client address and in all, and when a new one would pass either limit the *oldest* waiting one (of
that address, or of all) is closed instead of the new one: a real client sends its head within
milliseconds of connecting, so it is never the oldest for long, while a trickler loses its
connections as fast as it opens them. Connections whose head is complete are not counted: an
unauthenticated request is answered 401 at once, so what holds a slot for long is an authenticated
request or `/health` — the room is kept for those (and the whole-head and whole-body deadlines bound
the rest in time).

No sockets here: the h11 protocol (`header_deadline.py`) reports each connection's waits, and closes
what this says to close.
"""
from __future__ import annotations

from collections import OrderedDict
from collections.abc import Hashable

from flowedge.errors import ConfigError


class Admission:
    def __init__(self, per_address: int, total: int) -> None:
        if per_address < 1 or total < 1:
            raise ConfigError(f"connection limits must be >= 1, got {per_address} per address, {total} in all")
        self.per_address, self.total = per_address, total
        self.waiting: OrderedDict[Hashable, str] = OrderedDict()   # connection -> its address, oldest first
        self.evicted = 0

    def waits(self, conn: Hashable, address: str) -> list[Hashable]:
        """`conn` (from `address`) starts waiting for a request head; returns the connections to close."""
        self.waiting.pop(conn, None)
        close: list[Hashable] = []
        same = [c for c, a in self.waiting.items() if a == address]
        if len(same) >= self.per_address:
            close.append(same[0])
        if len(self.waiting) - len(close) >= self.total:
            close.append(next(c for c in self.waiting if c not in close))
        for c in close:
            del self.waiting[c]
        self.waiting[conn] = address
        self.evicted += len(close)
        return close

    def done(self, conn: Hashable) -> None:
        """`conn` sent its head, or closed."""
        self.waiting.pop(conn, None)

    def count(self, address: str | None = None) -> int:
        return sum(1 for a in self.waiting.values() if address is None or a == address)
