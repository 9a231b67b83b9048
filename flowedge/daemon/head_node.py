"""The head node (node 0): admits stages and clients, hands out the partition plan and shards, and
drives the sans-IO engine head (`flowedge.engine.head.Head`) over real sockets.

Sockets: `ctrl` (ROUTER, bound at `head`): every stage's and client's DEALER; `ret` (PULL, bound at
port + 1): hidden states coming back from the last stage; `to_stage1` (PUSH): segments into the
pipeline. One thread, one poll loop: the engine is not thread-safe and needs none.

Robustness: every inbound message is decoded defensively (a malformed one is logged and dropped, a
client gets an ErrorReply); peers that speak another major version or lack the cluster's keys are
refused without touching the request in flight; a stage that goes silent aborts the request in
flight with a clear error, and its slot is given to whichever node joins next.
"""
from __future__ import annotations

import logging
import threading
import time
from collections import deque
from dataclasses import dataclass, field

import psutil
import torch
import zmq
from zmq.utils.monitor import recv_monitor_message

from flowedge.core.sampling import SamplingParams
from flowedge.daemon import shard_fetch, wire
from flowedge.daemon.config import NodeConfig, flowedge_home, split_addr, tcp
from flowedge.daemon.droplog import DropLog
from flowedge.daemon.plan import Plan, Replanner, prepare_plan
from flowedge.daemon.prompting import StopText, prompt_ids
from flowedge.daemon.sd_notify import Notifier
from flowedge.engine.config import SpecConfig
from flowedge.engine.events import Compute, Continue, Done, Emit, Segment, Send
from flowedge.errors import ConfigError, FlowedgeError, ProtocolError
from flowedge.transport import protocol as proto
from flowedge.transport.channel import answer_hello, send_routed
from flowedge.transport.security import Security
from flowedge.transport.validate import InvalidMessage, ReturnPlan, check_returned_segment

log = logging.getLogger(__name__)

CLIENT_IDLE_S = 3600.0


@dataclass
class Peer:
    identity: bytes
    hello: proto.Hello
    last_seen: float = field(default_factory=time.monotonic)
    stage: int = 0              # 1..S once it holds a slot of the plan
    ready: bool = False
    load: float = 0.0
    rss: int = 0
    stats: dict = field(default_factory=dict)

    @property
    def data_addr(self) -> str:
        return str(self.hello.capabilities.get("data_addr", ""))


@dataclass
class Request:
    """One prompt being served (the head serves one at a time, others wait in a queue)."""
    client: bytes
    msg: proto.PromptRequest
    engine_id: int = 0
    strategy: str = ""
    engine: object = None
    prompt_tokens: int = 0
    text: object = None        # runner.TextStream: token ids -> printable pieces
    pieces: list[str] = field(default_factory=list)
    started: float = 0.0
    last_progress: float = 0.0
    stop: StopText = field(default_factory=StopText)   # the request's stop strings over its text


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
        self.monitor = self.ctrl.get_monitor_socket(
            zmq.EVENT_HANDSHAKE_FAILED_AUTH | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
            | zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL)
        self.to_stage1: zmq.Socket | None = None
        self.stage1_addr = ""
        self.peers: dict[bytes, Peer] = {}
        self.slots: list[bytes | None] = [None] * config.stages
        self.sent_assign: dict[int, tuple[bytes, str]] = {}
        self.queue: deque[Request] = deque()
        self.active: Request | None = None
        self.last_auto: dict = {}   # the latest `auto` answer's choice, reason and switches (status)
        self.engine_ids = 0
        self.engines: dict[tuple[str, float | None], object] = {}   # (strategy, placement ratio)
        self.plan: Plan | None = None
        self.replanner = Replanner(config, flowedge_home())   # the split for the devices that joined
        self.last_ping = 0.0
        self.was_ready = False
        self.shutdown_cluster = False
        self.wire = wire.WireCounter(curve=not config.insecure)   # data plane: segments and prune sets
        self.served = {"requests": 0, "tokens": 0, "failed": 0, "cancelled": 0}   # for status / metrics
        self.last_stats: dict = {}
        self.notifier = Notifier()   # systemd: READY once the plan is ready and the sockets listen
        self.drops = DropLog(log)    # returned segments that fail the boundary checks, for status

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
        try:
            log.info("head %s listening on %s (pipeline return on port %d)%s", self.node_id, self.config.head,
                     self.port + 1, "" if self.config.insecure else ", CurveZMQ on")
            self.plan = prepare_plan(self.config, flowedge_home())
            log.info("plan: %d stages, layers %s; waiting for stages to join",
                     self.config.stages, [list(r) for r in self.plan.ranges])
            self.notifier.ready(self.sd_status())
            self._loop()
        finally:
            self.notifier.stopping()
            if self.shutdown_cluster:   # `flowedge down`; a plain head restart leaves stages to rejoin
                self._shutdown_stages("cluster shutdown requested")
            self.close()

    def close(self) -> None:
        for sock in (self.ctrl, self.ret, self.to_stage1, self.monitor):
            if sock is not None:
                sock.close(0)
        self.security.stop()
        self.replanner.close()
        self.ctx.term()

    def _loop(self) -> None:
        poller = zmq.Poller()
        for sock in (self.ctrl, self.ret, self.monitor):
            poller.register(sock, zmq.POLLIN)
        while not self.stop.is_set():
            ready = dict(poller.poll(50))
            if self.ret in ready:
                self._drain(self.ret, self._on_return)
            if self.ctrl in ready:
                self._drain(self.ctrl, self._on_ctrl)
            if self.monitor in ready:
                self._on_monitor()
            self._housekeeping()
            self.notifier.tick(self.sd_status)
            self.drops.tick()

    def _drain(self, sock: zmq.Socket, handler, limit: int = 64) -> None:
        for _ in range(limit):
            try:
                frames = sock.recv_multipart(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                return
            handler(frames)

    # ---- control plane --------------------------------------------------------------------------
    def _on_ctrl(self, frames: list) -> None:
        identity, body = frames[0].bytes, frames[1:]
        peer = self.peers.get(identity)
        if peer is None:
            try:
                hello = answer_hello(self.ctrl, identity, body, self._welcome(), self._admit)
            except zmq.ZMQError:   # the peer hung up before our answer
                return
            if hello is not None:
                self._register(identity, hello)
            return
        peer.last_seen = time.monotonic()
        try:
            msg = proto.decode(body)
        except ProtocolError as err:
            log.warning("dropped a malformed message from %s: %s", peer.hello.node_id, err)
            if peer.hello.role == "client":
                self._send(identity, proto.ErrorReply(request_id=0, message=f"malformed message: {err}"))
            return
        handler = {
            proto.Heartbeat: self._on_heartbeat, proto.Ready: self._on_ready,
            proto.ShardRequest: self._on_shard_request, proto.PromptRequest: self._on_prompt,
            proto.StatusRequest: self._on_status, proto.Shutdown: self._on_shutdown,
            proto.Hello: self._on_hello_again, proto.Cancel: self._on_cancel,
        }.get(type(msg))
        if handler is None:
            log.warning("ignoring %s from %s", msg.TYPE, peer.hello.node_id)
            return
        handler(peer, msg)

    def _welcome(self) -> proto.Welcome:
        return proto.Welcome(node_id=self.node_id, heartbeat_interval_ms=self.config.heartbeat_ms)

    def _admit(self, hello: proto.Hello) -> str | None:
        if hello.role == "head":
            return "this cluster already has a head"
        if hello.role == "stage":
            known = any(p.hello.node_id == hello.node_id for p in self.peers.values() if p.stage)
            if not known and None not in self.slots:
                return f"the plan is full ({self.config.stages} stages); stop a stage or raise `stages`"
            if not hello.capabilities.get("data_addr"):
                return "a stage must announce its data_addr"
        return None

    def _register(self, identity: bytes, hello: proto.Hello) -> None:
        peer = Peer(identity, hello)
        if hello.role == "stage":
            old = next((p for p in self.peers.values() if p.stage and p.hello.node_id == hello.node_id), None)
            if old is not None:   # the same node re-joined (restart or reconnect): it keeps its slot
                self._drop(old, "re-joined", abort=True)
            want = hello.capabilities.get("want_stage")
            free = [k for k, i in enumerate(self.slots, 1) if i is None]
            peer.stage = want if want in free else free[0]
            self.slots[peer.stage - 1] = identity
            log.info("stage %d <- %s (%s, %.1f GB free)", peer.stage, hello.node_id, hello.device,
                     hello.free_memory_bytes / 1e9)
        self.peers[identity] = peer
        self._assign_all()

    def _on_hello_again(self, peer: Peer, msg: proto.Hello) -> None:
        self._send(peer.identity, self._welcome())

    def _assign_all(self) -> None:
        """Once every slot has a node, tell each its layer range and next hop (again if that changed)."""
        if None in self.slots or self.plan is None:
            return
        plan = self.replanner.plan_for(self.plan, [self.peers[i].hello for i in self.slots])
        if plan is None:      # re-splitting for these devices; housekeeping asks again
            return
        if plan is not self.plan:
            log.info("plan: layers %s for the stages that joined", [list(r) for r in plan.ranges])
            self.plan, self.engines = plan, {}
            self.sent_assign.clear()
        for k, identity in enumerate(self.slots, start=1):
            nxt = self.peers[self.slots[k]].data_addr if k < len(self.slots) else ""
            if self.sent_assign.get(k) == (identity, nxt):
                continue
            shard = self.plan.shards[k - 1]
            a, b = self.plan.ranges[k - 1]
            head = self.plan.head_file if self._last_stage_chooses(k) else None
            self._send(identity, proto.Assign(
                stage_index=k, layer_start=a, layer_end=b, shard_sha256=shard.sha256, shard_bytes=shard.size,
                next_addr=nxt, model=self.config.model, hidden_wire=self.config.wire_dtype,
                quant=self.config.quant, side_files=shard.side_files, source_dir=str(self.plan.split_dir),
                head_sha256=head.sha256 if head else "", head_bytes=head.size if head else 0))
            self.sent_assign[k] = (identity, nxt)
            self.peers[identity].ready = False
        first = self.peers[self.slots[0]].data_addr
        if first != self.stage1_addr:
            if self.to_stage1 is not None:
                self.to_stage1.close(0)
            self.to_stage1 = self.ctx.socket(zmq.PUSH)
            self.to_stage1.linger = 0
            self.security.client(self.to_stage1)
            self.to_stage1.connect(first)
            self.stage1_addr = first

    def _on_heartbeat(self, peer: Peer, msg: proto.Heartbeat) -> None:
        peer.load, peer.rss, peer.stats = msg.load, msg.rss_bytes, dict(msg.stats)

    def _on_ready(self, peer: Peer, msg: proto.Ready) -> None:
        if msg.stage_index != peer.stage:
            log.warning("%s reported ready for stage %d but holds stage %d", peer.hello.node_id,
                        msg.stage_index, peer.stage)
            return
        peer.ready = True
        log.info("stage %d (%s) ready", peer.stage, peer.hello.node_id)

    def _last_stage_chooses(self, stage: int) -> bool:
        """The last stage holds the lm_head too (and chooses tokens for strategies that want it)."""
        return stage == self.config.stages and self.config.lm_head_at != "head"

    def _on_shard_request(self, peer: Peer, msg: proto.ShardRequest) -> None:
        if not peer.stage or self.plan is None:
            log.warning("shard request from %s, which holds no stage", peer.hello.node_id)
            return
        shard = self.plan.shards[peer.stage - 1]
        if msg.sha256 and msg.sha256 != shard.sha256:
            if not (msg.sha256 == self.plan.head_file.sha256 and self._last_stage_chooses(peer.stage)):
                log.warning("%s asked for file %s…, which is not assigned to it", peer.hello.node_id, msg.sha256[:12])
                return
            shard = self.plan.head_file
        try:
            self._send(peer.identity, shard_fetch.read_chunk(shard, msg))
        except ProtocolError as err:
            log.warning("bad shard request from %s: %s", peer.hello.node_id, err)

    def _on_status(self, peer: Peer, msg: proto.StatusRequest) -> None:
        self._send(peer.identity, proto.StatusReply(nodes=self.status()))

    def _on_shutdown(self, peer: Peer, msg: proto.Shutdown) -> None:
        log.info("shutdown requested by %s%s", peer.hello.node_id, f": {msg.reason}" if msg.reason else "")
        self.shutdown_cluster = True
        self.stop.set()

    def sd_status(self) -> str:
        """The one-line STATUS= systemd shows: stages ready, requests queued and running."""
        ready = sum(1 for i in self.slots if i is not None and i in self.peers and self.peers[i].ready)
        return (f"{'serving' if self.cluster_ready() else 'waiting for stages'}, {ready}/{self.config.stages} "
                f"stages ready, {len(self.queue)} queued, {int(self.active is not None)} running")

    def cluster_ready(self) -> bool:
        return None not in self.slots and all(self.peers[i].ready for i in self.slots)

    def status(self) -> list[dict]:
        now = time.monotonic()
        me = psutil.Process()
        nodes = [{
            "node_id": self.node_id, "role": "head", "address": self.config.head, "stage": 0,
            "layers": "embed+head", "model": self.config.model, "draft": self.config.draft,
            "draft_quant": self.config.draft_quant,
            "device": self.config.device, "rss_bytes": me.memory_info().rss,
            "load": round(me.cpu_percent(None) / 100, 3), "last_seen_s": 0.0,
            "ready": self.cluster_ready(), "plan_ready": self.plan is not None,
            "queue": len(self.queue) + (self.active is not None), "strategy": self.config.strategy,
            "wire": self.wire.snapshot(), "dropped": self.drops.snapshot(),
            "served": dict(self.served), "last_request": self.last_stats,
            "auto": self.last_auto,
        }]
        for k, identity in enumerate(self.slots, start=1):
            p = self.peers.get(identity) if identity else None
            if p is None:
                nodes.append({"node_id": "", "role": "stage", "stage": k, "ready": False, "address": "",
                              "layers": list(self.plan.ranges[k - 1]) if self.plan else [], "missing": True})
                continue
            nodes.append({
                "node_id": p.hello.node_id, "role": "stage", "stage": k, "address": p.data_addr,
                "layers": list(self.plan.ranges[k - 1]) if self.plan else [], "model": self.config.model,
                "device": p.hello.device, "free_memory_bytes": p.hello.free_memory_bytes, "rss_bytes": p.rss,
                "load": round(p.load, 3), "last_seen_s": round(now - p.last_seen, 3), "ready": p.ready,
                **{k2: v for k2, v in p.stats.items() if isinstance(v, (int, float, str, dict)) or v is None},
            })
        return nodes

    def _on_monitor(self) -> None:
        try:
            event = recv_monitor_message(self.monitor, zmq.NOBLOCK)
        except zmq.Again:
            return
        log.warning("refused a connection from %s: CurveZMQ handshake failed (event %s) — a node without "
                    "this cluster's keys, or one running --insecure", event.get("endpoint", b"?"),
                    event.get("event"))

    # ---- requests -------------------------------------------------------------------------------
    def _on_prompt(self, peer: Peer, msg: proto.PromptRequest) -> None:
        if peer.hello.role != "client":
            log.warning("prompt from non-client %s ignored", peer.hello.node_id)
            return
        if not self.cluster_ready():
            waiting = [f"stage {k}" for k, i in enumerate(self.slots, 1) if i is None or not self.peers[i].ready]
            self._send(peer.identity, proto.ErrorReply(
                request_id=msg.request_id, message=f"cluster not ready: waiting for {', '.join(waiting)}"))
            return
        self.queue.append(Request(peer.identity, msg))

    def _start_next(self) -> None:
        while self.active is None and self.queue and self.cluster_ready():
            req = self.queue.popleft()
            try:
                self._start(req)
            except FlowedgeError as err:
                self.active = None
                self._send(req.client, proto.ErrorReply(request_id=req.msg.request_id, message=str(err)))
            except Exception as err:  # noqa: BLE001 - a bug met by one request must not take the head down
                log.exception("request %s could not start", req.msg.request_id)
                self.active = None
                self._send(req.client, proto.ErrorReply(request_id=req.msg.request_id,
                                                        message=f"internal error: {type(err).__name__}: {err}"))

    def _start(self, req: Request) -> None:
        from flowedge.engine.local import check_context
        from flowedge.runner import TextStream

        m, plan = req.msg, self.plan
        params = SamplingParams(m.temperature, m.top_k or 0, m.top_p if m.top_p is not None else 1.0, m.seed)
        ids = prompt_ids(plan.tokenizer, m)
        req.stop = StopText(m.stop)
        check_context(len(ids), m.max_new_tokens, plan.base_config.max_position_embeddings)
        req.strategy = m.strategy or self.config.strategy
        req.engine = self._engine(req.strategy)
        self.engine_ids += 1
        req.engine_id = self.engine_ids
        req.prompt_tokens = len(ids)
        req.text = TextStream(plan.tokenizer, req.pieces.append)
        req.started = req.last_progress = time.monotonic()
        self.active = req
        log.info("request %d: %d prompt tokens, strategy %s, max %d new", req.engine_id, len(ids),
                 req.strategy, m.max_new_tokens)
        self._execute(req.engine.start(req.engine_id, ids, m.max_new_tokens, params))

    def _last_stage_lm_head_ratio(self) -> float | None:
        """For `lm_head_at = "auto"`: how a segment's lm_head scales on the last stage's device profile
        (named in its Hello); None when the profile is unknown (the strategy's own choice then holds)."""
        from flowedge.sim.costs import lm_head_segment_ratio
        from flowedge.sim.profiles import load_named_device

        identity = self.slots[-1]
        if identity is None:
            return None
        device = self.peers[identity].hello.device
        try:
            return lm_head_segment_ratio(load_named_device(device), self.plan.base_config, SpecConfig().l_max)
        except ConfigError:
            log.info("last stage's device %r has no profile: lm_head placement follows the strategy", device)
            return None

    def _tree_costs(self, spec: SpecConfig, stage_devices: tuple[str, ...]):
        """sim/sizing.TreeCosts from node 0's and the stages' device profiles; None where a device has none."""
        from flowedge.sim.profiles import load_device, load_named_device
        from flowedge.sim.run import draft_path_for
        from flowedge.sim.sizing import tree_costs

        names = [self.config.device, *stage_devices]
        try:   # the stages' names come off the wire: shipped profiles only
            head_dev, *stage_devs = [load_device(names[0])] + [load_named_device(n) for n in names[1:]]
        except ConfigError:
            log.info("a device in %s has no profile: no sizing or prediction from profiles", names)
            return None
        return tree_costs(self.plan.base_config, self.plan.draft_model.config, self.plan.ranges, stage_devs,
                          head_dev, draft_path=draft_path_for(head_dev), l_max=spec.l_max, topk=spec.topk,
                          draft_quantized=self.config.draft_quant != "none")

    def _sized(self, spec: SpecConfig, strat, costs) -> SpecConfig:
        """For `tree_size = "profile"`: flowspec's initial tree sized from node 0's and the stages' device
        profiles, as on the simulator (sim/sizing.py); `spec` unchanged where a device has no profile."""
        from flowedge.sim.sizing import sized_spec_for

        if self.config.tree_size != "profile" or self.config.tree_nodes or costs is None or \
                not getattr(strat, "sizes_from_costs", False):
            return spec
        sized = sized_spec_for(spec, costs)
        log.info("flowspec's first tree sized from the profiles: depth %d, %d nodes, draft calls %d wide "
                 "(pipeline %.1f ms, draft call %.1f ms, stage segment x%.2f)", sized.tree_depth,
                 sized.tree_nodes, sized.draft_width, 1e3 * costs.pipeline_latency_s, 1e3 * costs.draft_call_s,
                 costs.stage_segment_ratio)
        return sized

    def _engine(self, strategy: str):
        """The engine head for a strategy (built once per set of stage devices, reused across requests)."""
        ratio = self._last_stage_lm_head_ratio() if self.config.lm_head_at == "auto" else None
        devices = tuple(self.peers[i].hello.device for i in self.slots if i is not None)
        key = (strategy, ratio, devices)
        if key not in self.engines:
            from flowedge.engine.drafter import Drafter
            from flowedge.engine.head import Head
            from flowedge.engine.local import stop_ids
            from flowedge.engine.strategies import make_strategy
            from flowedge.engine.strategies.auto import Auto
            from flowedge.sim.sizing import predict_from_costs

            strat = make_strategy(strategy)
            if strat.needs_draft and self.plan.draft_model is None:
                raise ConfigError(f"strategy {strategy} needs a draft model; this head runs without one")
            drafter = Drafter(self.plan.draft_model) if strat.needs_draft else None
            spec = SpecConfig().with_(tree_nodes=self.config.tree_nodes or None, lm_head_at=self.config.lm_head_at,
                                      lookup_tokens=self.config.lookup_tokens)
            if drafter is not None:
                costs = self._tree_costs(spec, devices)
                spec = self._sized(spec, strat, costs)
                if isinstance(strat, Auto) and costs is not None:
                    strat.prediction = predict_from_costs(costs)
            self.engines[key] = Head(self.plan.head_model, drafter, strat, self.config.stages, spec,
                                     stop_ids(self.plan.base_config), lm_head_at=spec.lm_head_for(strat, ratio))
        return self.engines[key]

    def _on_return(self, frames: list) -> None:
        try:
            msg = proto.decode(frames)
        except ProtocolError as err:
            log.warning("dropped a malformed pipeline message: %s", err)
            return
        if not isinstance(msg, proto.Segment):
            log.warning("ignoring %s on the pipeline return port", msg.TYPE)
            return
        req = self.active
        if req is None or msg.request_id != req.engine_id:
            return   # output of an aborted or finished request
        if not self._returned_ok(req, msg):
            return
        req.last_progress = time.monotonic()
        self._execute(req.engine.receive(wire.segment_from_wire(msg, self.plan.head_model.dtype)))

    def _returned_ok(self, req: Request, msg: proto.Segment) -> bool:
        """Boundary check of a returned segment (transport/validate.py): ids the head sent this round, a
        payload it can read. A bad one is dropped and counted; it never reaches the engine."""
        engine = req.engine
        if msg.kind != "prefill" and msg.round_id != getattr(engine, "round_id", None):
            return True   # a finished round's output: the engine drops it itself
        config = self.plan.head_model.config
        known = int(getattr(engine, "alive", torch.empty(0)).numel())
        try:
            check_returned_segment(msg, ReturnPlan(hidden_size=config.hidden_size, vocab_size=config.vocab_size),
                                   known)
        except InvalidMessage as err:
            self.drops.drop(err.rule, f"returned segment of request {msg.request_id}: {err}")
            return False
        return True

    def _execute(self, actions: list) -> None:
        req = self.active
        for a in actions:
            if self.active is not req:
                return   # finished, stopped or cancelled by an earlier action of this batch
            if isinstance(a, Send):
                msg = wire.to_wire(a.message, self.config.wire_dtype)
                if isinstance(a.message, Segment):
                    self.wire.send(self.to_stage1, msg)
                else:
                    identity = self.slots[a.to - 1]
                    if identity is not None:
                        self._send(identity, msg, counted=True)
            elif isinstance(a, Emit):
                req.text(a.tokens)
                self._send(req.client, proto.TokenChunk(request_id=req.msg.request_id,
                                                        token_ids=list(a.tokens),
                                                        text=req.stop.feed(self._pieces(req)), done=False))
                if req.stop.hit:   # a stop string: the answer ends here, the stages drop its KV
                    self._finish(req, Done(list(req.engine.outputs), req.engine.stats))
                    self._reset_stages(req.engine_id)
            elif isinstance(a, Continue):
                self._execute(req.engine.receive(a.event))
            elif isinstance(a, Done):
                self._finish(req, a)
            elif not isinstance(a, Compute):
                log.warning("unhandled engine action %r", a)

    @staticmethod
    def _pieces(req: Request) -> str:
        """Text produced since the last chunk (TextStream holds back a split UTF-8 character)."""
        piece = "".join(req.pieces)
        req.pieces.clear()
        return piece

    def _flushed(self, req: Request) -> str:
        req.text.flush()
        return self._pieces(req)

    def _finish(self, req: Request, done: Done) -> None:
        wall = time.monotonic() - req.started
        st = done.stats
        n = len(done.token_ids)
        stats = {
            "strategy": req.strategy, "prompt_tokens": req.prompt_tokens, "new_tokens": n,
            "wall_s": round(wall, 4), "tokens_per_s": round(n / wall, 3) if wall > 0 else None,
            "steps": st.steps, "rounds": st.rounds, "round_restarts": max(0, st.rounds - 1),
            "nodes": self.config.stages + 1, "wire_dtype": self.config.wire_dtype,
            "head_overhead_ms_per_step": round(1000 * sum(st.overhead_s) / max(1, len(st.overhead_s)), 3),
            "lm_head_at": req.engine.lm_head_at, "stage_chosen_tokens": st.stage_chosen,
            "tree_depth": req.engine.config.tree_depth, "tree_nodes": req.engine.config.tree_nodes,
            "finish_reason": "stop" if req.stop.hit or n < req.msg.max_new_tokens else "length",
        }
        if st.accept_lens:
            stats["mean_accept_len"] = round(sum(st.accept_lens) / len(st.accept_lens), 4)
            stats["verifications"] = len(st.accept_lens)
        if st.auto:   # strategy auto: what it chose and why (also shown by `status`)
            stats["auto"] = self.last_auto = st.auto
        self._send(req.client, proto.TokenChunk(request_id=req.msg.request_id,
                                                token_ids=(),
                                                text=req.stop.finish(self._flushed(req)), done=True, stats=stats))
        log.info("request %d done: %d tokens in %.2f s (%.2f tok/s)", req.engine_id, n, wall,
                 n / wall if wall else 0.0)
        self.active = None
        self.served["requests"] += 1
        self.served["tokens"] += n
        self.last_stats = stats

    def _abort(self, why: str) -> None:
        req, self.active = self.active, None
        if req is None:
            return
        log.error("request %d aborted: %s", req.engine_id, why)
        self.served["failed"] += 1
        self._send(req.client, proto.ErrorReply(request_id=req.msg.request_id, message=f"request aborted: {why}"))
        self._reset_stages(req.engine_id)

    def _reset_stages(self, engine_id: int) -> None:
        """Every stage drops what it holds for the request (KV cache, tree)."""
        for identity in self.slots:
            if identity is not None:
                self._send(identity, proto.Reset(request_id=engine_id))

    def _on_cancel(self, peer: Peer, msg: proto.Cancel) -> None:
        """The client gave up on a request: drop it from the queue, or stop it and free its KV."""
        mine = lambda r: r.client == peer.identity and r.msg.request_id == msg.request_id  # noqa: E731
        queued = len(self.queue)
        self.queue = deque(r for r in self.queue if not mine(r))
        req = self.active
        if req is not None and mine(req):
            self.active = None
            self._reset_stages(req.engine_id)
            log.info("request %d cancelled by its client %s", req.engine_id, peer.hello.node_id)
        elif len(self.queue) < queued:
            log.info("a queued request of %s cancelled by its client", peer.hello.node_id)
        else:
            return
        self.served["cancelled"] += 1

    # ---- liveness -------------------------------------------------------------------------------
    def _housekeeping(self) -> None:
        now = time.monotonic()
        if self.replanner.busy:
            self._assign_all()
        if now - self.last_ping >= self.config.heartbeat_ms / 1000:
            self.last_ping = now
            beat = proto.Heartbeat(node_id=self.node_id, load=0.0, rss_bytes=0)
            for identity in self.slots:
                if identity is not None:
                    self._send(identity, beat)
        for peer in list(self.peers.values()):
            silent = now - peer.last_seen
            if peer.stage and silent > self.config.stage_timeout_s:
                self._drop(peer, f"silent for {silent:.0f} s", abort=True)
            elif peer.hello.role == "client" and silent > CLIENT_IDLE_S and (
                    self.active is None or self.active.client != peer.identity):
                self.peers.pop(peer.identity, None)
        if self.active is not None and now - self.active.last_progress > self.config.stage_timeout_s:
            self._abort(f"the pipeline returned nothing for {self.config.stage_timeout_s:.0f} s")
        ready = self.cluster_ready()
        if ready != self.was_ready:
            log.info("cluster %s", "ready: accepting prompts" if ready else "not ready")
            self.was_ready = ready
        self._start_next()

    def _drop(self, peer: Peer, why: str, abort: bool) -> None:
        self.peers.pop(peer.identity, None)
        if peer.stage:
            log.error("stage %d (%s) %s: dropped; waiting for a node to take its place", peer.stage,
                      peer.hello.node_id, why)
            self.slots[peer.stage - 1] = None
            self.sent_assign.pop(peer.stage, None)
            if abort and self.active is not None:
                self._abort(f"stage {peer.stage} ({peer.hello.node_id}) {why}")

    def _send(self, identity: bytes, msg: proto.Message, counted: bool = False) -> None:
        """To one peer over the control socket; `counted` adds it to the data-plane byte counters."""
        try:
            if counted:
                self.wire.send(self.ctrl, msg, identity)
            else:
                send_routed(self.ctrl, identity, msg)
        except zmq.ZMQError as err:   # EHOSTUNREACH: the peer disconnected; liveness deals with it
            log.debug("send to %r failed: %s", identity, err)

    def _shutdown_stages(self, reason: str) -> None:
        for identity in self.slots:
            if identity is not None:
                self._send(identity, proto.Shutdown(reason=reason))
        time.sleep(0.05)   # let the Shutdown messages leave before the sockets close
