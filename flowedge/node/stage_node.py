"""A stage node: joins the head, gets its layer range and shard, then runs the stage worker on sockets.

Endpoints (on the link `roots.build_stage` opened): `ctrl` (DEALER -> head ROUTER: handshake,
assignment, shard chunks, prune sets, resets, heartbeats), `data_in` (INBOUND, listening here:
segments from the previous hop), `data_out` (OUTBOUND to the next stage's data_in, or to the head's
return port for the last stage). The stage worker state machine (flowedge.engine.stage_worker) keeps
prune sets and segments in order whatever endpoint they came in on, so the two need no coordination.

Lifecycle: JOIN (HELLO until WELCOME) -> wait ASSIGN -> shard (local, cache or fetch) -> load -> READY
-> serve. If the head goes silent for `stage_timeout_s` the node goes back to JOIN (the head may have
restarted); a SHUTDOWN ends it. An ASSIGN the node cannot carry out (a shard that fails its checksum
or cannot be fetched, a layer range the shard lacks, a load error) is answered with a REFUSE naming
why; the node stays connected, unassigned, heartbeating, and takes the next ASSIGN. What it shares with
a drafter (HELLO, heartbeats, head liveness, shard chunks, systemd) is `node_base.NodeBase`'s.
"""
from __future__ import annotations

import logging
import statistics
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import psutil
import torch

from flowedge.allocator import settle
from flowedge.engine.stage_worker import StageWorker
from flowedge.errors import FlowedgeError, PeerUnreachable, ProtocolError, Rejoin
from flowedge.models.shards import Manifest
from flowedge.models.stage import StageModel, StageParts
from flowedge.node import model_check, shard_fetch, wire
from flowedge.node import node_base
from flowedge.node.node_base import HELLO_MAX_WAIT_S, NodeBase, NodeParts
from flowedge.node.node_config import NodeConfig
from flowedge.node.stage_inbox import StageInbox, plan_for
from flowedge.transport import protocol as proto
from flowedge.transport.addresses import tcp
from flowedge.transport.link import Endpoint, Inbound, Kind

log = logging.getLogger(__name__)

MAX_BATCH_MESSAGES = 256   # most messages taken off the sockets for one batched step


@dataclass
class StageNodeParts(NodeParts):
    """What a stage runs with, built from the config by `roots.build_stage`."""
    data_in: Endpoint      # INBOUND: segments (and prune sets) from the previous hop
    data_addr: str         # where the previous hop reaches `data_in` (announced in HELLO)


class StageNode(NodeBase):
    ROLE = "stage"
    FETCHING = "the shard fetch"

    def __init__(self, config: NodeConfig, parts: StageNodeParts, stop: threading.Event | None = None) -> None:
        super().__init__(config, parts, stop)
        self.data_in, self.data_addr = parts.data_in, parts.data_addr
        self.data_out: Endpoint | None = None
        self.assign: proto.Assign | None = None
        self.worker: StageWorker | None = None
        self.inbox: StageInbox | None = None
        self.step_s: list[float] = []
        self.wire = wire.WireCounter(curve=not config.insecure)
        self.model_sha256 = ""   # content key of the model whose layers this node holds ("": none, or unknown)

    # ---- joining --------------------------------------------------------------------------------
    def _join(self) -> None:
        """HELLO until the head answers, then wait for the assignment and get ready."""
        self.phase = f"joining the head at {self.config.head}"
        log.info("waiting for the head at %s to answer (HELLO, waiting %g s for an answer, then twice as long "
                 "each time up to %g s; start it with `flowedge serve` or `flowedge up`)", self.config.head,
                 node_base.HELLO_TIMEOUT_S, HELLO_MAX_WAIT_S)   # the wait `_hello` uses, read at the call
        welcome = self._hello(lambda: {"data_addr": self.data_addr, "want_stage": self._slot(),
                                       "cached_shards": shard_fetch.cached_shas(self.home),
                                       **model_check.held(self.model_sha256)})
        if welcome is None:
            return
        log.info("joined head %s at %s; data port %s", welcome.node_id, self.config.head, self.data_addr)
        while not self.stop.is_set():
            msg = self._recv_ctrl(0.2)
            if isinstance(msg, proto.Assign) and self._take(msg):
                return
            if isinstance(msg, proto.Refuse):   # our slot went to another node (we could not serve it)
                raise Rejoin(f"the head gave this node's slot away: {msg.reason}")
            self._beat()

    def _slot(self) -> int:
        """The slot to ask for: the one whose layers this node holds (a new head keeps them), else the config's."""
        return self.assign.stage_index if self.assign is not None else self.config.stage

    def _hello_refused(self, reason: str) -> None:
        """The head serves another model than the layers held here: drop them, and join holding none."""
        if model_check.is_mismatch(reason) and self.worker is not None:
            log.warning("the head serves another model than the layers this node holds (sha256 %s…): "
                        "dropping them", self.model_sha256[:12])
            self._drop_layers()

    def _drop_layers(self) -> None:
        self.assign, self.worker, self.inbox = None, None, None
        self.model_sha256 = ""

    def _welcome_ok(self, welcome: proto.Welcome) -> bool:
        why = proto.data_plane_refusal(welcome.version, "head")
        if why is None:
            return True
        log.error("refusing the head: %s", why)
        time.sleep(5.0)
        return False

    def _take(self, assign: proto.Assign) -> bool:
        """Carry out an assignment; on failure tell the head why (REFUSE) and stay up, unassigned."""
        try:
            self._apply(assign)
            return True
        except Exception as err:  # noqa: BLE001 - a bad assignment or shard must not end the node
            if self.stop.is_set():
                return False
            why = f"stage {assign.stage_index}: cannot take layers [{assign.layer_start}, {assign.layer_end}) " \
                  f"of shard {assign.shard_sha256[:12]}…: {type(err).__name__}: {err}"
            log.error("%s; waiting for another assignment", why, exc_info=not isinstance(err, FlowedgeError))
            self._drop_layers()
            self.phase = f"assignment failed: {proto.bounded(str(err), 200)}"
            self._to_head(proto.Refuse(reason=f"assignment failed: {why}"))
            return False

    def _apply(self, assign: proto.Assign) -> None:
        """Apply an assignment: (re)load the layers if the shard changed, (re)connect the next hop."""
        if self._needs_load(assign):
            self.worker = None
            self.phase = f"getting layers [{assign.layer_start}, {assign.layer_end}) of {assign.model}"
            with_head = bool(assign.head_sha256)   # last stage: also the final norm + lm_head
            t0 = time.monotonic()
            model = self._load(assign, StageParts(assign.layer_start, assign.layer_end, head=with_head))
            self.worker = StageWorker(assign.stage_index, model, 0, can_choose=with_head)
            self.model_sha256 = assign.model_sha256
            log.info("stage %d: layers [%d, %d) of %s loaded in %.1f s (rss %.0f MB)", assign.stage_index,
                     assign.layer_start, assign.layer_end, assign.model, time.monotonic() - t0,
                     psutil.Process().memory_info().rss / 1e6)
        self.assign = assign
        worker = self.worker
        assert worker is not None, "_needs_load is true while no worker is held"
        worker.index = assign.stage_index
        worker.reset()   # request ids are the head's: a (re)assignment starts them afresh
        self.inbox = StageInbox(worker, plan_for(worker, assign.hidden_wire), self.drops)
        if self.data_out is not None:
            self.data_out.close()
        self.data_out = self.link.connect(Kind.OUTBOUND, assign.next_addr or tcp(self.head_host, self.head_port + 1))
        self._to_head(proto.Ready(stage_index=assign.stage_index))
        self.phase = f"serving stage {assign.stage_index}, layers [{assign.layer_start}, {assign.layer_end})"
        self.notifier.ready(self._sd_status())
        log.info("stage %d ready; forwarding to %s", assign.stage_index, assign.next_addr or "the head")

    def _needs_load(self, assign: proto.Assign) -> bool:
        """Whether `assign` names other files (or another model: its config may differ) than those loaded."""
        held = self.assign
        return held is None or self.worker is None or \
            (assign.shard_sha256, assign.quant, assign.head_sha256, assign.model_sha256) != \
            (held.shard_sha256, held.quant, held.head_sha256, held.model_sha256)

    def _load(self, assign: proto.Assign, parts: StageParts) -> StageModel:
        """Find or fetch the assigned files and load them (the load checks their sha256), heartbeating."""
        model = self._load_fetched(assign, lambda: self._shard_dir(assign, parts.head),
                                   lambda model_dir: StageModel.load(model_dir, parts, quant=assign.quant))
        settle()   # freeze the loaded model out of the collector's passes
        return model

    def _shard_dir(self, assign: proto.Assign, with_head: bool) -> Path:
        """A directory holding this stage's verified shard (and the head file `with_head`): the head's own
        files, the cache, or a fetch."""
        model_dir = self._shard_files(assign)
        if with_head:
            self._head_file(assign, model_dir)
        return model_dir

    def _shard_files(self, assign: proto.Assign) -> Path:
        local = Path(assign.source_dir) if self.config.same_host and assign.source_dir else None
        if local is not None and (local / "manifest.json").is_file() and _holds(local, assign):
            log.info("using the head's shard files in %s (same host)", local)
            return local
        cached = shard_fetch.cached_dir(self.home, assign.shard_sha256)
        if cached is not None:
            log.info("shard %s… found in the cache (%s); not fetching", assign.shard_sha256[:12], cached)
            shard_fetch.refresh_side_files(cached, assign)
            return cached
        log.info("fetching shard %s… (%d MB) from the head", assign.shard_sha256[:12], assign.shard_bytes >> 20)
        return shard_fetch.fetch(assign, self.home, self._to_head, self._next_chunk)

    def _head_file(self, assign: proto.Assign, model_dir: Path) -> None:
        """Make sure the shard directory also holds the head file (fetched from the head if needed)."""
        if Path(assign.source_dir) == model_dir:
            return   # the head's own split directory (same host): it is there
        shard_fetch.fetch_head_file(assign, model_dir, self._to_head, self._next_chunk)

    # ---- serving --------------------------------------------------------------------------------
    def _poll(self, wait_s: float) -> None:
        if self.link.wait([self.head_link, self.data_in], wait_s):
            self._take_arrived()

    def _take_arrived(self) -> None:
        """Everything queued on both sockets, then one `receive_all`: segments of several requests that
        arrived while the last forward ran go through the next one together (dynamic batching)."""
        events: list = []
        while len(events) < MAX_BATCH_MESSAGES and not self.stop.is_set():
            got = False
            ctrl = self.head_link.next_message(0)
            if ctrl is not None:
                got = True
                msg = self._decode_ctrl(ctrl)
                if isinstance(msg, proto.Assign) and events:   # a new assignment: finish the old work first
                    self._handle_all(events)
                    events = []
                events += self._on_ctrl(msg)
            data = self.data_in.next_message(0)
            if data is not None:
                got = True
                events += self._on_data(data)
            if not got:
                break
        if events:
            self._handle_all(events)
        self._report_freed()

    def _report_freed(self) -> None:
        """Tell the head of every run this stage gave up on, so that it fails or retries it at once."""
        if self.inbox is None:
            return
        for run_id, reason in self.inbox.take_freed():
            self._to_head(proto.RequestDropped(run_id=run_id, reason=f"{self.node_id}: {reason}"))

    def _on_ctrl(self, msg: proto.Message | None) -> list:
        """Control messages are handled here; engine messages come back as events for the worker."""
        if isinstance(msg, proto.Assign):
            self._take(msg)
        elif isinstance(msg, (proto.Prune, proto.Reset, proto.Segment)):
            return self._admit(msg)
        else:
            self._on_other(msg)
        return []

    def _on_data(self, got: Inbound) -> list:
        try:
            msg = proto.decode(got.frames)
        except ProtocolError as err:
            self.drops.drop("malformed", f"data port: {err}")
            return []
        # Only segments travel hop to hop; prune sets and resets come from the head on the control
        # connection. The data port takes anyone with the cluster's keys (a client app too), so a reset
        # or prune set there would let one end, or poison the id of, another's request.
        if not isinstance(msg, proto.Segment):
            self.drops.drop("unexpected_type", f"{msg.TYPE} on the data port")
            return []
        return self._admit(msg)

    def _admit(self, msg: proto.Message) -> list:
        """The message as an engine event if it passes the boundary checks (else dropped and counted)."""
        if self.inbox is None:   # the last assignment failed: nothing to run it on
            self.drops.drop("unassigned", f"{msg.TYPE} while this node holds no layers")
            return []
        event = self.inbox.admit(msg)
        return [] if event is None else [event]

    def _handle_all(self, events: list) -> None:
        """One batched step on the compute thread; this thread heartbeats while it runs (beating.py)."""
        t0 = time.perf_counter()
        inbox, data_out = self.inbox, self.data_out
        assert inbox is not None and data_out is not None, "events are admitted only under an applied assignment"
        done = self.compute.run(lambda: inbox.run(events), lambda: self._beat(busy=True),
                                self.config.heartbeat_ms / 1000 / 2, give_up_s=self.config.stall_timeout_s)
        for out in done.sends:
            try:
                self.wire.send(data_out, out)
            except PeerUnreachable as err:   # the next hop is gone or full: the head's liveness deals with it
                self.drops.drop("next_hop_unreachable", str(err))
        dt = time.perf_counter() - t0
        self.busy_s += dt
        if done.computed:
            self.step_s.append(dt)

    def _sd_status(self) -> str:
        live = len(self.worker.slots) if self.worker is not None and self.phase.startswith("serving") else 0
        dropped = sum(self.drops.counts.values())
        return f"{self.phase}; {live} requests live, {dropped} messages dropped"

    def _stats(self) -> dict:
        recent = self.step_s[-256:]
        worker = self.worker
        return {"steps": len(self.step_s), model_check.HELD_KEY: self.model_sha256,
                "step_ms_median": round(1000 * statistics.median(recent), 3) if recent else None,
                "step_ms_longest": round(1000 * self.compute.longest_s, 3),
                "threads": torch.get_num_threads(), "wire": self.wire.snapshot(),
                "kv_tokens": worker.cached_tokens() if worker is not None else 0,
                "requests": len(worker.slots) if worker is not None else 0,
                "batched": {"forwards": worker.forwards, "requests": worker.forward_requests}
                if worker is not None else None,
                "dropped": self.drops.snapshot()}


def _holds(split_dir: Path, assign: proto.Assign) -> bool:
    """Whether the head's split directory (same host) holds the assigned shard, cut from the assigned model."""
    manifest = Manifest.load(split_dir)
    why = model_check.manifest_mismatch(manifest, assign.model_sha256)
    if why is not None:
        log.warning("not using the head's shard files in %s: %s", split_dir, why)
        return False
    return any(s.sha256 == assign.shard_sha256 for s in manifest.stages)
