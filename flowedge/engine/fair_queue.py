"""The scheduler's queue: one lane per client, each first come, first served and capped; the lanes share
the free slots fairly.

One first-come-first-served line let one client that sends many requests at once hold every other
client behind all of them. Here each client (`Job.client`: a gateway's name for its caller, else the
connection) has its own lane, and when a slot frees the request to start is the head of the lane that
  1. has the fewest requests running for its weight (`running / weight`): a client with nothing running
     goes before one that holds slots, so a newcomer starts at the next free slot however long another
     client's queue is; then
  2. has started the least for its weight (stride scheduling: each start adds `1 / weight` to its lane's
     `pass_`): with one slot, or among clients running as many, they take turns, `weight` starts each; then
  3. holds the oldest request.
A lane that appears starts at the global pass, which grows by 1 / (the queued lanes' total weight) at
each start: it brings no credit for the time its client had nothing queued, and a stream of new clients
cannot starve an old one (each start moves the global pass on, and a client with nothing running keeps
its turn among the others). With one client this is the plain FIFO it replaces.

`full(client, cap)` is the per-client cap: past it the scheduler refuses the request with a `Busy`
message instead of queueing it. Sans-IO, no clock: the scheduler owns time and deadlines.
"""
from __future__ import annotations

import itertools
import logging
from collections import Counter, deque
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field

from flowedge.engine.jobs import Request
from flowedge.errors import Busy

log = logging.getLogger(__name__)

MAX_REFUSED_CLIENTS = 64   # clients whose refusals are counted one by one (the least recent forgotten first)
MAX_TABLE_ROWS = 32        # clients in the status table


@dataclass
class Lane:
    """One client's queued requests, oldest first; `pass_` grows by 1 / weight at each start."""
    pass_: float
    weight: float = 1.0
    requests: deque[Request] = field(default_factory=deque)


class FairQueue:
    """Queued requests by client. Iterating gives them in arrival order; `first()` is the one to start next.
    `running()`: the requests holding slots now (the scheduler's running and paused ones)."""

    def __init__(self, running: Callable[[], Iterable[Request]] = tuple) -> None:
        self.running = running
        self.lanes: dict[str, Lane] = {}
        self.by_key: dict[int, Request] = {}   # every queued request, in arrival order
        self.arrival: dict[int, int] = {}      # key -> its place in the arrival order
        self.vtime = 0.0                       # the global pass: a new lane starts here
        self.refused: dict[str, int] = {}      # requests refused by the cap, per client (bounded)
        self.refused_total = 0
        self._arrivals = itertools.count()

    def __len__(self) -> int:
        return len(self.by_key)

    def __iter__(self) -> Iterator[Request]:
        return iter(list(self.by_key.values()))

    def __contains__(self, req: object) -> bool:
        return isinstance(req, Request) and self.by_key.get(req.key) is req

    def append(self, req: Request) -> None:
        client = req.job.client
        lane = self.lanes.get(client)
        if lane is None:
            lane = self.lanes[client] = Lane(self.vtime)
        lane.weight = req.job.weight   # the client's latest weight (a config reload may change it)
        lane.requests.append(req)
        self.by_key[req.key] = req
        self.arrival[req.key] = next(self._arrivals)

    def first(self) -> Request | None:
        """The request to start next (`_next_lane`'s head)."""
        lane = self._next_lane()
        return lane.requests[0] if lane is not None else None

    def popleft(self) -> Request:
        """Take `first()` off the queue (it starts): its lane's pass moves on by 1 / weight, the global pass
        by 1 / the queued lanes' total weight."""
        lane = self._next_lane()
        if lane is None:
            raise IndexError("pop from an empty queue")
        req = lane.requests.popleft()
        self.vtime += 1.0 / sum(other.weight for other in self.lanes.values())
        lane.pass_ += 1.0 / lane.weight
        self._drop(req, lane)
        return req

    def discard(self, req: Request) -> None:
        """Take a request out if it is queued (cancelled, failed, past its deadline)."""
        if req in self:
            lane = self.lanes[req.job.client]
            lane.requests.remove(req)
            self._drop(req, lane)

    def get(self, key: int) -> Request | None:
        return self.by_key.get(key)

    def queued(self, client: str) -> int:
        lane = self.lanes.get(client)
        return len(lane.requests) if lane is not None else 0

    def counts(self) -> dict[str, int]:
        """Queued requests per client."""
        return {client: len(lane.requests) for client, lane in self.lanes.items()}

    def full(self, client: str, cap: int) -> str | None:
        """The refusal for one more request of `client` when it already has `cap` queued (0: no cap);
        None when it may queue. Counts the refusal."""
        queued = self.queued(client)
        if not cap or queued < cap:
            return None
        self.refused_total += 1
        self.refused[client] = self.refused.pop(client, 0) + 1   # most recent last
        while len(self.refused) > MAX_REFUSED_CLIENTS:
            self.refused.pop(next(iter(self.refused)))
        if self.refused_total % 100 == 1:   # the first, then every 100th: a flood must not flood the log
            log.warning("refused %d requests of clients with a full queue; the latest from %s (%d queued)",
                        self.refused_total, client or "-", queued)
        return (f"{Busy.PREFIX}this client's queue is full: {queued} of its requests are waiting "
                f"(max_queued_per_client = {cap}); retry once some have started")

    def table(self) -> list[dict]:
        """One row per client with requests queued or running, or refused lately (for status): the
        busiest first, at most MAX_TABLE_ROWS."""
        rows: dict[str, dict] = {}

        def row(client: str, weight: float) -> dict:
            return rows.setdefault(client, {"client": client, "weight": weight, "queued": 0, "running": 0,
                                            "refused": self.refused.get(client, 0)})

        for client, lane in self.lanes.items():
            row(client, lane.weight)["queued"] = len(lane.requests)
        for req in self.running():
            row(req.job.client, req.job.weight)["running"] += 1
        for client in self.refused:
            row(client, 1.0)
        busiest = sorted(rows.values(), key=lambda r: (-r["queued"] - r["running"], -r["refused"], r["client"]))
        return busiest[:MAX_TABLE_ROWS]

    def _next_lane(self) -> Lane | None:
        """The lane whose head starts next: the fewest running for its weight, then the least started for
        its weight, then the oldest head request."""
        load = Counter(req.job.client for req in self.running())
        return min(self.lanes.values(), default=None, key=lambda lane: (
            load[lane.requests[0].job.client] / lane.weight, lane.pass_, self.arrival[lane.requests[0].key]))

    def _drop(self, req: Request, lane: Lane) -> None:
        del self.by_key[req.key]
        del self.arrival[req.key]
        if not lane.requests:
            del self.lanes[req.job.client]

