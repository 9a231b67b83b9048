"""A drafter node: joins the head like a stage, holds the draft model and pre-drafts for node 0.

It takes no stage slot: the head keeps drafters apart (membership.py) and sends each one the draft model
it runs itself (`DraftSetup`): with predraft = "drafter" the head serves it as a one-stage split, which
the drafter fetches like a stage's shard (checksummed, cached under $FLOWEDGE_HOME/stage-cache), so a
board with nothing on it can draft; on the head's host (`same_host`), or from a head that serves no
files, the model's name is resolved here. Then come pre-draft jobs (`DraftJob`) over the control
connection; every job gets an answer (daemon/draft_serve.py). Node 0 never waits on a drafter: a job not answered within its timeout, or a
drafter that dies, only means node 0 drafts alone.

Lifecycle: JOIN (HELLO role "drafter" until WELCOME) -> wait DraftSetup -> resolve and load the draft
model (heartbeating) -> DraftReady -> serve jobs. A head silent for `stage_timeout_s` sends it back to
JOIN; a SHUTDOWN ends it. A model it cannot load is reported (DraftReady with the error) and it waits
for another setup.
"""
from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import psutil

from flowedge.allocator import settle
from flowedge.daemon import shard_fetch
from flowedge.daemon.beating import BeatingWorker
from flowedge.daemon.config import NodeConfig, split_addr, tcp
from flowedge.daemon.draft_serve import DraftServer
from flowedge.daemon.droplog import DropLog
from flowedge.daemon.sd_notify import Notifier
from flowedge.errors import ChecksumError, FlowedgeError, PeerUnreachable, ProtocolError, Rejoin
from flowedge.transport import protocol as proto
from flowedge.transport.handshake import hello_exchange
from flowedge.transport.link import Endpoint, Inbound, Kind, Link

log = logging.getLogger(__name__)

HELLO_TIMEOUT_S = 5.0


@dataclass
class DrafterParts:
    link: Link
    drops: DropLog
    home: Path             # FLOWEDGE_HOME: the fetched draft model's cache


def load_draft(spec: str | Path, quant: str):
    """The draft model: a directory fetched from the head, or the name the head gave resolved (fetched
    and converted if need be) here."""
    from flowedge.engine.drafter import load_draft_model, resolve_draft_quant
    from flowedge.models.resolve import resolve_model

    quant = resolve_draft_quant(quant)
    return load_draft_model(spec if isinstance(spec, Path) else resolve_model(spec, quant=quant), quant)


class DrafterNode:
    def __init__(self, config: NodeConfig, parts: DrafterParts, stop: threading.Event | None = None,
                 loader=load_draft) -> None:
        self.config, self.stop = config, stop or threading.Event()
        self.node_id = config.name
        self.head_host, self.head_port = split_addr(config.head)
        self.link, self.drops, self.loader, self.home = parts.link, parts.drops, loader, parts.home
        self.repair = shard_fetch.CacheRepair(self.home)
        self.ctrl: Endpoint | None = None
        self.server: DraftServer | None = None
        self.setup: proto.DraftSetup | None = None
        self.heartbeat_s = config.heartbeat_ms / 1000
        self.last_beat = self.last_head = time.monotonic()
        self.busy_s = 0.0
        self.compute = BeatingWorker("drafter-compute")
        self.notifier = Notifier()
        self.phase = "starting"

    def run(self) -> None:
        try:
            while not self.stop.is_set():
                try:
                    self._join()
                    self._serve()
                except Rejoin as why:
                    log.warning("rejoining: %s", why)
        finally:
            self.notifier.stopping()
            self.link.close()
            self.notifier.close()
            self.compute.close()

    # ---- joining --------------------------------------------------------------------------------
    def _join(self) -> None:
        hello = proto.Hello(node_id=self.node_id, role="drafter", device=self.config.device,
                            free_memory_bytes=int(psutil.virtual_memory().available),
                            capabilities={"role": "drafter"})
        self.phase = f"joining the head at {self.config.head} as a drafter"
        while not self.stop.is_set():
            self.notifier.tick(lambda: self.phase)
            if self.ctrl is not None:
                self.ctrl.close()
            self.ctrl = self.link.connect(Kind.DEALER, tcp(self.head_host, self.head_port))
            try:
                welcome = hello_exchange(self.ctrl, hello, HELLO_TIMEOUT_S)
                break
            except (ProtocolError, PeerUnreachable) as err:
                log.warning("joining %s: %s", self.config.head, err)
                if "refused" in str(err) or "protocol" in str(err):
                    time.sleep(2.0)
        else:
            return
        self.heartbeat_s = welcome.heartbeat_interval_ms / 1000
        self.last_head = time.monotonic()
        log.info("joined head %s at %s as a drafter; waiting for its draft model", welcome.node_id, self.config.head)

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
        """Fetch (or find cached) the files the head serves and load them, heartbeating; a cached file
        that fails its checksum is deleted and fetched again (bounded, shard_fetch.CacheRepair)."""
        if not setup.shard_sha256 or self.config.same_host:
            return self.compute.run(lambda: self.loader(setup.model, setup.quant), self._beat, 0.2)
        while True:
            entry = shard_fetch.cached_dir(self.home, setup.shard_sha256)
            if entry is None:
                log.info("fetching the draft model %s (%d MB) from the head", setup.model,
                         (setup.shard_bytes + setup.head_bytes) >> 20)
                entry = shard_fetch.fetch(setup, self.home, self._to_head, self._next_chunk)
            shard_fetch.fetch_head_file(setup, entry, self._to_head, self._next_chunk)
            try:
                return self.compute.run(lambda: self.loader(entry, setup.quant), self._beat, 0.2)
            except ChecksumError as err:
                self.repair.repair(entry, setup, err)

    def _next_chunk(self, timeout_s: float) -> proto.ShardChunk | None:
        """The next shard chunk from the head (heartbeating meanwhile); other messages are dropped."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline and not self.stop.is_set():
            got = self.ctrl.next_message(0.2)
            self._beat()
            if got is None:
                continue
            self.last_head = time.monotonic()
            try:
                msg = proto.decode(got.frames)
            except ProtocolError as err:
                self.drops.drop("malformed", f"from the head: {err}")
                continue
            if isinstance(msg, proto.ShardChunk):
                return msg
            if isinstance(msg, proto.Shutdown):
                self.stop.set()
                raise FlowedgeError(f"head shut down during the draft model's fetch: {msg.reason}")
        return None

    # ---- serving --------------------------------------------------------------------------------
    def _serve(self) -> None:
        wait_s = min(100, self.config.heartbeat_ms // 2) / 1000
        while not self.stop.is_set():
            got = self.ctrl.next_message(wait_s)
            if got is not None:
                self._on_ctrl(got)
            self._beat()
            self.drops.tick()
            self.notifier.tick(lambda: self.phase)
            if time.monotonic() - self.last_head > self.config.stage_timeout_s and \
                    not self.link.wait([self.ctrl], 0):
                raise Rejoin(f"no word from the head for {self.config.stage_timeout_s:g} s")

    def _on_ctrl(self, got: Inbound) -> None:
        self.last_head = time.monotonic()
        try:
            msg = None if _is_job(got.frames) else proto.decode(got.frames)   # a job: the handler decodes it
        except ProtocolError as err:
            self.drops.drop("malformed", f"from the head: {err}")
            return
        if msg is None:
            self._job(got.frames)
        elif isinstance(msg, proto.DraftSetup):
            self._take_setup(msg)
        elif isinstance(msg, proto.Shutdown):
            log.info("shutdown requested by the head%s", f": {msg.reason}" if msg.reason else "")
            self.stop.set()
        elif isinstance(msg, proto.Refuse):
            raise Rejoin(f"the head dropped this node: {msg.reason}")
        elif not isinstance(msg, (proto.Heartbeat, proto.Welcome)):
            log.warning("ignoring unexpected %s from the head", msg.TYPE)

    def _job(self, frames) -> None:
        """Run a job on the compute thread (heartbeats go on meanwhile) and answer it."""
        server = self.server
        if server is None:
            reply = proto.DraftDeclined(request_id=0, seq=0, why="error", detail="this drafter has no draft model yet")
        else:
            t0 = time.perf_counter()
            reply = self.compute.run(lambda: server.handle(frames), self._beat, self.heartbeat_s / 2,
                                     give_up_s=self.config.stall_timeout_s)
            self.busy_s += time.perf_counter() - t0
        self._to_head(reply)

    def _to_head(self, msg: proto.Message) -> None:
        try:
            self.ctrl.send(msg)
        except PeerUnreachable as err:
            log.debug("to the head: %s", err)

    def _beat(self) -> None:
        now = time.monotonic()
        if now - self.last_beat < self.heartbeat_s or self.ctrl is None:
            return
        load = self.busy_s / max(now - self.last_beat, 1e-6)
        stats = {"phase": self.phase, "model": self.setup.model if self.setup else "",
                 "drafter": self.server.stats() if self.server is not None else None,
                 "dropped": self.drops.snapshot()}
        self._to_head(proto.Heartbeat(node_id=self.node_id, load=min(load, 1e6),
                                      rss_bytes=psutil.Process().memory_info().rss, stats=stats))
        self.busy_s, self.last_beat = 0.0, now


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
