"""The head node (node 0): a thin poll loop over four parts with one job each —
`membership` (peers, slots, heartbeats and liveness, assignments, shard serving), `head_requests` (the
request lifecycle: queue, pause, replay, cancel, deadlines), `head_engines` (prompts, KV budgets and
engine heads, built by `engine.assembly` as the simulator builds them) and `run_router` (which request an
engine run id names, and the one check of a returned segment's round).

Endpoints (on the link `roots.build_head` opened and handed in with every other part): `ctrl` (a
ROUTER at `head`): every stage's and client's DEALER, with peer events (a closed connection ends its
peer at once); `ret` (INBOUND at port + 1): hidden states coming back from the last stage; segments
go into the pipeline through the outbox (`head_ports.py`). One poll loop owns the endpoints; the engine's
work (a turn of every running request, starting queued ones) runs on a compute thread while the loop waits
and keeps heartbeating (node/beating.py), so a long draft prefill is not mistaken for a dead head. The two
never run the engine at once; their sends on the control socket share a lock.

Robustness: every inbound message is decoded defensively (a malformed one is logged and dropped, a
client gets an ErrorReply); peers that speak another major version or lack the cluster's keys are
refused without touching the requests in flight; a lost stage pauses the request in flight until its
slot is filled again (see `head_requests.py`); an unexpected error while handling one message fails at most
that message's request.
"""
from __future__ import annotations

import logging
import threading
import time
from typing import TYPE_CHECKING, Any, Callable

from flowedge.allocator import settle
from flowedge.node import memdebug
from flowedge.node.beating import BeatingWorker
from flowedge.node.deposition import Deposition
from flowedge.node.node_config import NodeConfig, flowedge_home
from flowedge.transport.addresses import split_addr
from flowedge.node.kv_budget import with_budgets
from flowedge.node.live_figures import CpuLoad, flowedge_version, model_created
from flowedge.node.membership import ClientGone, DrafterLost, Membership, Peer
from flowedge.node.partition_plan import prepare_plan
from flowedge.node.head_parts import HeadParts
from flowedge.node.replication import RequestLog, resume
from flowedge.systemd.sd_notify import Notifier
from flowedge.node.timeline import Timeline, sample
from flowedge.node.standby_status import standby_rows
from flowedge.errors import PeerUnreachable, ProtocolError, StageLost
from flowedge.transport import protocol as proto
from flowedge.transport.handshake import answer_hello
from flowedge.transport.link import Endpoint, Event, Inbound, PeerEvent
from flowedge.transport.validate import InvalidMessage

if TYPE_CHECKING:
    from flowedge.node.discovery import Announcer

log = logging.getLogger(__name__)


class HeadNode:
    def __init__(self, config: NodeConfig, parts: HeadParts, stop: threading.Event | None = None) -> None:
        self.config = config
        self.stop = stop or threading.Event()
        self.node_id = config.name
        self.host, self.port = split_addr(config.head)
        self.link, self.ctrl, self.ret = parts.link, parts.ctrl, parts.ret
        self.control, self.outbox = parts.port, parts.outbox
        self.members, self.engines, self.requests = parts.members, parts.engines, parts.requests
        self.drops, self.drafts, self.shrink, self.router = parts.drops, parts.drafts, parts.shrink, parts.router
        self.replica, self.resumes = parts.replica, parts.resumes
        self.deposition = Deposition(self.link, lambda: self.control.term, self.members, self.requests, self.node_id,
                                     parts.rejoins)
        self.wire = parts.port.counter   # data plane: segments and prune sets
        self.was_ready = False
        self.shutdown_cluster = False
        self.notifier = Notifier()   # systemd: READY once the plan is ready and the endpoints listen
        self.compute = BeatingWorker("head-compute")   # engine turns, heartbeats going on meanwhile
        self.judged_s = time.monotonic()   # when liveness was last judged (on an emptied control endpoint)
        self.announcer: Announcer | None = None   # mDNS, once the plan is ready (run)
        self.cpu = CpuLoad()   # this process's load, from one psutil.Process for the head's life
        self.started_unix = time.time()
        self.timeline = Timeline()   # the last minutes of status, a sample a second (the dashboard's past)
        self.model_created = model_created(config.model, self.started_unix)   # for /v1/models

    # ---- lifecycle ------------------------------------------------------------------------------
    def run(self) -> None:
        memdebug.install()   # FLOWEDGE_MEMDEBUG: where the head's memory goes (node/memdebug.py)
        try:
            log.info("head %s listening on %s (pipeline return on port %d)%s", self.node_id, self.config.head,
                     self.port + 1, "" if self.config.insecure else ", CurveZMQ on")
            plan = self.members.plan = self.members.plan or prepare_plan(self.config, flowedge_home())
            self._sync_plan()
            log.info("plan: %d stages, layers %s; waiting for stages to join",
                     self.config.stages, [list(r) for r in plan.ranges])
            self.members.assign_all()
            settle()   # the models are loaded: freeze them out of the collector's passes
            self._announce()
            self.notifier.ready(self.sd_status())
            self._loop()
        finally:
            if not self.deposition.leaving:   # rejoining as a standby, the process goes on (node/rejoin.py)
                self.notifier.stopping()
            if self.shutdown_cluster:   # `flowedge down`; a plain head restart leaves stages to rejoin
                self._shutdown_stages("cluster shutdown requested")
            self.close()

    def _announce(self) -> None:
        """Tell the LAN where this head is (mDNS), unless told not to. Discovery is advisory: no failure
        there (no zeroconf, no network, a zeroconf error) ends the head; stages can be given the address."""
        if not self.config.discovery:
            return
        try:
            from flowedge.node.discovery import Announcer
            self.announcer = Announcer(self.config.cluster, self.host, self.port, self.config.model)
        except Exception as err:  # noqa: BLE001 - an announcement is a convenience, never worth the head
            log.warning("discovery: cannot announce on the LAN (%s: %s); stages need `flowedge join %s`",
                        type(err).__name__, err, self.config.head)

    def close(self) -> None:
        if self.announcer is not None:
            self.announcer.close()
        self.outbox.close()
        for part in (self.members.replanner, self.shrink):
            if part is not None:
                part.close()
        self.link.close()
        self.compute.close()

    def _loop(self) -> None:
        while not self.stop.is_set() and not self.deposition.leaving:
            busy = self.requests.has_work() or self.requests.has_idle_work()
            ready = self.link.wait([self.ctrl, self.ret], 0 if busy else 0.05)
            emptied = True
            if self.ret in ready:
                self._drain(self.ret, self._on_return)
            if self.ctrl in ready:   # peer events come first: a closed connection ends its peers at once
                emptied = self._drain(self.ctrl, self._on_ctrl)
            self._judge_liveness(emptied)
            self._sync_plan()
            self._engine_turn()
            self._housekeeping()
            self.drops.tick()
            self.notifier.tick(self.sd_status)

    def _drain(self, endpoint: Endpoint, handler, limit: int = 64) -> bool:
        """Up to `limit` messages or peer events; whether the endpoint was read empty."""
        for _ in range(limit):
            got = endpoint.receive()
            if got is None:
                return True
            try:
                if isinstance(got, PeerEvent):
                    self._on_peer_event(got)
                else:
                    handler(got)
            except Exception as err:  # noqa: BLE001 - one message's bug must not take the head down
                self.drops.drop("internal", f"handling a message raised {type(err).__name__}: {err}",
                                level=logging.ERROR, exc_info=True)
            self.members.ping(self.requests.busy_clients())   # heartbeats keep going
        return False

    def _judge_liveness(self, emptied: bool) -> None:
        """Drop peers past their liveness, judged right after reading the control socket empty (what the
        peers sent while a turn ran is in by now). A backlog never read empty (a flood) defers it at
        most `stage_timeout_s` twice over."""
        now = time.monotonic()
        if emptied or now - self.judged_s > 2 * self.config.stage_timeout_s:
            self.judged_s = now
            self._events(self.members.judge(self.requests.busy_clients()))

    def _engine_turn(self) -> None:
        """One piece of work per running request (draft calls batched), then deadlines, replays and
        queued starts: on the compute thread while this one keeps heartbeating, bounded by the stall
        timeout (past it the head is taken for hung: beats and the systemd watchdog stop)."""
        ready, missing = self.members.cluster_ready(), self.members.missing()
        if not self.requests.pending():
            self.requests.tick(time.monotonic(), ready, missing)   # nothing to run: no need for the thread
            return
        clients, status = self.requests.busy_clients(), self.sd_status()

        def beat() -> None:   # reads nothing the turn changes
            self.members.ping(clients)
            self.notifier.tick(lambda: status)

        idle = not self.requests.has_work() and self.requests.has_idle_work()

        def turn() -> None:
            if idle:   # nothing came back: a piece of idle work (pre-drafting) while segments are in flight
                self.requests.idle_step(time.monotonic())
            else:
                self.requests.step(time.monotonic())
            self.requests.tick(time.monotonic(), ready, missing)

        try:
            self.compute.run(turn, beat, self.config.heartbeat_ms / 1000 / 2, give_up_s=self.config.stall_timeout_s)
        except Exception as err:  # noqa: BLE001 - requests fail one by one (head_requests.py); this is a bug past them
            self.drops.drop("internal", f"an engine turn raised {type(err).__name__}: {err}",
                            level=logging.ERROR, exc_info=True)

    # ---- control plane --------------------------------------------------------------------------
    def _on_ctrl(self, got: Inbound) -> None:
        identity, body = got.peer, got.frames
        if identity is None:   # a ROUTER always names the sender
            return
        peer = self.members.seen(identity)
        if peer is None:
            # the shrinker's (a board back after a re-plan is a spare), unless a standby has replaced this head
            admit = self.deposition.admit((self.shrink or self.members).admit)
            try:
                with self.control.lock:
                    hello = answer_hello(self.ctrl, identity, body, self.control.stamp(self.members.welcome()),
                                         admit)
            except PeerUnreachable:   # the peer hung up before our answer
                return
            if hello is not None:
                self._events(self.members.register(identity, hello))
                if self.replica is not None:
                    self.replica.joined(identity, hello)
                    self.deposition.joined(hello)
            return
        try:
            msg = proto.decode(body)
        except ProtocolError as err:
            self.drops.drop("malformed", f"from {peer.name}: {err}")
            if peer.drafter and self.drafts is not None:
                self.drafts.on_unreadable(peer, err)
            if peer.hello.role == "client":
                self._send(identity, proto.ErrorReply(request_id=0, message=f"malformed message: {err}"))
            return
        handlers: dict[type[proto.Message], Callable[[Peer, Any], None]] = {   # by the message's type
            proto.Heartbeat: self.members.on_heartbeat, proto.Ready: self.members.on_ready,
            proto.ShardRequest: self.members.on_shard_request, proto.PromptRequest: self._on_prompt,
            proto.Cancel: self._on_cancel, proto.StatusRequest: self._on_status, proto.Shutdown: self._on_shutdown,
            proto.Hello: self._on_hello_again, proto.Refuse: self.members.on_refuse,
            proto.DraftReady: self.members.on_draft_ready, proto.DraftAnswer: self._on_draft_answer,
            proto.DraftDeclined: self._on_draft_answer, proto.RequestDropped: self._on_request_dropped,
        }
        handler = handlers.get(type(msg))
        if handler is None:
            log.warning("ignoring %s from %s", msg.TYPE, peer.name)
            return
        handler(peer, msg)

    def _sync_plan(self) -> None:
        """The first plan, or a re-plan for the devices that joined (membership made it while assigning):
        fresh engines and draft batcher before the next engine turn."""
        if self.members.plan is not None and self.members.plan is not self.engines.plan:
            self.requests.use_handlers(self.engines.use_plan(self.members.plan))

    def _on_draft_answer(self, peer: Peer, msg: proto.DraftAnswer | proto.DraftDeclined) -> None:
        if not peer.drafter or self.drafts is None:
            log.warning("%s from %s, which is not a drafter", msg.TYPE, peer.name)
            return
        self.drafts.on_answer(peer, msg)

    def _on_request_dropped(self, peer: Peer, msg: proto.RequestDropped) -> None:
        if not peer.stage:
            log.warning("%s from %s, which is not a stage", msg.TYPE, peer.name)
            return
        self.router.dropped(msg.run_id, msg.reason)

    def _on_hello_again(self, peer: Peer, msg: proto.Hello) -> None:
        self._send(peer.identity, self.members.welcome())

    def _on_status(self, peer: Peer, msg: proto.StatusRequest) -> None:
        self._send(peer.identity, proto.StatusReply(nodes=self.status(timeline=msg.timeline)))

    def _on_shutdown(self, peer: Peer, msg: proto.Shutdown) -> None:
        log.info("shutdown requested by %s%s", peer.name, f": {msg.reason}" if msg.reason else "")
        self.shutdown_cluster = True
        self.stop.set()

    def _on_prompt(self, peer: Peer, msg: proto.PromptRequest) -> None:
        if peer.hello.role != "client":
            log.warning("prompt from non-client %s ignored", peer.name)
            return
        args = (time.monotonic(), self.members.cluster_ready(), self.members.missing())
        if msg.resumed >= 0:   # a request moved here from a head that was lost
            resume(self.requests, peer, msg, self.resumes or RequestLog(), *args, self._send)
            return
        self.requests.submit(peer.identity, msg, *args)

    def _on_cancel(self, peer: Peer, msg: proto.Cancel) -> None:
        self.requests.cancel(peer.identity, msg.request_id)

    def _on_peer_event(self, event: PeerEvent) -> None:
        """A peer's connection closed (it ends the peer at once), or a handshake was refused."""
        if event.kind is Event.DISCONNECTED and event.peer is not None:
            self._events(self.members.on_disconnect(event.peer))
        elif event.kind is Event.HANDSHAKE_FAILED:
            log.warning("refused a connection from %s: CurveZMQ handshake failed — a node without this "
                        "cluster's keys, or one running --insecure", event.detail)

    def _events(self, events: list) -> None:
        """Membership events into the request lifecycle."""
        for ev in events:
            if isinstance(ev, StageLost):
                self.requests.stage_lost(ev.describe(), time.monotonic())
            elif isinstance(ev, ClientGone):
                self.requests.client_gone(ev.identity, ev.why)
            elif isinstance(ev, DrafterLost) and self.drafts is not None:
                self.drafts.drafter_lost(ev.identity)

    def sd_status(self) -> str:
        """The one-line STATUS= systemd shows: stages ready, requests queued and running."""
        m = self.members
        ready = sum(1 for i in m.stage_identities() if m.peers[i].ready)
        running = len(self.requests.running)
        return (f"{'serving' if m.cluster_ready() else 'waiting for stages'}, {ready}/{len(m.slots)} "
                f"stages ready, {self.requests.pending() - running} queued, {running} running")

    def status(self, timeline: bool = False) -> list[dict]:
        """One row per node, the head's first; `timeline`: the head's row carries its recent past too."""
        head = {
            "node_id": self.node_id, "role": "head", "address": self.config.head, "stage": 0,
            "layers": "embed+head", "model": self.config.model, "model_created": self.model_created,
            "started_unix": round(self.started_unix, 3), "draft": self.config.draft,
            "model_sha256": self.members.plan.model_sha256 if self.members.plan is not None else "",
            "draft_quant": self.config.draft_quant,
            "device": self.config.device, "rss_bytes": self.cpu.rss_bytes(),
            "load": self.cpu.read(), "last_seen_s": 0.0,
            "ready": self.members.cluster_ready(), "plan_ready": self.engines.plan is not None,
            "queue": self.requests.pending(), "strategy": self.config.strategy, "wire": self.wire.snapshot(),
            "served": dict(self.requests.served), "last_request": self.requests.last_stats,
            "requests": self.requests.live(time.monotonic(), self._peer_name),
            "clients": self.requests.client_queues(),
            "membership": self.shrink.status() if self.shrink is not None else None,
            "version": flowedge_version(), "uptime_s": round(time.time() - self.started_unix, 1),
            "kv_reserved_tokens": self.requests.kv_reserved(),
            "dropped": self.drops.snapshot(), "auto": self.requests.last_auto,
            "predraft": self.requests.last_predraft,
            "drafter_jobs": self.drafts.status() if self.drafts is not None else None,
            "draft_batching": self.engines.batcher.counts() if self.engines.batcher is not None else None,
            "turn_ms_longest": round(1000 * self.compute.longest_s, 3),
            "term": self.control.term, "standbys": standby_rows(self.replica, self.members),
            "deposed": self.deposition.status(),
        }
        if timeline:
            head["timeline"] = self.timeline.snapshot()
        return [head] + with_budgets(self.members.status_rows(), self.engines.kv_budgets())

    def _peer_name(self, identity: bytes) -> str:
        peer = self.members.peers.get(identity)
        return peer.name if peer is not None else ""

    def _sample(self) -> None:
        """A timeline sample a second, taken on the loop thread between engine turns."""
        self.timeline.tick(time.monotonic(), lambda: sample(time.time(), self.requests.live(time.monotonic()),
                                                            self.cpu.read(), self.members.status_rows()))

    # ---- data plane and liveness ----------------------------------------------------------------
    def _on_return(self, got: Inbound) -> None:
        """A segment back from the last stage: routed to its run's request (node/run_router.py)."""
        try:
            msg = proto.decode(got.frames)
            if not isinstance(msg, proto.Segment):
                raise InvalidMessage("unexpected_type", f"{msg.TYPE} on the pipeline return port")
        except InvalidMessage as err:
            self.drops.drop(err.rule, f"pipeline return: {err}")
            return
        except ProtocolError as err:
            self.drops.drop("malformed", f"pipeline return: {err}")
            return
        self.router.segment(msg, time.monotonic())

    def _housekeeping(self) -> None:
        if self.members.replanner is not None and self.members.replanner.busy:
            self.members.assign_all()
        self.members.ping(self.requests.busy_clients())
        self.members.retry_refused()
        if self.shrink is not None:
            self.shrink.tick()
        if self.replica is not None:
            self.replica.tick()
            self.deposition.tick()
        if self.drafts is not None:
            self.drafts.expire()
        self._sample()
        ready = self.members.cluster_ready()
        if ready != self.was_ready:
            log.info("cluster %s", "ready: accepting prompts" if ready else "not ready")
            self.was_ready = ready

    def _send(self, identity: bytes, msg: proto.Message) -> None:
        self.control.send(identity, msg)

    def _shutdown_stages(self, reason: str) -> None:
        drafters = [p.identity for p in self.members.peers.values() if p.drafter]
        for identity in self.members.stage_identities() + drafters:
            self._send(identity, proto.Shutdown(reason=reason))
        time.sleep(0.05)   # let the Shutdown messages leave before the sockets close

