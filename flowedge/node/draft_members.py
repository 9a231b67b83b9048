"""What the head's membership does for drafter peers beyond a stage's liveness: the draft model it tells
a drafter to hold, serving that model's files, and the drafter's row in `status`. Kept apart from
membership.py, whose job is the slots and liveness every peer shares."""
from __future__ import annotations

import logging
from collections.abc import Callable

from flowedge.errors import ProtocolError
from flowedge.node import shard_fetch
from flowedge.node.node_config import NodeConfig
from flowedge.transport import protocol as proto

log = logging.getLogger(__name__)


def draft_setup(config: NodeConfig, plan) -> proto.DraftSetup:
    """The head's own draft model, served as a one-stage split when the plan made one (predraft = drafter)."""
    files = getattr(plan, "draft_files", None)
    if files is None:
        return proto.DraftSetup(model=config.draft, quant=config.draft_quant)
    layers, head = files
    return proto.DraftSetup(model=config.draft, quant=config.draft_quant, shard_sha256=layers.sha256,
                            shard_bytes=layers.size, head_sha256=head.sha256, head_bytes=head.size,
                            side_files=layers.side_files)


def serve_draft(plan, peer, msg: proto.ShardRequest, send: Callable[[bytes, proto.Message], None]) -> None:
    """A drafter fetching the draft model's split: its layers' file or its head file, nothing else."""
    files = getattr(plan, "draft_files", None)
    shard = next((f for f in files or () if f.sha256 == msg.sha256), None)
    if shard is None:
        log.warning("drafter %s asked for file %s…, which is not the draft model's", peer.name, msg.sha256[:12])
        return
    try:
        send(peer.identity, shard_fetch.read_chunk(shard, msg))
    except ProtocolError as err:
        log.warning("bad shard request from drafter %s: %s", peer.name, err)


def drafter_row(config: NodeConfig, p, now: float) -> dict:
    """A drafter's row of `status`: its heartbeat stats (checked, node/peer_stats.py), then what the head
    knows of it, which a peer's report cannot stand for."""
    return {**p.stats, "node_id": p.name, "role": "drafter", "stage": None, "address": "", "layers": "draft",
            "model": config.draft, "device": p.hello.device, "free_memory_bytes": p.hello.free_memory_bytes,
            "rss_bytes": p.rss, "load": round(p.load, 3), "last_seen_s": round(now - p.last_seen, 3),
            "rtt_ms": p.rtt.median_ms(), "ready": p.ready, **({"error": p.assign_error} if p.assign_error else {})}
