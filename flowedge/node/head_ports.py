"""The head's ways out: its control endpoint (shared by the poll loop and the compute thread) and the
request lifecycle's outbox (to a client, into the pipeline, to every stage). No socket kinds here:
the endpoints come from the link the composition root (`roots.py`) opened."""
from __future__ import annotations

import logging
import threading
from dataclasses import replace
from typing import TypeVar

from flowedge.engine.events import Offload, Segment, Send
from flowedge.errors import PeerUnreachable
from flowedge.node import wire
from flowedge.node.membership import Membership
from flowedge.transport import protocol as proto
from flowedge.transport.link import Endpoint, Kind, Link

log = logging.getLogger(__name__)


M = TypeVar("M", bound=proto.Message)

class ControlPort:
    """Sends to one peer over the control ROUTER. The loop's heartbeats and the engine turn's answers
    share a lock; a peer that has gone is not an error here (liveness deals with it)."""

    def __init__(self, ctrl: Endpoint, counter: wire.WireCounter, term: int = 1) -> None:
        self.ctrl, self.counter = ctrl, counter
        self.lock = threading.Lock()
        self.term = term   # the head's fencing term, on every WELCOME and HEARTBEAT it sends (node/fencing.py)

    def stamp(self, msg: M) -> M:
        """`msg` with the head's term, if it is a message that carries one."""
        return replace(msg, term=self.term) if isinstance(msg, (proto.Welcome, proto.Heartbeat)) else msg

    def send(self, identity: bytes, msg: proto.Message, counted: bool = False) -> None:
        """`counted` adds it to the data-plane byte counters (prune sets, resets)."""
        msg = self.stamp(msg)
        try:
            with self.lock:
                if counted:
                    self.counter.send(self.ctrl, msg, identity)
                else:
                    self.ctrl.send(msg, identity)
        except PeerUnreachable as err:
            log.debug("send to %r failed: %s", identity, err)


class HeadOutbox:
    """The request lifecycle's way out (`requests.OutPort`): segments go into the pipeline through an
    OUTBOUND to stage 1's data port (made again whenever stage 1 changes), the rest over control."""

    def __init__(self, link: Link, port: ControlPort, members: Membership, wire_dtype: str,
                 drafts=None) -> None:
        """`drafts`: the drafter dispatch (node/draft_dispatch.py) that carries out pre-draft jobs."""
        self.link, self.port, self.members, self.wire_dtype = link, port, members, wire_dtype
        self.drafts = drafts
        self.to_stage1: Endpoint | None = None
        self.stage1: bytes | None = None   # the identity `to_stage1` was made for

    def to_client(self, identity: bytes, msg: proto.Message) -> None:
        self.port.send(identity, msg)

    def to_stages(self, action: Send) -> None:
        msg = wire.to_wire(action.message, self.wire_dtype)
        if isinstance(action.message, Segment):
            self._to_stage1(msg)
            return
        identity = self.members.stage_identity(action.to)
        if identity is not None:
            self.port.send(identity, msg, counted=True)

    def offload(self, key: int, action: Offload) -> None:
        if self.drafts is not None:
            self.drafts.offload(key, action)

    def reset_stages(self, run_id: int) -> None:
        for identity in self.members.stage_identities():
            self.port.send(identity, proto.Reset(run_id=run_id))

    def _to_stage1(self, msg: proto.Message) -> None:
        identity = self.members.stage_identity(1)
        if identity != self.stage1:   # a new stage 1 (or none): drop whatever was queued for the old one
            self.close()
            self.stage1 = identity
            if identity is not None:
                self.to_stage1 = self.link.connect(Kind.OUTBOUND, self.members.stage1_addr())
        if self.to_stage1 is None:
            return
        try:
            self.port.counter.send(self.to_stage1, msg)
        except PeerUnreachable:
            log.warning("stage 1 is not taking segments; liveness will deal with it")

    def close(self) -> None:
        if self.to_stage1 is not None:
            self.to_stage1.close()
            self.to_stage1 = None
