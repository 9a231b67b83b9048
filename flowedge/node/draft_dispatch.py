"""The head's side of the drafter role: it carries out the engines' `Offload` actions (a pre-draft job
for a drafter device, engine/predraft.py) and hands every job's outcome back to its engine.

A job goes to a ready drafter (the one that already holds the request's replica, else the least busy)
as a `DraftJob`; its answer is grafted by the engine: `PreDrafted(job, growth)` through the scheduler's
`deliver`. Every job gets exactly one outcome, and never later than `timeout_s`: with no drafter, a
drafter that declines it (its replica is behind, the job was bad), an answer that fails its checks, a
drafter lost (disconnected, silent past its liveness) or one that does not answer in time, the outcome
is `PreDrafted(job, None)`: node 0 drafts alone and ships the whole context with its next job. Node 0
never waits for a drafter: its expansion goes on whether an answer came or not. An answer that comes
after its job timed out (within `LATE_KEEP_S`) is still handed over: the engine grafts any job's growth
by token path, so its nodes under node 0's current root are valid however late they are.

Threads: `offload` runs inside an engine turn (the compute thread), everything else on the poll loop;
the head never runs both at once (head_node.py).
"""
from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

from flowedge.engine.draft_sync import DraftSnapshot
from flowedge.errors import ProtocolError
from flowedge.node import draft_wire
from flowedge.node.droplog import DropLog
from flowedge.node.membership import Membership, Peer
from flowedge.transport import protocol as proto

if TYPE_CHECKING:
    from flowedge.engine.predraft import PreDraftJob

log = logging.getLogger(__name__)

DRAFT_TIMEOUT_S = 1.0    # a job not answered by then is given up (node 0 has drafted alone meanwhile)
LATE_KEEP_S = 10.0       # a timed-out job's answer is still grafted if it comes within this
MAX_HOMES = 1024
NO_DRAFTER_HOLD_S = 0.05  # with no drafter, a job's empty outcome waits this long: not a busy loop of jobs


@dataclass
class Outstanding:
    key: int
    job: PreDraftJob
    snapshot: DraftSnapshot | None   # None: no drafter took it (then identity is None too)
    identity: bytes | None
    due_s: float


def predrafted(job, growth):
    """The engine's event for a job's outcome."""
    from flowedge.engine.predraft import PreDrafted

    return PreDrafted(job, growth)


class DraftDispatch:
    def __init__(self, members: Membership, send: Callable[[bytes, proto.Message], None],
                 draft_model: Callable[[], object], drops: DropLog, deliver: Callable[[int, object], None],
                 timeout_s: float = DRAFT_TIMEOUT_S, clock: Callable[[], float] = time.monotonic,
                 event=predrafted) -> None:
        """`send`: to one peer over control; `draft_model()`: node 0's draft model (answers are checked
        against it); `deliver`: the request scheduler's (`Scheduler.deliver(key, event)`, built first)."""
        self.members, self.send, self.draft_model, self.drops = members, send, draft_model, drops
        self.timeout_s, self.clock, self.event, self.deliver = timeout_s, clock, event, deliver
        self.out: dict[tuple[int, int], Outstanding] = {}
        self.expired: dict[tuple[int, int], Outstanding] = {}   # timed out; due_s: until when an answer counts
        self.home: dict[int, bytes] = {}   # request key -> the drafter holding its replica
        self.counts = {"jobs": 0, "sent": 0, "answered": 0, "declined": 0, "behind": 0, "timed_out": 0,
                       "drafter_lost": 0, "no_drafter": 0, "late": 0, "late_grafted": 0, "rejected": 0}

    # ---- jobs out (compute thread, inside a turn) ---------------------------------------------------
    def offload(self, key: int, action) -> None:
        """Carry out an engine's Offload: send its snapshot to a drafter, or settle it empty."""
        self.counts["jobs"] += 1
        job, snap = action.job, getattr(action, "snapshot", None)
        drafter = self._drafter_for(key)
        now = self.clock()
        if snap is None or drafter is None:
            self.counts["no_drafter"] += 1
            self.out[(key, job.seq)] = Outstanding(key, job, None, None, now + NO_DRAFTER_HOLD_S)
            return
        try:
            msg = draft_wire.job_message(key, job.seq, snap)
        except ProtocolError as err:   # a snapshot the wire refuses (a bug, or a tree past the bounds)
            self.drops.drop("draft_job", f"request {key}: {err}")
            self.out[(key, job.seq)] = Outstanding(key, job, None, None, now)
            return
        self.out[(key, job.seq)] = Outstanding(key, job, snap, drafter.identity, now + self.timeout_s)
        self.home.pop(key, None)
        self.home[key] = drafter.identity
        while len(self.home) > MAX_HOMES:   # requests long ended
            self.home.pop(next(iter(self.home)))
        self.counts["sent"] += 1
        self.send(drafter.identity, msg)

    def _drafter_for(self, key: int) -> Peer | None:
        ready = self.members.drafters()
        if not ready:
            return None
        mine = next((p for p in ready if p.identity == self.home.get(key)), None)
        if mine is not None:
            return mine
        busy = {p.identity: 0 for p in ready}
        for o in self.out.values():
            if o.identity in busy:
                busy[o.identity] += 1
        return min(ready, key=lambda p: busy[p.identity])

    # ---- outcomes (poll loop) -----------------------------------------------------------------------
    def on_answer(self, peer: Peer, msg: proto.DraftAnswer | proto.DraftDeclined) -> None:
        """A drafter's answer or refusal: its job's outcome, if the job is still waiting for one."""
        at = (msg.request_id, msg.seq)
        o = self.out.get(at)
        if o is None or o.identity != peer.identity:
            self._late(peer, msg)
            return
        del self.out[at]
        snapshot = o.snapshot
        assert snapshot is not None, "a job a drafter holds was sent with its snapshot"
        if isinstance(msg, proto.DraftDeclined):
            self.counts["behind" if msg.why == "behind" else "declined"] += 1
            if msg.why == "error":
                self.drops.drop("draft_declined", f"drafter {peer.name}, request {o.key}: {msg.detail}")
            self._settle(o, None)
            return
        try:
            growth = draft_wire.growth_of(msg, snapshot, self.draft_model())
        except ProtocolError as err:
            self.counts["rejected"] += 1
            self.drops.drop("draft_answer", f"drafter {peer.name}, request {o.key}: {err}")
            self._settle(o, None)
            return
        self.counts["answered"] += 1
        self._settle(o, growth)

    def _late(self, peer: Peer, msg: proto.DraftAnswer | proto.DraftDeclined) -> None:
        """An answer after its job's timeout: its growth still goes to the engine (grafted by token path;
        its job's outcome, None, was delivered at the timeout). Anything else is dropped."""
        self.counts["late"] += 1
        o = self.expired.pop((msg.request_id, msg.seq), None)
        if o is None or o.identity != peer.identity or not isinstance(msg, proto.DraftAnswer):
            return
        assert o.snapshot is not None, "an expired job is kept only with its snapshot"
        try:
            growth = draft_wire.growth_of(msg, o.snapshot, self.draft_model())
        except ProtocolError as err:
            self.counts["rejected"] += 1
            self.drops.drop("draft_answer", f"drafter {peer.name}, request {o.key} (late): {err}")
            return
        self.counts["late_grafted"] += 1
        self._settle(o, growth)

    def on_unreadable(self, peer: Peer, err: ProtocolError) -> None:
        """A drafter's message that did not decode: its jobs run out their time."""
        self.drops.drop("malformed", f"from drafter {peer.name}: {err}")

    def expire(self) -> None:
        """Jobs past their time (or held with no drafter) settle empty."""
        now = self.clock()
        for o in [o for o in self.out.values() if o.due_s <= now]:
            del self.out[(o.key, o.job.seq)]
            if o.identity is not None and o.snapshot is not None:   # sent to a drafter: both set
                self.counts["timed_out"] += 1
                log.debug("draft job %d of request %d: no answer within %g s", o.job.seq, o.key, self.timeout_s)
                rowless = replace(o.snapshot, rows=o.snapshot.rows[:, :, :, :0])   # checks need no K/V
                self.expired[(o.key, o.job.seq)] = Outstanding(o.key, o.job, rowless, o.identity, now + LATE_KEEP_S)
            self._settle(o, None)
        for at in [at for at, o in self.expired.items() if o.due_s <= now]:
            del self.expired[at]   # its snapshot (K/V rows) is not held longer

    def drafter_lost(self, identity: bytes) -> None:
        """A drafter left: its jobs settle empty now, its requests find another drafter."""
        for o in [o for o in self.out.values() if o.identity == identity]:
            del self.out[(o.key, o.job.seq)]
            self.counts["drafter_lost"] += 1
            self._settle(o, None)
        self.home = {k: i for k, i in self.home.items() if i != identity}
        self.expired = {at: o for at, o in self.expired.items() if o.identity != identity}

    def _settle(self, o: Outstanding, growth) -> None:
        self.deliver(o.key, self.event(o.job, growth))

    def status(self) -> dict:
        return {**self.counts, "outstanding": len(self.out), "drafters": len(self.members.drafters())}
