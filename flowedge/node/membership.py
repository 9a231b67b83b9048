"""Who is in the cluster: peers (stages and clients), the plan's stage slots, heartbeats and liveness,
assignments and shard serving. No sockets here: messages leave through the `send` callable the head
gives, and what the request lifecycle must know (a stage lost, a client gone) comes out as events.

Liveness (the ZeroMQ Guide's Paranoid Pirate, both ways): the head pings every stage and every client
with work in progress each `heartbeat_ms`; a peer is alive while it was heard from within
`stage_timeout_s` (= heartbeat_ms x liveness count, 500 ms x 4 by default; a stage still loading its
layers gets longer) or, for a client, `client_timeout_s`. A closed connection (the ROUTER's socket monitor:
`on_disconnect`) ends a peer at once, without waiting for its heartbeats to run out.

The slot rule: a stage's slot belongs to the connection that took it. A HELLO from another connection
with the same node id is refused while that connection is alive; it is accepted (and takes the slot
over) once the old connection has closed or has been silent past its liveness. So a key holder cannot
take over a live stage, while a restarted stage (whose old connection is gone) gets its slot back.
"""
from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from flowedge.errors import ProtocolError, StageLost
from flowedge.node import draft_members, model_check, shard_fetch
from flowedge.node.droplog import DropLog
from flowedge.node.link_rtt import RttProbe, RttSamples
from flowedge.node.node_config import NodeConfig
from flowedge.node.peer_stats import clean_stats
from flowedge.transport import protocol as proto

if TYPE_CHECKING:
    from flowedge.node.partition_plan import Plan

log = logging.getLogger(__name__)

ASSIGN_RETRY_S = 10.0      # a stage that could not take its assignment is sent it again after this
CLIENT_IDLE_S = 3600.0   # an idle client (nothing in progress) is forgotten after this long
LOADING_SILENCE_S = 600.0   # a stage loading its layers cannot heartbeat; past this it is hung
MAX_DRAFTERS = 16          # drafters joined at once: each is a row of `status` (and jobs to share out)
MAX_ADDR_CHARS = 256       # a stage's data address ("tcp://host:port"), shown in `status`


@dataclass
class Peer:
    identity: bytes
    hello: proto.Hello
    last_seen: float
    stage: int = 0              # 1..S once it holds a slot of the plan
    ready: bool = False
    assign_error: str = ""      # why this stage refused its last assignment (shown in status)
    retry_at: float = 0.0       # when to send it the assignment again (0: not waiting)
    load: float = 0.0
    rss: int = 0
    stats: dict = field(default_factory=dict)
    rtt: RttSamples = field(default_factory=RttSamples)   # the link's round trips (link_rtt.py)

    @property
    def data_addr(self) -> str:
        return str(self.hello.capabilities.get("data_addr", ""))

    @property
    def drafter(self) -> bool:
        """A drafter node (pre-drafts for node 0; holds no stage slot)."""
        return self.hello.role == "drafter"

    @property
    def judged_like_a_stage(self) -> bool:
        return bool(self.stage) or self.drafter

    @property
    def name(self) -> str:
        return self.hello.node_id


@dataclass(frozen=True, slots=True)
class DrafterLost:
    """A drafter disconnected or went silent: its outstanding jobs are answered `None` (node 0 drafts alone)."""
    identity: bytes
    name: str
    why: str


@dataclass(frozen=True, slots=True)
class ClientGone:
    """A client disconnected or went silent while it had work in progress."""
    identity: bytes
    why: str


class Membership:
    def __init__(self, config: NodeConfig, send: Callable[[bytes, proto.Message], None],
                 clock: Callable[[], float] = time.monotonic, replanner=None, drops: DropLog | None = None) -> None:
        """`drops`: where peer input this drops is counted (heartbeat stats the schema refuses)."""
        self.config, self.send, self.clock = config, send, clock
        self.drops = drops or DropLog(log)
        self.node_id = config.name
        self.plan: Plan | None = None           # once prepared; replaced by a re-plan
        self.replanner = replanner             # partition_plan.Replanner: re-splits for the devices that joined
        self.peers: dict[bytes, Peer] = {}
        self.slots: list[bytes | None] = [None] * config.stages
        self.sent_assign: dict[int, tuple[bytes, str]] = {}
        self.last_ping = 0.0
        self.rtt = RttProbe(clock)

    # ---- joining ----------------------------------------------------------------------------------
    def welcome(self) -> proto.Welcome:
        return proto.Welcome(node_id=self.node_id, heartbeat_interval_ms=self.config.heartbeat_ms)

    def holder(self, node_id: str) -> Peer | None:
        """The stage peer holding a slot under `node_id`."""
        return next((p for p in self.peers.values() if p.stage and p.hello.node_id == node_id), None)

    def alive(self, peer: Peer, now: float | None = None) -> bool:
        """Heard from within its liveness. A stage that is not ready yet (fetching or loading its shard,
        which blocks its loop) gets LOADING_SILENCE_S; a closed connection ends it earlier anyway."""
        if peer.judged_like_a_stage:
            limit = self.config.stage_timeout_s if peer.ready or peer.drafter else LOADING_SILENCE_S
        else:
            limit = self.config.client_timeout_s
        return (self.clock() if now is None else now) - peer.last_seen <= limit

    def admit(self, hello: proto.Hello) -> str | None:
        """Why a HELLO is refused (None: welcome it)."""
        if hello.role == "head":
            return "this cluster already has a head"
        if hello.role == "drafter":
            return self._admit_drafter(hello)
        if hello.role != "stage":
            return None
        if (why := proto.data_plane_refusal(hello.version, "stage")) is not None:
            return why
        old = self.holder(hello.node_id)
        if old is not None and self.alive(old):
            return (f"node id {hello.node_id!r} holds stage {old.stage} on a live connection; a node rejoins "
                    f"under its id once that connection has closed or been silent for "
                    f"{self.config.stage_timeout_s:g} s")
        if old is None and None not in self.slots and self.refused() is None:
            return f"the plan is full ({self.config.stages} stages); stop a stage or raise `stages`"
        addr = hello.capabilities.get("data_addr")
        if not (isinstance(addr, str) and 0 < len(addr) <= MAX_ADDR_CHARS):
            return f"a stage must announce its data_addr (at most {MAX_ADDR_CHARS} characters)"
        return model_check.join_refusal(hello.capabilities, self.plan.model_sha256 if self.plan else "")

    def _admit_drafter(self, hello: proto.Hello) -> str | None:
        if not self.config.draft:
            return "this head runs without a draft model: it has no work for a drafter"
        old = next((p for p in self.peers.values() if p.drafter and p.name == hello.node_id), None)
        if old is not None and self.alive(old):
            return f"drafter {hello.node_id!r} is already joined on a live connection"
        if old is None and sum(p.drafter for p in self.peers.values()) >= MAX_DRAFTERS:
            return f"this head has {MAX_DRAFTERS} drafters already"
        return None

    def register(self, identity: bytes, hello: proto.Hello) -> list:
        """Add an admitted peer; a stage takes its old slot (rejoin), the one it asks for, or the first free."""
        events: list = []
        peer = Peer(identity, hello, self.clock())
        if hello.role == "stage":
            old = self.holder(hello.node_id)
            if old is not None:   # admit() made sure the old connection is dead
                events += self.drop(old, "was replaced by a new connection under its node id")
            want = hello.capabilities.get("want_stage")
            free = [k for k, i in enumerate(self.slots, 1) if i is None]
            if not free:   # admit() made sure a stage that refused its assignment holds a slot
                refuser = self.refused()
                assert refuser is not None, "a full plan admitted a stage without a refused slot"
                events += self._hand_over(refuser, hello.node_id)
                free = [k for k, i in enumerate(self.slots, 1) if i is None]
            peer.stage = want if want in free else free[0]
            self.slots[peer.stage - 1] = identity
            log.info("stage %d <- %s (%s, %.1f GB free)", peer.stage, hello.node_id, hello.device,
                     hello.free_memory_bytes / 1e9)
        elif hello.role == "drafter":
            old = next((p for p in self.peers.values() if p.drafter and p.name == hello.node_id), None)
            if old is not None:
                events += self.drop(old, "was replaced by a new connection under its node id")
            log.info("drafter %s joined (%s, %.1f GB free); sending it the draft model %s", hello.node_id,
                     hello.device, hello.free_memory_bytes / 1e9, self.config.draft)
            self.send(identity, draft_members.draft_setup(self.config, self.plan))
        self.peers[identity] = peer
        self.assign_all()
        return events

    def refused(self) -> Peer | None:
        """A stage holding its slot without serving it: it refused its assignment (a standby may take it)."""
        return next((self.peers[i] for i in self.slots if i is not None and self.peers[i].assign_error
                     and not self.peers[i].ready), None)

    def _hand_over(self, refuser: Peer, newcomer: str) -> list:
        """A node joining a full plan takes the slot of a stage that could not carry out its assignment;
        that stage is told (it goes back to joining, and waits as a standby itself)."""
        why = f"stage {refuser.stage} goes to {newcomer}: this node could not take its assignment " \
              f"({refuser.assign_error})"
        self.send(refuser.identity, proto.Refuse(reason=proto.bounded(why, 1000)))
        return self.drop(refuser, "refused its assignment; a joining node takes the slot")

    def seen(self, identity: bytes) -> Peer | None:
        peer = self.peers.get(identity)
        if peer is not None:
            peer.last_seen = self.clock()
        return peer

    def assign_all(self) -> None:
        """Once every slot has a node, tell each its layer range and next hop (again if that changed)."""
        held = [i for i in self.slots if i is not None]
        if len(held) < len(self.slots) or self.plan is None:
            return
        if self.replanner is not None:
            plan = self.replanner.plan_for(self.plan, [self.peers[i].hello for i in held])
            if plan is None:      # re-splitting for these devices; housekeeping asks again
                return
            if plan is not self.plan:
                log.info("plan: layers %s for the stages that joined", [list(r) for r in plan.ranges])
                self.plan = plan
                self.sent_assign.clear()   # the head takes the new plan before its next engine turn
        plan = self.plan
        for k, identity in enumerate(held, start=1):
            nxt = self.peers[held[k]].data_addr if k < len(held) else ""
            if self.sent_assign.get(k) == (identity, nxt) or self.peers[identity].retry_at > self.clock():
                continue
            shard = plan.shards[k - 1]
            a, b = plan.ranges[k - 1]
            head = plan.head_file if self.last_stage_chooses(k) else None
            self.send(identity, proto.Assign(
                stage_index=k, layer_start=a, layer_end=b, shard_sha256=shard.sha256, shard_bytes=shard.size,
                next_addr=nxt, model=self.config.model, hidden_wire=self.config.wire_dtype,
                quant=self.config.quant, side_files=shard.side_files, source_dir=str(plan.split_dir),
                head_sha256=head.sha256 if head else "", head_bytes=head.size if head else 0,
                model_sha256=plan.model_sha256))
            self.sent_assign[k] = (identity, nxt)
            self.peers[identity].ready = False
            self.peers[identity].retry_at = 0.0

    def stage1_addr(self) -> str:
        identity = self.slots[0] if self.slots else None
        return self.peers[identity].data_addr if identity is not None else ""

    def last_stage_chooses(self, stage: int) -> bool:
        """The last stage holds the lm_head too (and chooses tokens for strategies that want it)."""
        return stage == self.config.stages and self.config.lm_head_at != "head"

    # ---- control messages -------------------------------------------------------------------------
    def on_heartbeat(self, peer: Peer, msg: proto.Heartbeat) -> None:
        """Load, memory and the stats the schema keeps (node/peer_stats.py; what it drops is counted)."""
        stats, refused = clean_stats(msg.stats)
        if refused:
            self.drops.drop("peer_stats", f"from {peer.name}: {len(refused)} heartbeat stats dropped "
                                          f"({', '.join(refused[:5])}{', …' if len(refused) > 5 else ''})")
        peer.load, peer.rss, peer.stats = msg.load, msg.rss_bytes, stats
        peer.rtt.add(self.rtt.sample_ms(msg.echo, msg.held_ms))

    def on_ready(self, peer: Peer, msg: proto.Ready) -> None:
        if msg.stage_index != peer.stage:
            log.warning("%s reported ready for stage %d but holds stage %d", peer.name, msg.stage_index, peer.stage)
            return
        peer.ready, peer.assign_error = True, ""
        log.info("stage %d (%s) ready", peer.stage, peer.name)

    def on_refuse(self, peer: Peer, msg: proto.Refuse) -> None:
        """A stage could not carry out its assignment (bad shard, load error): it stays connected and
        keeps its slot, not ready; the head sends the assignment again after ASSIGN_RETRY_S (the fault
        may pass: a fetch timed out, memory was short) and `status` shows the reason meanwhile."""
        if not peer.stage:
            log.warning("refuse from %s, which holds no stage: %s", peer.name, proto.bounded(msg.reason, 300))
            return
        log.error("stage %d (%s) refused its assignment: %s; assigning again in %g s", peer.stage, peer.name,
                  proto.bounded(msg.reason, 1000), ASSIGN_RETRY_S)
        peer.ready = False
        peer.assign_error = proto.bounded(msg.reason, 500)
        peer.retry_at = self.clock() + ASSIGN_RETRY_S
        self.sent_assign.pop(peer.stage, None)

    def on_shard_request(self, peer: Peer, msg: proto.ShardRequest) -> None:
        if peer.drafter:
            draft_members.serve_draft(self.plan, peer, msg, self.send)
            return
        if not peer.stage or self.plan is None:
            log.warning("shard request from %s, which holds no stage", peer.name)
            return
        shard = self.plan.shards[peer.stage - 1]
        if msg.sha256 and msg.sha256 != shard.sha256:
            if not (msg.sha256 == self.plan.head_file.sha256 and self.last_stage_chooses(peer.stage)):
                log.warning("%s asked for file %s…, which is not assigned to it", peer.name, msg.sha256[:12])
                return
            shard = self.plan.head_file
        try:
            self.send(peer.identity, shard_fetch.read_chunk(shard, msg))
        except ProtocolError as err:
            log.warning("bad shard request from %s: %s", peer.name, err)

    def on_draft_ready(self, peer: Peer, msg: proto.DraftReady) -> None:
        """A drafter loaded the draft model (or could not: shown in status, and it gets no jobs)."""
        if not peer.drafter:
            log.warning("draft_ready from %s, which is not a drafter", peer.name)
            return
        peer.ready, peer.assign_error = not msg.error, proto.bounded(msg.error, 500)
        if msg.error:
            log.error("drafter %s cannot draft: %s", peer.name, msg.error)
        else:
            log.info("drafter %s ready (%s)", peer.name, msg.model)

    def drafters(self) -> list[Peer]:
        """Drafters ready for jobs."""
        return [p for p in self.peers.values() if p.drafter and p.ready]

    def cluster_ready(self) -> bool:
        return None not in self.slots and all(i is not None and self.peers[i].ready for i in self.slots)

    def missing(self) -> list[str]:
        return [f"stage {k}" for k, i in enumerate(self.slots, 1) if i is None or not self.peers[i].ready]

    def stage_devices(self) -> tuple[str, ...]:
        return tuple(self.peers[i].hello.device for i in self.slots if i is not None)

    def stage_identity(self, stage: int) -> bytes | None:
        return self.slots[stage - 1] if 1 <= stage <= len(self.slots) else None

    def stage_identities(self) -> list[bytes]:
        return [i for i in self.slots if i is not None]

    # ---- liveness ---------------------------------------------------------------------------------
    def retry_refused(self) -> None:
        """Stages that refused their assignment get it again once their retry time has come."""
        if any(0 < p.retry_at <= self.clock() for p in self.peers.values() if p.stage):
            self.assign_all()

    def ping(self, busy_clients: set[bytes]) -> None:
        """A heartbeat to every stage (and client with work in progress) when one is due. Safe to call
        while the compute thread runs a step (it reads the slots only; the head's sends are locked)."""
        now = self.clock()
        if now - self.last_ping >= self.config.heartbeat_ms / 1000:
            self.last_ping = now
            beat = proto.Heartbeat(node_id=self.node_id, load=0.0, rss_bytes=0, ping=self.rtt.stamp())
            drafters = [p.identity for p in self.peers.values() if p.drafter]
            for identity in self.stage_identities() + drafters + [c for c in busy_clients if c in self.peers]:
                self.send(identity, beat)

    def judge(self, busy_clients: set[bytes]) -> list:
        """Drop peers past their liveness. Call it only once the control socket has been read empty: a
        heartbeat still queued there (the head was busy) is a live peer, not a silent one."""
        now = self.clock()
        events: list = []
        for peer in list(self.peers.values()):
            silent = now - peer.last_seen
            if peer.judged_like_a_stage and not self.alive(peer, now):
                events += self.drop(peer, f"silent for {silent:.1f} s (missed heartbeats)")
            elif not peer.judged_like_a_stage and not self.alive(peer, now) and (
                    (peer.identity in busy_clients and heartbeats(peer)) or silent > CLIENT_IDLE_S):
                events += self.drop(peer, f"silent for {silent:.1f} s")
        return events

    def on_disconnect(self, identity: bytes) -> list:
        """The socket monitor saw this peer's connection close."""
        peer = self.peers.get(identity)
        return self.drop(peer, "disconnected") if peer is not None else []

    def drop(self, peer: Peer, why: str) -> list:
        if self.peers.pop(peer.identity, None) is None:
            return []
        if peer.drafter:
            log.warning("drafter %s %s: dropped; node 0 drafts alone meanwhile", peer.name, why)
            return [DrafterLost(peer.identity, peer.name, why)]
        if not peer.stage:
            return [ClientGone(peer.identity, why)]
        log.error("stage %d (%s) %s: dropped; waiting for a node to take its place", peer.stage, peer.name, why)
        self.slots[peer.stage - 1] = None
        self.sent_assign.pop(peer.stage, None)
        return [StageLost(peer.stage, peer.name, why)]

    def status_rows(self) -> list[dict]:
        now = self.clock()
        ranges = self.plan.ranges if self.plan else None
        rows = []
        for k, identity in enumerate(self.slots, start=1):
            p = self.peers.get(identity) if identity else None
            layers: list[int] = list(ranges[k - 1]) if ranges else []
            if p is None:
                rows.append({"node_id": "", "role": "stage", "stage": k, "ready": False, "address": "",
                             "layers": layers, "missing": True})
                continue
            rows.append({   # the stats first: a peer's own report never stands for what the head knows
                **p.stats, "node_id": p.name, "role": "stage", "stage": k, "address": p.data_addr, "layers": layers,
                "model": self.config.model, "device": p.hello.device, "free_memory_bytes": p.hello.free_memory_bytes,
                "rss_bytes": p.rss, "load": round(p.load, 3), "last_seen_s": round(now - p.last_seen, 3),
                "rtt_ms": p.rtt.median_ms(), "ready": p.ready, **({"error": p.assign_error} if p.assign_error else {}),
            })
        return rows + [draft_members.drafter_row(self.config, p, now) for p in self.peers.values() if p.drafter]


def heartbeats(peer: Peer) -> bool:
    """The client answers the head's heartbeats (its silence then means it is gone); others are judged
    by their connection only."""
    return peer.hello.capabilities.get("heartbeat") is True

