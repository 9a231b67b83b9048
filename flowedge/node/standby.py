"""A standby head: a second board that holds the head's models, follows the head, and takes over when the
head is lost.

Following: it joins the head as a `standby` (HELLO), answers nothing but heartbeats, and keeps the head's
request log (LogEntry: each live request's committed tokens) and state (HeadState: the fencing term, the
stages; every heartbeat period). Meanwhile its own address (`listen`) already listens, with the plan
(the split model and the draft model) loaded: a HELLO there is refused with a line naming the head, so a
stage or client trying its addresses in turn moves on at once.

Taking over: when nothing has come from the head for `failover_s` (its connection closing says so
sooner on most networks, but a closed connection is not proof of a dead head, silence is the rule), it
becomes the head at `listen` under the next fencing term (node/fencing.py). Stages rejoin it (their
`heads` list), clients follow it (the client library's head list), and requests in flight resume from the
log (node/replication.py).
"""
from __future__ import annotations

import logging
import threading
import time

from flowedge.node.node_config import NodeConfig, flowedge_home
from flowedge.transport.addresses import is_wildcard, split_addr, tcp
from flowedge.node.fencing import TermGuard, next_term
from flowedge.node.head_node import HeadNode
from flowedge.node.data_port import reachable_ip
from flowedge.node.partition_plan import Plan, prepare_plan
from flowedge.node.replication import RequestLog
from flowedge.node.plan_follow import PlanFollower
from flowedge.node.standby_status import beat_stats
from flowedge.transport.msg_standby import standby_refusal
from flowedge.errors import FlowedgeError, HeadRefusedStandby, PeerUnreachable, ProtocolError, StaleTerm
from flowedge.transport import protocol as proto
from flowedge.transport.handshake import welcome_from
from flowedge.transport.link import Endpoint, Inbound, Kind, PeerEvent

log = logging.getLogger(__name__)

HELLO_WAIT_S = 2.0   # the head answers a HELLO from its loop at once


class StandbyNode:
    """Follows the head at `config.head`; becomes `head` (built, listening, not yet run) when it is lost."""

    def __init__(self, config: NodeConfig, head: HeadNode, entries: RequestLog,
                 stop: threading.Event | None = None, plan: Plan | None = None) -> None:
        """`plan`: the models a deposed head of this process holds (node/rejoin.py); None: loaded at `run`."""
        self.config, self.head, self.entries, self.plan = config, head, entries, plan
        self.announced = announced(config.listen, config.head)   # the `listen` the head is told
        self.stop = stop or head.stop
        self.fence = TermGuard()
        self.stages: list[str] = []            # the head's stages, as its last HeadState listed them
        self.plans = PlanFollower(head.members, head.engines, flowedge_home())   # the head's re-plans
        self.heard_s = time.monotonic()
        self.follower: Endpoint | None = None
        self.last_beat_s = 0.0
        self.state_s: float | None = None   # when the head's last HeadState came (its age goes into heartbeats)

    def run(self) -> None:
        """Load the plan, follow the head until it is lost, then serve as the head."""
        try:
            self.head.members.plan = self.plan or prepare_plan(self.head.config, flowedge_home())
            self.plan = None   # the head holds it from here (and drops it for a re-plan)
            log.info("standby %s: models loaded; following the head at %s, taking over at %s after %g s of "
                     "silence", self.config.name, self.config.head, self.config.listen, self.config.failover_s)
            if not self._follow():
                return
            self._take_over()
        except BaseException:
            self.head.close()
            raise
        self.head.run()

    # ---- following ------------------------------------------------------------------------------
    def _follow(self) -> bool:
        """Join the head and follow it; True once it is lost (False: stopped)."""
        while not self.stop.is_set():
            self.head.notifier.tick(self._sd_status)   # the watchdog: a rejoined head's unit is active already
            if self.fence.highest == 0:   # never joined yet: (re)try the HELLO
                self._join()
                continue
            if self._lost():
                return True
            self._pump(0.05)
        return False

    def _join(self) -> None:
        host, port = split_addr(self.config.head)
        if self.follower is not None:
            self.follower.close()
        self.follower = self.head.link.connect(Kind.DEALER, tcp(host, port))
        hello = proto.Hello(node_id=self.config.name, role="standby", device=self.config.device,
                            free_memory_bytes=0, capabilities={"listen": self.announced})
        deadline = time.monotonic() + HELLO_WAIT_S
        try:
            self.follower.send(hello)
            got = None
            while got is None and time.monotonic() < deadline and not self.stop.is_set():
                self._answer_own(0.05)
                got = self.follower.next_message(0)
            welcome = welcome_from(got, HELLO_WAIT_S)
        except (ProtocolError, PeerUnreachable) as err:
            self._refused(err)
            return
        self._check(welcome)
        self.heard_s = time.monotonic()
        log.info("standby: following head %s at %s (term %d)", welcome.node_id, self.config.head, welcome.term)

    def _sd_status(self) -> str:
        following = "following" if self.fence.highest else "waiting for"
        return f"standby: {following} the head at {self.config.head} (term {self.fence.highest})"

    def _refused(self, err: FlowedgeError) -> None:
        text = str(err)
        if "refused" in text and ("role" in text or "protocol" in text):
            raise HeadRefusedStandby(f"the head at {self.config.head} refused this standby ({text}): a standby "
                                     f"needs a head speaking flowedge protocol 1.8 or newer") from None
        log.warning("standby: no head to follow at %s yet: %s", self.config.head, text)

    def _check(self, welcome: proto.Welcome) -> None:
        if welcome.version[1] < proto.LogEntry.MIN_MINOR:
            raise HeadRefusedStandby(f"the head at {self.config.head} speaks flowedge protocol "
                                     f"{proto.version_text(welcome.version)}: it cannot replicate its request log "
                                     f"(a standby needs 1.{proto.LogEntry.MIN_MINOR} or newer)")
        self.fence.obey(max(welcome.term, 1), welcome.node_id)

    def _lost(self) -> bool:
        silent_s = time.monotonic() - self.heard_s
        if silent_s < self.config.failover_s:
            return False
        log.warning("standby: the head at %s is lost (nothing from it for %.1f s)", self.config.head, silent_s)
        return True

    def _pump(self, wait_s: float) -> None:
        """What the head sent (log, state), a heartbeat to it when due, and HELLOs at our own address."""
        self._answer_own(wait_s)
        assert self.follower is not None   # opened by _follow before it pumps
        while (got := self.follower.receive(0)) is not None:
            if isinstance(got, Inbound):
                self._on_head(got)
            elif isinstance(got, PeerEvent):
                log.info("standby: the connection to the head closed (%s)", got.kind.value)
        self._beat()

    def _on_head(self, got: Inbound) -> None:
        try:
            msg = proto.decode(got.frames)
        except ProtocolError as err:
            log.warning("standby: malformed message from the head dropped: %s", err)
            return
        term = getattr(msg, "term", None)
        try:
            if term:
                self.fence.obey(term)
        except StaleTerm as err:
            log.warning("standby: ignoring %s: %s", msg.TYPE, err)
            return
        self.heard_s = time.monotonic()
        if isinstance(msg, proto.LogEntry):
            self.entries.apply(msg)
        elif isinstance(msg, proto.HeadState):
            self.state_s = self.heard_s   # its age goes into our heartbeats (node/standby_status.py)
            self.stages = msg.stages
            self.plans.seen(msg.layers)
        elif isinstance(msg, proto.Shutdown):
            log.info("standby: the cluster is shutting down%s", f": {msg.reason}" if msg.reason else "")
            self.stop.set()

    def _beat(self) -> None:
        now = time.monotonic()
        if now - self.last_beat_s < self.config.heartbeat_ms / 1000:
            return
        self.last_beat_s = now
        assert self.follower is not None
        try:
            self.follower.send(proto.Heartbeat(node_id=self.config.name, load=0.0, rss_bytes=0,
                                               stats=beat_stats(self.entries.applied, self.state_s, now)))
        except PeerUnreachable as err:
            log.debug("standby: heartbeat not sent: %s", err)

    def _answer_own(self, wait_s: float) -> None:
        """A HELLO at our own address before the takeover: refused, naming the head."""
        got = self.head.ctrl.receive(wait_s)
        if isinstance(got, Inbound):
            why = standby_refusal(self.config.name, self.config.head, self.fence.highest)
            try:
                self.head.ctrl.send(proto.Refuse(reason=why), got.peer)
            except PeerUnreachable:
                pass

    # ---- taking over ----------------------------------------------------------------------------
    def _take_over(self) -> None:
        term = next_term(self.fence.highest)
        self.head.control.term = term
        # the cluster served before: requests that come back before the stages do wait for them (recovery_s)
        # instead of being refused as at a head that never had its stages
        self.head.requests.scheduler.ever_ready = True
        if self.follower is not None:
            self.follower.close()
        self.plans.adopt()
        log.warning("standby: TAKING OVER as the head at %s under fencing term %d (the last term was %d); %d "
                    "requests in the log; stages to rejoin: %s", self.config.listen, term, self.fence.highest,
                    self.entries.live(), ", ".join(s for s in self.stages if s) or "none known")


def announced(listen: str, head: str) -> str:
    """Where the head is told this standby serves once it takes over: `listen`, or for a wildcard bind
    (`0.0.0.0:5555`, a head's usual address, which a rejoining head keeps) this host's address on the
    head's network, so that the head's status and its deposition probe name a reachable address."""
    host, port = split_addr(listen)
    if not is_wildcard(host):
        return listen
    return f"{reachable_ip(split_addr(head)[0])}:{port}"
