"""A drafter node: joins the head like a stage, holds the draft model and pre-drafts for node 0.

It takes no stage slot: the head keeps drafters apart (membership.py) and sends each one the draft model
it runs itself (`DraftSetup`): with predraft = "drafter" the head serves it as a one-stage split, which
the drafter fetches like a stage's shard (checksummed, cached under $FLOWEDGE_HOME/stage-cache), so a
board with nothing on it can draft; on the head's host (`same_host`), or from a head that serves no
files, the model's name is resolved here. Then come pre-draft jobs (`DraftJob`) over the control
connection; every job gets an answer (node/draft_serve.py). Node 0 never waits on a drafter: a job not
answered within its timeout, or a drafter that dies, only means node 0 drafts alone.

Lifecycle: JOIN (HELLO role "drafter" until WELCOME) -> wait DraftSetup -> resolve and load the draft
model (heartbeating) -> DraftReady -> serve jobs. A head silent for `stage_timeout_s` sends it back to
JOIN; a SHUTDOWN ends it. A model it cannot load is reported (DraftReady with the error) and it waits
for another setup. What it shares with a stage (HELLO, heartbeats, head liveness, shard chunks, systemd)
is `node_base.NodeBase`'s; its parts are `NodeParts` alone (it only dials the head).
"""
from __future__ import annotations

import logging
import threading
import time
from pathlib import Path

from flowedge.allocator import settle
from flowedge.node import shard_fetch
from flowedge.node.draft_serve import DraftServer
from flowedge.node.node_base import LOAD_BEAT_S, NodeBase, NodeParts
from flowedge.node.node_config import NodeConfig
from flowedge.transport import protocol as proto

log = logging.getLogger(__name__)


def load_draft(spec: str | Path, quant: str):
    """The draft model: a directory fetched from the head, or the name the head gave resolved (fetched
    and converted if need be) here."""
    from flowedge.engine.drafter import load_draft_model, resolve_draft_quant
    from flowedge.models.resolve import resolve_model

    quant = resolve_draft_quant(quant)
    return load_draft_model(spec if isinstance(spec, Path) else resolve_model(spec, quant=quant), quant)


class DrafterNode(NodeBase):
    ROLE = "drafter"
    FETCHING = "the draft model's fetch"

    def __init__(self, config: NodeConfig, parts: NodeParts, stop: threading.Event | None = None,
                 loader=load_draft) -> None:
        super().__init__(config, parts, stop)
        self.loader = loader
        self.server: DraftServer | None = None
        self.setup: proto.DraftSetup | None = None

    # ---- joining --------------------------------------------------------------------------------
    def _join(self) -> None:
        self.phase = f"joining the head at {self.config.head} as a drafter"
        welcome = self._hello(lambda: {"role": "drafter"})
        if welcome is not None:
            log.info("joined head %s at %s as a drafter; waiting for its draft model", welcome.node_id,
                     self.config.head)

    def _take_setup(self, setup: proto.DraftSetup) -> None:
        """Load the draft model the head named (again only if it changed); tell the head how it went."""
        if self.server is not None and self.setup is not None and \
                (setup.model, setup.quant, setup.shard_sha256) == \
                (self.setup.model, self.setup.quant, self.setup.shard_sha256):
            self._to_head(proto.DraftReady(model=setup.model))
            return
        self.server, self.setup = None, setup
        self.phase = f"getting the draft model {setup.model}"
        t0 = time.monotonic()
        try:
            model = self._load(setup)
        except Exception as err:  # noqa: BLE001 - a model that cannot load is reported, the node stays up
            why = f"cannot load the draft model {setup.model}: {type(err).__name__}: {err}"
            log.error("%s; waiting for another setup", why)
            self.phase = why
            self._to_head(proto.DraftReady(model=setup.model, error=proto.bounded(why, 1000)))
            return
        settle()
        # a replica per request the head may run at once (its max_concurrent, as this node's config says;
        # more would evict replicas and resend whole contexts), at least the default 8
        self.server = DraftServer(model, self.drops, max(8, 2 * self.config.max_concurrent))
        log.info("draft model %s loaded in %.1f s; serving pre-draft jobs", setup.model, time.monotonic() - t0)
        self.phase = f"drafting with {setup.model}"
        self.notifier.ready(self.phase)
        self._to_head(proto.DraftReady(model=setup.model))

    def _load(self, setup: proto.DraftSetup):
        """Fetch (or find cached) the files the head serves and load them, heartbeating (on the head's
        host, or from a head that serves no files, the model's name is resolved here)."""
        if not setup.shard_sha256 or self.config.same_host:
            return self.compute.run(lambda: self.loader(setup.model, setup.quant), self._beat, LOAD_BEAT_S)
        return self._load_fetched(setup, lambda: self._files(setup), lambda entry: self.loader(entry, setup.quant))

    def _files(self, setup: proto.DraftSetup) -> Path:
        """The draft model's directory in the cache, fetched from the head if it is not there."""
        entry = shard_fetch.cached_dir(self.home, setup.shard_sha256)
        if entry is None:
            log.info("fetching the draft model %s (%d MB) from the head", setup.model,
                     (setup.shard_bytes + setup.head_bytes) >> 20)
            entry = shard_fetch.fetch(setup, self.home, self._to_head, self._next_chunk)
        shard_fetch.fetch_head_file(setup, entry, self._to_head, self._next_chunk)
        return entry

    # ---- serving --------------------------------------------------------------------------------
    def _poll(self, wait_s: float) -> None:
        got = self.head_link.next_message(wait_s)
        if got is None:
            return
        if _is_job(got.frames):   # a job's frames go to the handler whole: it decodes and answers
            self.last_head = time.monotonic()
            self._job(got.frames)
            return
        msg = self._decode_ctrl(got)
        if isinstance(msg, proto.DraftSetup):
            self._take_setup(msg)
        else:
            self._on_other(msg)

    def _job(self, frames) -> None:
        """Run a job on the compute thread (heartbeats go on meanwhile) and answer it."""
        server = self.server
        reply: proto.Message
        if server is None:
            reply = proto.DraftDeclined(request_id=0, seq=0, why="error", detail="this drafter has no draft model yet")
        else:
            t0 = time.perf_counter()
            reply = self.compute.run(lambda: server.handle(frames), self._beat, self.heartbeat_s / 2,
                                     give_up_s=self.config.stall_timeout_s)
            self.busy_s += time.perf_counter() - t0
        self._to_head(reply)

    def _stats(self) -> dict:
        return {"phase": self.phase, "model": self.setup.model if self.setup else "",
                "drafter": self.server.stats() if self.server is not None else None,
                "dropped": self.drops.snapshot()}


def _is_job(frames) -> bool:
    """A job's frames go to the handler whole (it decodes and answers even a malformed one); everything
    else is decoded here. Peeks at the header only."""
    import msgpack

    from flowedge.transport.buffers import frame_buffer

    try:
        raw = frame_buffer(frames[0])
        header = msgpack.unpackb(raw, raw=False) if len(raw) <= proto.MAX_HEADER_BYTES else None
    except Exception:  # noqa: BLE001 - not a job; decode() names what is wrong
        return False
    return isinstance(header, dict) and header.get("type") == proto.DraftJob.TYPE
