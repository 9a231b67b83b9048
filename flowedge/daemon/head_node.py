"""The head node (node 0): a thin poll loop over three parts with one job each —
`membership` (peers, slots, heartbeats and liveness, assignments, shard serving), `requests` (the
request lifecycle: queue, pause, replay, cancel, deadlines) and `head_engines` (prompts, KV budgets and
engine heads, built by `engine.assembly` as the simulator builds them).

Sockets: `ctrl` (ROUTER, bound at `head`): every stage's and client's DEALER; `ret` (PULL, bound at
port + 1): hidden states coming back from the last stage; `to_stage1` (PUSH): segments into the
pipeline; `monitor`: the ROUTER's socket events (a closed connection ends its peer at once). One
poll loop owns the sockets; the engine's work (a turn of every running request, starting queued ones)
runs on a compute thread while the loop waits and keeps heartbeating (daemon/beating.py), so a long
draft prefill is not mistaken for a dead head. The two never run the engine at once; their sends on
the control socket share a lock.

Robustness: every inbound message is decoded defensively (a malformed one is logged and dropped, a
client gets an ErrorReply); peers that speak another major version or lack the cluster's keys are
refused without touching the requests in flight; a lost stage pauses the request in flight until its
slot is filled again (see `requests.py`); an unexpected error while handling one message fails at most
that message's request.
"""
from __future__ import annotations

import logging
import threading
import time

import psutil
import zmq
from zmq.utils.monitor import parse_monitor_message

from flowedge.daemon import memdebug, wire
from flowedge.daemon.beating import BeatingWorker
from flowedge.daemon.config import NodeConfig, flowedge_home, split_addr, tcp
from flowedge.daemon.connections import ConnectionTracker
from flowedge.daemon.membership import ClientGone, Membership, Peer, StageLost
from flowedge.daemon.plan import Replanner, prepare_plan
from flowedge.daemon.droplog import DropLog
from flowedge.daemon.head_engines import HeadEngines
from flowedge.daemon.requests import HeadRequests
from flowedge.daemon.sd_notify import Notifier
from flowedge.engine.events import Segment, Send
from flowedge.engine.jobs import Limits
from flowedge.errors import ConfigError, ProtocolError
from flowedge.transport import protocol as proto
from flowedge.transport.channel import answer_hello, send_routed
from flowedge.transport.security import Security
from flowedge.transport.validate import InvalidMessage

log = logging.getLogger(__name__)

_HANDSHAKE_FAILED = (zmq.EVENT_HANDSHAKE_FAILED_AUTH | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
                     | zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL)


class HeadNode:
    def __init__(self, config: NodeConfig, stop: threading.Event | None = None) -> None:
        if config.role != "head":
            raise ConfigError("HeadNode needs role = 'head'")
        self.config = config
        self.stop = stop or threading.Event()
        self.node_id = config.name
        self.host, self.port = split_addr(config.head)
        self.ctx = zmq.Context()
        self.security = Security.start(self.ctx, config.keys_path, config.insecure)
        self.ctrl = self._bind(zmq.ROUTER, self.port)
        self.ret = self._bind(zmq.PULL, self.port + 1)
        self.monitor = self.ctrl.get_monitor_socket(_HANDSHAKE_FAILED | zmq.EVENT_ACCEPTED | zmq.EVENT_DISCONNECTED)
        self.connections = ConnectionTracker()
        self.to_stage1: zmq.Socket | None = None
        self.stage1: bytes | None = None   # identity the to_stage1 socket was made for
        self.members = Membership(config, self._send)
        self.members.replanner = Replanner(config, flowedge_home())   # the split for the devices that joined
        self.members.on_new_plan = self._use_plan
        self.drops = DropLog(log)      # messages dropped at the boundary, counted for `flowedge status`
        self.engines = HeadEngines(config, self.members, self.drops)
        self.requests = HeadRequests(self.engines, self, Limits(
            recovery_s=config.recovery_s, stall_s=config.stall_timeout_s, max_running=config.max_concurrent))
        self.was_ready = False
        self.shutdown_cluster = False
        self.wire = wire.WireCounter(curve=not config.insecure)   # data plane: segments and prune sets
        self.notifier = Notifier()   # systemd: READY once the plan is ready and the sockets listen
        self.compute = BeatingWorker("head-compute")   # engine turns, heartbeats going on meanwhile
        self.ctrl_lock = threading.Lock()   # the control socket's sends: the loop's pings, the turn's sends
        self.judged_s = time.monotonic()   # when liveness was last judged (on an emptied control socket)
        self.announcer = None   # mDNS, once the plan is ready (run)

    def _bind(self, kind: int, port: int) -> zmq.Socket:
        sock = self.ctx.socket(kind)
        sock.linger = 0
        if kind == zmq.ROUTER:
            sock.router_mandatory = True   # a send to a vanished peer raises instead of vanishing
        self.security.server(sock)
        try:
            sock.bind(tcp("*" if self.host in ("0.0.0.0", "*") else self.host, port))
        except zmq.ZMQError as err:
            raise ConfigError(f"cannot listen on {self.host}:{port}: {err} (is another head running?)") from None
        return sock

    # ---- lifecycle ------------------------------------------------------------------------------
    def run(self) -> None:
        memdebug.install()   # FLOWEDGE_MEMDEBUG: where the head's memory goes (daemon/memdebug.py)
        try:
            log.info("head %s listening on %s (pipeline return on port %d)%s", self.node_id, self.config.head,
                     self.port + 1, "" if self.config.insecure else ", CurveZMQ on")
            plan = self.members.plan = prepare_plan(self.config, flowedge_home())
            self._use_plan(plan)
            log.info("plan: %d stages, layers %s; waiting for stages to join",
                     self.config.stages, [list(r) for r in plan.ranges])
            self.members.assign_all()
            self._announce()
            self.notifier.ready(self.sd_status())
            self._loop()
        finally:
            self.notifier.stopping()
            if self.shutdown_cluster:   # `flowedge down`; a plain head restart leaves stages to rejoin
                self._shutdown_stages("cluster shutdown requested")
            self.close()

    def _announce(self) -> None:
        """Tell the LAN where this head is (mDNS), unless told not to; a failure there is not fatal:
        stages can still be given the address."""
        if not self.config.discovery:
            return
        from flowedge.daemon.discovery import Announcer
        try:
            self.announcer = Announcer(self.config.cluster, self.host, self.port, self.config.model)
        except (OSError, ImportError) as err:
            log.warning("discovery: cannot announce on the LAN (%s); stages need `flowedge join %s`",
                        err, self.config.head)

    def close(self) -> None:
        if self.announcer is not None:
            self.announcer.close()
        for sock in (self.ctrl, self.ret, self.to_stage1, self.monitor):
            if sock is not None:
                sock.close(0)
        self.security.stop()
        self.members.replanner.close()
        self.ctx.term()
        self.compute.close()

    def _loop(self) -> None:
        poller = zmq.Poller()
        for sock in (self.ctrl, self.ret, self.monitor):
            poller.register(sock, zmq.POLLIN)
        while not self.stop.is_set():
            ready = dict(poller.poll(0 if self.requests.has_work() else 50))
            emptied = True
            if self.monitor in ready:   # first: a closed connection ends its peers before anything else
                emptied &= self._drain(self.monitor, self._on_monitor)
            if self.ret in ready:
                self._drain(self.ret, self._on_return)
            if self.ctrl in ready:
                emptied &= self._drain(self.ctrl, self._on_ctrl)
            self._judge_liveness(emptied)
            self._engine_turn()
            self._housekeeping()
            self.drops.tick()
            self.notifier.tick(self.sd_status)

    def _drain(self, sock: zmq.Socket, handler, limit: int = 64) -> bool:
        """Up to `limit` messages; whether the socket was read empty."""
        for _ in range(limit):
            try:
                frames = sock.recv_multipart(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                return True
            handler(frames)
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
        ready = self.members.cluster_ready()
        if not self.requests.pending():
            self.requests.tick(time.monotonic(), ready)   # nothing to run: no need for the thread
            return
        clients, status = self.requests.busy_clients(), self.sd_status()

        def beat() -> None:   # reads nothing the turn changes
            self.members.ping(clients)
            self.notifier.tick(lambda: status)

        def turn() -> None:
            self.requests.step(time.monotonic())
            self.requests.tick(time.monotonic(), ready)

        self.compute.run(turn, beat, self.config.heartbeat_ms / 1000 / 2, give_up_s=self.config.stall_timeout_s)

    # ---- control plane --------------------------------------------------------------------------
    def _on_ctrl(self, frames: list) -> None:
        identity, body = frames[0].bytes, frames[1:]
        if not body:
            return
        if not self.connections.knows(identity):   # its connection's ACCEPTED is in the monitor by now
            while not self._drain(self.monitor, self._on_monitor):
                pass
        if not self.connections.bind(frames[0].get(zmq.SRCFD), identity):
            return   # from a connection already closed: nobody to answer
        peer = self.members.seen(identity)
        if peer is None:
            try:
                hello = answer_hello(self.ctrl, identity, body, self.members.welcome(), self.members.admit)
            except zmq.ZMQError:   # the peer hung up before our answer
                return
            if hello is not None:
                self._events(self.members.register(identity, hello))
            return
        try:
            msg = proto.decode(body)
        except ProtocolError as err:
            self.drops.drop("malformed", f"from {peer.name}: {err}")
            if peer.hello.role == "client":
                self._send(identity, proto.ErrorReply(request_id=0, message=f"malformed message: {err}"))
            return
        handler = {
            proto.Heartbeat: self.members.on_heartbeat, proto.Ready: self.members.on_ready,
            proto.ShardRequest: self.members.on_shard_request, proto.PromptRequest: self._on_prompt,
            proto.Cancel: self._on_cancel, proto.StatusRequest: self._on_status, proto.Shutdown: self._on_shutdown,
            proto.Hello: self._on_hello_again, proto.Refuse: self.members.on_refuse,
        }.get(type(msg))
        if handler is None:
            log.warning("ignoring %s from %s", msg.TYPE, peer.name)
            return
        handler(peer, msg)

    def _use_plan(self, plan) -> None:
        """The first plan, or a re-plan for the devices that joined: fresh engines and draft batcher."""
        self.requests.use_handlers(self.engines.use_plan(plan))

    def _on_hello_again(self, peer: Peer, msg: proto.Hello) -> None:
        self._send(peer.identity, self.members.welcome())

    def _on_status(self, peer: Peer, msg: proto.StatusRequest) -> None:
        self._send(peer.identity, proto.StatusReply(nodes=self.status()))

    def _on_shutdown(self, peer: Peer, msg: proto.Shutdown) -> None:
        log.info("shutdown requested by %s%s", peer.name, f": {msg.reason}" if msg.reason else "")
        self.shutdown_cluster = True
        self.stop.set()

    def _on_prompt(self, peer: Peer, msg: proto.PromptRequest) -> None:
        if peer.hello.role != "client":
            log.warning("prompt from non-client %s ignored", peer.name)
            return
        self.requests.submit(peer.identity, msg, time.monotonic(), self.members.cluster_ready(),
                             self.members.missing())

    def _on_cancel(self, peer: Peer, msg: proto.Cancel) -> None:
        self.requests.cancel(peer.identity, msg.request_id)

    def _on_monitor(self, frames: list) -> None:
        """Connections accepted and closed (connections.py ties them to peer identities), refused handshakes."""
        event = recv_monitor_message_from(frames)
        if event["event"] in (zmq.EVENT_ACCEPTED, zmq.EVENT_DISCONNECTED):
            track = self.connections.accepted if event["event"] == zmq.EVENT_ACCEPTED else self.connections.closed
            for identity in track(event["value"]):
                self._events(self.members.on_disconnect(identity))
            return
        log.warning("refused a connection from %s: CurveZMQ handshake failed (event %s) — a node without "
                    "this cluster's keys, or one running --insecure", event.get("endpoint", b"?"),
                    event.get("event"))

    def _events(self, events: list) -> None:
        """Membership events into the request lifecycle."""
        for ev in events:
            if isinstance(ev, StageLost):
                self.requests.stage_lost(ev.describe(), time.monotonic())
            elif isinstance(ev, ClientGone):
                self.requests.client_gone(ev.identity, ev.why)

    def sd_status(self) -> str:
        """The one-line STATUS= systemd shows: stages ready, requests queued and running."""
        m = self.members
        ready = sum(1 for i in m.stage_identities() if m.peers[i].ready)
        running = len(self.requests.running)
        return (f"{'serving' if m.cluster_ready() else 'waiting for stages'}, {ready}/{self.config.stages} "
                f"stages ready, {self.requests.pending() - running} queued, {running} running")

    def status(self) -> list[dict]:
        me = psutil.Process()
        return [{
            "node_id": self.node_id, "role": "head", "address": self.config.head, "stage": 0,
            "layers": "embed+head", "model": self.config.model, "draft": self.config.draft,
            "draft_quant": self.config.draft_quant,
            "device": self.config.device, "rss_bytes": me.memory_info().rss,
            "load": round(me.cpu_percent(None) / 100, 3), "last_seen_s": 0.0,
            "ready": self.members.cluster_ready(), "plan_ready": self.engines.plan is not None,
            "queue": self.requests.pending(), "strategy": self.config.strategy, "wire": self.wire.snapshot(),
            "served": dict(self.requests.served), "last_request": self.requests.last_stats,
            "requests": self.requests.live(time.monotonic()),
            "dropped": self.drops.snapshot(), "auto": self.requests.last_auto,
            "draft_batching": self.engines.batcher.counts() if self.engines.batcher is not None else None,
            "turn_ms_longest": round(1000 * self.compute.longest_s, 3),
        }] + self.members.status_rows()

    # ---- the request lifecycle's way out -------------------------------------------------------------
    def to_client(self, identity: bytes, msg: proto.Message) -> None:
        self._send(identity, msg)

    def to_stages(self, action: Send) -> None:
        msg = wire.to_wire(action.message, self.config.wire_dtype)
        if isinstance(action.message, Segment):
            self._to_stage1(msg)
            return
        identity = self.members.stage_identity(action.to)
        if identity is not None:
            self._send(identity, msg, counted=True)

    def reset_stages(self, engine_id: int) -> None:
        for identity in self.members.stage_identities():
            self._send(identity, proto.Reset(request_id=engine_id))

    def _to_stage1(self, msg: proto.Message) -> None:
        identity = self.members.stage_identity(1)
        if identity != self.stage1:   # a new stage 1 (or none): drop whatever was queued for the old one
            if self.to_stage1 is not None:
                self.to_stage1.close(0)
                self.to_stage1 = None
            self.stage1 = identity
            if identity is not None:
                self.to_stage1 = self.ctx.socket(zmq.PUSH)
                self.to_stage1.linger = 0
                self.to_stage1.sndtimeo = 0   # never block the loop on a dead stage 1
                self.security.client(self.to_stage1)
                self.to_stage1.connect(self.members.stage1_addr())
        if self.to_stage1 is None:
            return
        try:
            self.wire.send(self.to_stage1, msg)
        except zmq.Again:
            log.warning("stage 1 is not taking segments; liveness will deal with it")

    # ---- data plane and liveness ----------------------------------------------------------------
    def _on_return(self, frames: list) -> None:
        """A segment back from the last stage: queued on its request; checked when a step takes it."""
        try:
            msg = proto.decode(frames)
            if not isinstance(msg, proto.Segment):
                raise InvalidMessage("unexpected_type", f"{msg.TYPE} on the pipeline return port")
        except InvalidMessage as err:
            self.drops.drop(err.rule, f"pipeline return: {err}")
            return
        except ProtocolError as err:
            self.drops.drop("malformed", f"pipeline return: {err}")
            return
        self.requests.add_segment(msg.request_id, msg, time.monotonic())

    def _housekeeping(self) -> None:
        if self.members.replanner.busy:
            self.members.assign_all()
        self.members.ping(self.requests.busy_clients())
        self.members.retry_refused()
        ready = self.members.cluster_ready()
        if ready != self.was_ready:
            log.info("cluster %s", "ready: accepting prompts" if ready else "not ready")
            self.was_ready = ready

    def _send(self, identity: bytes, msg: proto.Message, counted: bool = False) -> None:
        """To one peer over the control socket; `counted` adds it to the data-plane byte counters."""
        try:
            with self.ctrl_lock:
                if counted:
                    self.wire.send(self.ctrl, msg, identity)
                else:
                    send_routed(self.ctrl, identity, msg)
        except zmq.ZMQError as err:   # EHOSTUNREACH: the peer disconnected; liveness deals with it
            log.debug("send to %r failed: %s", identity, err)

    def _shutdown_stages(self, reason: str) -> None:
        for identity in self.members.stage_identities():
            self._send(identity, proto.Shutdown(reason=reason))
        time.sleep(0.05)   # let the Shutdown messages leave before the sockets close


def recv_monitor_message_from(frames: list) -> dict:
    """Parse a socket-monitor message already received as frames (zmq.utils.monitor's layout)."""
    return parse_monitor_message([f.bytes if hasattr(f, "bytes") else f for f in frames])

