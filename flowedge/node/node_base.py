"""The life every node the head drives shares (a stage, a drafter): one control connection to the head.

Lifecycle (`run`): JOIN (HELLO until WELCOME) -> the node's own setup -> serve, and back to JOIN on
`Rejoin` (a head silent for `stage_timeout_s`, a REFUSE) until a SHUTDOWN or `stop`. Through every loop:
a heartbeat to the head when one is due, systemd's watchdog and STATUS= (`_beat`); long work (a load, a
batched step, a draft job) on one worker thread while this thread keeps beating (beating.py); files the
head serves fetched chunk by chunk, and a damaged cache repaired and fetched again (bounded).

A base class, not a part the nodes hold: the lifecycle calls the node back (its join, its poll, its
heartbeat stats, its status line) and the node calls the lifecycle (heartbeats, the control socket, the
fetch); as two objects each would hold the other. A node kind keeps only what is its own: `ROLE`,
`_join` (its HELLO's capabilities, what it waits for after the WELCOME), `_poll` (its sockets and
messages), `_stats` and `_sd_status`. Logs go to the node kind's own module logger, as they always did.
"""
from __future__ import annotations

import logging
import threading
import time
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, ClassVar, TypeVar

import psutil

from flowedge.errors import ChecksumError, FlowedgeError, PeerUnreachable, ProtocolError, Refused, Rejoin, StaleTerm
from flowedge.node import shard_fetch
from flowedge.node.beating import BeatingWorker
from flowedge.node.droplog import DropLog
from flowedge.node.fencing import TermGuard
from flowedge.node.head_search import HeadSearch
from flowedge.node.link_rtt import Echo
from flowedge.node.node_config import NodeConfig
from flowedge.systemd.sd_notify import Notifier
from flowedge.transport import protocol as proto
from flowedge.transport.addresses import split_addr, tcp
from flowedge.transport.handshake import welcome_from
from flowedge.transport.link import Endpoint, Inbound, Kind, Link

T = TypeVar("T")

HELLO_TIMEOUT_S = 5.0   # the first HELLO's wait for the WELCOME; each unanswered one doubles the next wait
HELLO_MAX_WAIT_S = 30.0   # ... up to this: a head that comes up answers the HELLO waiting for it at once
HEADS_HELLO_WAIT_S = 1.0  # with several head addresses (`heads`): each HELLO's wait before the next address
LOAD_BEAT_S = 0.2       # how often a load on the compute thread lets this thread beat
WAIT_SLICE_S = 0.2      # a wait for the head checks `stop` (and feeds systemd's watchdog) this often


@dataclass
class NodeParts:
    """What every node runs with, built from the config by its composition root (roots.py)."""
    link: Link
    drops: DropLog         # dropped messages and failed requests, counted for `flowedge status`
    home: Path             # FLOWEDGE_HOME: the cache of the files the head serves
    # a head found by mDNS: which one to dial after unanswered HELLOs (None: the operator's address, kept)
    search: HeadSearch | None = field(default=None, kw_only=True)


class NodeBase(ABC):
    """A node the head drives; subclasses are the node kinds (stage_node.py, drafter_node.py)."""

    ROLE: ClassVar[str]         # the HELLO's role; also names the compute thread
    FETCHING: ClassVar[str]     # what a fetch is called in errors ("head shut down during ...")

    def __init__(self, config: NodeConfig, parts: NodeParts, stop: threading.Event | None = None) -> None:
        self.config = config
        self.stop = stop or threading.Event()
        self.node_id = config.name
        self.link, self.drops, self.home, self.search = parts.link, parts.drops, parts.home, parts.search
        self.repair = shard_fetch.CacheRepair(self.home)   # damaged cache files: deleted, fetched again
        self.head_host, self.head_port = split_addr(config.head)
        self.ctrl: Endpoint | None = None
        self.notifier = Notifier()  # systemd: READY once serving, a watchdog fed by every loop
        self.phase = "starting"     # what STATUS= (and a drafter's heartbeat) says the node is doing
        self.heartbeat_s = config.heartbeat_ms / 1000   # the head's own period once it WELCOMEd us
        self.last_beat = self.last_head = time.monotonic()
        self.echo = Echo()   # the head's latest heartbeat number, returned with ours (link_rtt.py)
        self.busy_s = 0.0
        self.stats: dict[str, Any] = {}   # the last heartbeat's stats (re-sent as they were while a step runs)
        self.compute = BeatingWorker(f"{self.ROLE}-compute")
        self.log = logging.getLogger(type(self).__module__)
        self.fence = TermGuard()   # the highest head term obeyed (node/fencing.py)
        self.heads = list(config.heads) if config.heads else [config.head]   # a head and its standbys

    # ---- what a node kind says ------------------------------------------------------------------
    @abstractmethod
    def _join(self) -> None:
        """HELLO (`_hello`) and whatever the node waits for before serving; returns early on `stop`."""

    @abstractmethod
    def _poll(self, wait_s: float) -> None:
        """Wait up to `wait_s` for the node's sockets and handle what came."""

    @abstractmethod
    def _stats(self) -> dict[str, Any]:
        """The heartbeat's stats (not called while a step runs on the compute thread)."""

    def _sd_status(self) -> str:
        """systemd's STATUS= line."""
        return self.phase

    # ---- lifecycle ------------------------------------------------------------------------------
    def run(self) -> None:
        try:
            while not self.stop.is_set():
                try:
                    self._join()
                    self._serve()
                except Rejoin as why:
                    self.log.warning("rejoining: %s", why)
                    self.phase = f"rejoining: {why}"
                    self._next_head()
        finally:
            self.notifier.stopping()
            self.close()

    def close(self) -> None:
        self.link.close()
        self.notifier.close()
        self.compute.close()

    def _hello(self, capabilities: Callable[[], dict[str, Any]]) -> proto.Welcome | None:
        """HELLO until the head WELCOMEs this node (and `_welcome_ok` takes it); None once stopped. Each try
        says what the node holds now (`capabilities()`, its free memory): a refusal may have changed it.
        Each unanswered HELLO doubles the next one's wait (HELLO_TIMEOUT_S up to HELLO_MAX_WAIT_S) and the
        node says why it waits; a head found by mDNS that never answers is given up for another one."""
        tries = 0
        while not self.stop.is_set():
            wait_s = HEADS_HELLO_WAIT_S if len(self.heads) > 1 else min(HELLO_MAX_WAIT_S, HELLO_TIMEOUT_S * 2 ** tries)
            tries += 1
            self._connect_ctrl()   # a fresh socket: no stale HELLOs queued from earlier tries
            hello = proto.Hello(node_id=self.node_id, role=self.ROLE, device=self.config.device,
                                free_memory_bytes=offered_bytes(self.config), capabilities=capabilities())
            try:
                welcome = self._await_welcome(hello, wait_s)
                if welcome is not None:
                    self._obey(welcome)
                if welcome is not None and self.search is not None:
                    self.search.answered()
                if welcome is None or self._welcome_ok(welcome):
                    break
            except (ProtocolError, PeerUnreachable) as err:
                self._hello_refused(str(err))
                self._waiting_for_head(err, tries, min(HELLO_MAX_WAIT_S, HELLO_TIMEOUT_S * 2 ** tries))
                if (not isinstance(err, Refused) or len(self.heads) > 1) and self._unanswered():
                    tries = 0   # another head: its first HELLO waits the shortest again
        if self.stop.is_set() or welcome is None:   # None: only once stopped (_await_welcome)
            return None
        self.heartbeat_s = welcome.heartbeat_interval_ms / 1000
        self.last_head = time.monotonic()
        return welcome

    def _unanswered(self) -> bool:
        """A HELLO nobody answered: a head found by mDNS may be given up for another one announced
        (whether the node now dials another address)."""
        if self.search is None:
            return self._next_head()
        found = self.search.missed()
        if found is None:
            return False
        self.config = replace(self.config, head=found.addr)
        self.head_host, self.head_port = found.host, found.port
        self.phase = f"joining the head at {found.addr} (found by mDNS)"
        return True

    def _next_head(self) -> bool:
        """With several head addresses (`heads`: a head and its standbys), dial the next one (whether it did)."""
        if len(self.heads) < 2:
            return False
        addr = self.heads[(self.heads.index(self.config.head) + 1) % len(self.heads)] \
            if self.config.head in self.heads else self.heads[0]
        self.config = replace(self.config, head=addr)
        self.head_host, self.head_port = split_addr(addr)
        self.phase = f"joining the head at {addr}"
        return True

    def _obey(self, welcome: proto.Welcome) -> None:
        """The fencing rule on a WELCOME: a head under a lower term than one obeyed is refused (StaleTerm)."""
        try:
            self.fence.obey(welcome.term, welcome.node_id)
        except StaleTerm as err:
            self._to_head(proto.Refuse(reason=str(err)))
            raise

    def _await_welcome(self, hello: proto.Hello, wait_s: float) -> proto.Welcome | None:
        """Send HELLO and wait up to `wait_s` for the answer (None: stopped meanwhile); ProtocolError for
        a refusal, an odd answer or none (PeerUnreachable for a send the link refused: waited out too)."""
        deadline = time.monotonic() + wait_s
        try:
            self.head_link.send(hello)
        except PeerUnreachable:
            self._pause(deadline - time.monotonic())
            raise
        while not self.stop.is_set():
            self.notifier.tick(self._sd_status)
            left = deadline - time.monotonic()
            got = self.head_link.next_message(max(0.0, min(WAIT_SLICE_S, left)))
            if got is not None or left <= 0:
                return welcome_from(got, wait_s)
        return None

    def _waiting_for_head(self, err: FlowedgeError, tries: int, next_wait_s: float) -> None:
        """Say why the node still waits for the head, and how long its next HELLO waits."""
        self.phase = f"waiting for the head at {self.config.head}: {err}"
        self.log.warning("joining %s (try %d): %s; asking again, waiting up to %g s for an answer",
                         self.config.head, tries, err, next_wait_s)
        if isinstance(err, Refused) and len(self.heads) < 2:   # an answer that will not change at once
            self._pause(min(next_wait_s, 2.0 * tries))

    def _pause(self, seconds: float) -> None:
        """Wait, feeding systemd's watchdog, until `seconds` pass or the node is stopped."""
        deadline = time.monotonic() + seconds
        while not self.stop.wait(max(0.0, min(WAIT_SLICE_S, deadline - time.monotonic()))):
            self.notifier.tick(self._sd_status)
            if time.monotonic() >= deadline:
                return

    def _welcome_ok(self, welcome: proto.Welcome) -> bool:
        """Whether this node can work with the head that WELCOMEd it (False: HELLO again)."""
        return True

    def _hello_refused(self, reason: str) -> None:
        """A HELLO went unanswered or was refused for `reason`: the node may change what it announces."""

    def _connect_ctrl(self) -> None:
        if self.ctrl is not None:
            self.ctrl.close()
        self.ctrl = self.link.connect(Kind.DEALER, tcp(self.head_host, self.head_port))

    @property
    def head_link(self) -> Endpoint:
        """The control connection: every send or read on it comes after `_hello` connected it."""
        assert self.ctrl is not None, "the control connection is used before HELLO connected it"
        return self.ctrl

    # ---- serving --------------------------------------------------------------------------------
    def _serve(self) -> None:
        wait_s = min(100, self.config.heartbeat_ms // 2) / 1000   # a beat is never late by more than half a period
        while not self.stop.is_set():
            self._poll(wait_s)
            self._beat()
            self.drops.tick()
            # judged on what could be read: the head's heartbeats that came in during a long step are
            # still queued, and a head is dead only if nothing from it is waiting either
            if time.monotonic() - self.last_head > self.config.stage_timeout_s and \
                    not self.link.wait([self.head_link], 0):
                raise Rejoin(f"no word from the head for {self.config.stage_timeout_s:g} s")

    # ---- the control connection -----------------------------------------------------------------
    def _to_head(self, msg: proto.Message) -> None:
        """A control message to the head; one the link cannot take is dropped (liveness judges the head)."""
        try:
            self.head_link.send(msg)
        except PeerUnreachable as err:
            self.log.debug("to the head: %s", err)

    def _recv_ctrl(self, timeout_s: float) -> proto.Message | None:
        got = self.head_link.next_message(timeout_s)
        return None if got is None else self._decode_ctrl(got)

    def _decode_ctrl(self, got: Inbound) -> proto.Message | None:
        """The message (None: malformed, dropped and counted); a SHUTDOWN stops the node here."""
        self.last_head = time.monotonic()   # any word from the head says it is up
        try:
            msg = proto.decode(got.frames)
        except ProtocolError as err:
            self.drops.drop("malformed", f"from the head: {err}")
            return None
        if isinstance(msg, proto.Shutdown):
            self.log.info("shutdown requested by the head%s", f": {msg.reason}" if msg.reason else "")
            self.stop.set()
        elif isinstance(msg, proto.Heartbeat):
            try:
                self.fence.obey(msg.term, msg.node_id)
            except StaleTerm as err:
                self._to_head(proto.Refuse(reason=str(err)))
                raise Rejoin(str(err)) from None
            self.echo.read(msg.ping)
        return msg

    def _on_other(self, msg: proto.Message | None) -> None:
        """A control message no node kind handles itself: a REFUSE sends it back to JOIN; heartbeats,
        WELCOMEs and SHUTDOWNs (taken at decode) are no news; anything else is logged and ignored."""
        if isinstance(msg, proto.Refuse):
            raise Rejoin(f"the head dropped this node: {msg.reason}")
        if msg is not None and not isinstance(msg, (proto.Heartbeat, proto.Shutdown, proto.Welcome)):
            self.log.warning("ignoring unexpected %s from the head", msg.TYPE)

    def _beat(self, busy: bool = False) -> None:
        """A heartbeat to the head when one is due, and systemd's watchdog and STATUS= on every call
        (every loop passes here: join, fetch, load, serve). `busy`: a step runs on the compute thread,
        so the node's state is not read (its last stats are sent again) and the load counts as full."""
        self.notifier.tick(self._sd_status)
        now = time.monotonic()
        if now - self.last_beat < self.heartbeat_s or self.ctrl is None:
            return
        load = 1.0 if busy else self.busy_s / max(now - self.last_beat, 1e-6)
        if not busy:
            self.stats = self._stats()
        self._to_head(proto.Heartbeat(node_id=self.node_id, load=min(load, 1e6),
                                      rss_bytes=psutil.Process().memory_info().rss, stats=self.stats,
                                      **self.echo.fields()))
        if not busy:
            self.busy_s = 0.0
        self.last_beat = now

    # ---- files from the head --------------------------------------------------------------------
    def _load_fetched(self, spec: Any, find: Callable[[], Path], load: Callable[[Path], T]) -> T:
        """`load` the directory `find` gives (local, cached or fetched) on the compute thread, beating
        meanwhile (a W4A16 repack takes tens of seconds on a slow board, which must not look like a dead
        node); a cached file that fails its checksum is deleted and fetched again (shard_fetch.CacheRepair,
        bounded). `spec` is the ASSIGN or DraftSetup naming the files."""
        while True:
            where = find()
            try:
                return self.compute.run(lambda: load(where), self._beat, LOAD_BEAT_S)
            except ChecksumError as err:
                self.repair.repair(where, spec, err)

    def _next_chunk(self, timeout_s: float) -> proto.ShardChunk | None:
        """The next shard chunk from the head (beating meanwhile; other messages are dropped); None after
        `timeout_s` of silence. FlowedgeError if the head shuts down meanwhile."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline and not self.stop.is_set():
            msg = self._recv_ctrl(0.2)
            self._beat()
            if isinstance(msg, proto.ShardChunk):
                return msg
            if isinstance(msg, proto.Shutdown):
                raise FlowedgeError(f"head shut down during {self.FETCHING}: {msg.reason}")
        return None


def offered_bytes(config) -> int:
    """The memory this node tells the head it may fill: what the OS reports free, capped by the config's
    `memory_offer_gib` (a board that keeps room for other work)."""
    free = int(psutil.virtual_memory().available)
    return min(free, int(config.memory_offer_gib * (1 << 30))) if config.memory_offer_gib else free
