"""The link in memory: a whole cluster (head, stages, clients) in one process, no sockets.

Same semantics as the ZeroMQ link where the nodes can tell: a message travels as its frames (copied
into buffers the receiver owns, so the codec and the boundary checks run exactly as on a socket); a
ROUTER names each sender by an identity of its connection (a fresh one on every reconnect); a DEALER
sends before its server listens are held until it does (ZeroMQ's lazy connect); a closed endpoint
ends its connections with DISCONNECTED events on the other side; an OUTBOUND send with nobody
listening is PeerUnreachable. Every endpoint of one `MemoryNetwork` shares one condition, so a wait
on several endpoints wakes on any of them. Thread-safe: nodes run in threads of the test process.
"""
from __future__ import annotations

import itertools
import threading
from collections import deque
from collections.abc import Sequence
from typing import Any

from flowedge.errors import AddressInUse, LinkError, PeerUnreachable
from flowedge.transport.buffers import frame_buffer
from flowedge.transport.link import Endpoint, Event, Inbound, Kind, Link, PeerEvent, port_of

FIRST_FREE_PORT = 20000   # where "any free port" starts counting


class MemoryNetwork:
    """What the nodes of one in-memory cluster share: the listening endpoints by port, and a condition."""

    def __init__(self) -> None:
        self.cond = threading.Condition()
        self.listeners: dict[int, MemoryEndpoint] = {}
        self.dealers: list[MemoryEndpoint] = []   # every open DEALER (one may wait for its server to listen)
        self.identities = itertools.count(1)
        self.free_ports = itertools.count(FIRST_FREE_PORT)

    def link(self) -> MemoryLink:
        return MemoryLink(self)


class MemoryEndpoint(Endpoint):
    def __init__(self, net: MemoryNetwork, kind: Kind, address: str) -> None:
        self.net, self.kind, self.address = net, kind, address
        self.inbox: deque[Inbound | PeerEvent] = deque()
        self.closed = False
        self.peers: dict[bytes, MemoryEndpoint] = {}    # ROUTER: its DEALERs by identity
        self.server: MemoryEndpoint | None = None        # DEALER: the ROUTER it is connected to
        self.identity = b""                              # DEALER: its identity there
        self.held: list[list[bytearray]] = []            # DEALER: sent before a server listened

    def _deliver(self, item: Inbound | PeerEvent) -> None:   # under net.cond
        if not self.closed:
            self.inbox.append(item)
            self.net.cond.notify_all()

    def send_frames(self, frames: Sequence[Any], to: bytes | None = None) -> None:
        owned = [bytearray(frame_buffer(f)) for f in frames]   # the receiver's own copy, as off a socket
        with self.net.cond:
            if self.closed:
                raise LinkError(f"{self.kind.value} {self.address} is closed")
            if self.kind is Kind.ROUTER:
                peer = self.peers.get(to) if to is not None else None
                if peer is None:
                    raise PeerUnreachable(f"no peer {to!r} on {self.address}")
                peer._deliver(Inbound(owned))
            elif self.kind is Kind.DEALER:
                self.held.append(owned)
                self._flush()
            elif self.kind is Kind.OUTBOUND:
                listener = self.net.listeners.get(port_of(self.address))
                if listener is None or listener.kind is not Kind.INBOUND:
                    raise PeerUnreachable(f"nobody listens at {self.address}")
                listener._deliver(Inbound(owned))
            else:
                raise LinkError("an INBOUND endpoint only receives")

    def _flush(self) -> None:
        """A DEALER's held messages to its server, connecting first if one listens now (under net.cond)."""
        if self.server is None:
            server = self.net.listeners.get(port_of(self.address))
            if server is None or server.kind is not Kind.ROUTER:
                return
            self.server, self.identity = server, next(self.net.identities).to_bytes(5, "big")
            server.peers[self.identity] = self
            server._deliver(PeerEvent(Event.CONNECTED, self.identity))
        for frames in self.held:
            self.server._deliver(Inbound(frames, self.identity))
        self.held.clear()

    def receive(self, timeout_s: float = 0.0) -> Inbound | PeerEvent | None:
        with self.net.cond:
            self.net.cond.wait_for(lambda: self.inbox or self.closed, timeout_s)
            return self.inbox.popleft() if self.inbox and not self.closed else None

    def close(self) -> None:
        with self.net.cond:
            if self.closed:
                return
            self.closed = True
            self.inbox.clear()
            if self.net.listeners.get(port_of(self.address)) is self and self.kind in (Kind.ROUTER, Kind.INBOUND):
                del self.net.listeners[port_of(self.address)]
            for dealer in self.peers.values():   # a ROUTER's connections end
                dealer.server = None
                dealer._deliver(PeerEvent(Event.DISCONNECTED, detail=self.address))
            self.peers.clear()
            if self.server is not None:          # a DEALER's connection ends
                self.server.peers.pop(self.identity, None)
                self.server._deliver(PeerEvent(Event.DISCONNECTED, self.identity))
                self.server = None
            self.net.cond.notify_all()


class MemoryLink(Link):
    """One node's endpoints on a `MemoryNetwork`."""

    def __init__(self, net: MemoryNetwork) -> None:
        self.net = net
        self.endpoints: list[MemoryEndpoint] = []
        self.closed = False

    def _check_open(self) -> None:
        if self.closed:
            raise LinkError("this link is closed")

    def listen(self, kind: Kind, interface: str, ports: tuple[int, int] = (0, 0)) -> MemoryEndpoint:
        if kind not in (Kind.ROUTER, Kind.INBOUND):
            raise LinkError(f"{kind.value} endpoints connect; they do not listen")
        self._check_open()
        with self.net.cond:
            lo, hi = ports
            port = next(p for p in self.net.free_ports if p not in self.net.listeners) if lo == 0 else \
                next((p for p in range(lo, hi + 1) if p not in self.net.listeners), None)
            if port is None:
                raise AddressInUse(f"{interface}, {f'port {lo}' if lo == hi else f'any port of {lo}-{hi}'}: "
                                   "taken in this memory network")
            endpoint = MemoryEndpoint(self.net, kind, f"tcp://{interface}:{port}")
            self.net.listeners[port] = endpoint
            for dealer in self.net.dealers:   # lazy connects made before it listened
                if dealer.server is None and dealer.held and port_of(dealer.address) == port:
                    dealer._flush()
        return self._keep(endpoint)

    def connect(self, kind: Kind, address: str) -> MemoryEndpoint:
        if kind not in (Kind.DEALER, Kind.OUTBOUND):
            raise LinkError(f"{kind.value} endpoints listen; they do not connect")
        self._check_open()
        endpoint = MemoryEndpoint(self.net, kind, address)
        if kind is Kind.DEALER:
            with self.net.cond:
                self.net.dealers = [d for d in self.net.dealers if not d.closed] + [endpoint]
        return self._keep(endpoint)

    def _keep(self, endpoint: MemoryEndpoint) -> MemoryEndpoint:
        self.endpoints = [e for e in self.endpoints if not e.closed] + [endpoint]
        return endpoint

    def wait(self, endpoints: Sequence[Endpoint], timeout_s: float) -> list[Endpoint]:
        mine = [_own(e) for e in endpoints]
        with self.net.cond:
            self.net.cond.wait_for(lambda: any(e.inbox for e in mine), timeout_s)
            return [e for e in mine if e.inbox]

    def close(self) -> None:
        self.closed = True
        for endpoint in self.endpoints:
            endpoint.close()
        self.endpoints = []



def _own(endpoint: Endpoint) -> MemoryEndpoint:
    """`endpoint` as the MemoryEndpoint it is: a link waits only on endpoints it made."""
    if not isinstance(endpoint, MemoryEndpoint):
        raise LinkError(f"a memory link cannot wait on a {type(endpoint).__name__}")
    return endpoint
