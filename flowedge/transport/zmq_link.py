"""The link over ZeroMQ: ROUTER/PULL sockets listen, DEALER/PUSH sockets connect, all on one context.

Kept from the sockets the nodes used to open themselves: CurveZMQ on every socket (`security.py`:
server keys on listening sockets, client keys on connecting ones; `insecure` skips it), frames sent
without copying (a tensor's buffer goes to libzmq as it is: do not mutate it after a send) and
received as `zmq.Frame`s the codec reads in place, `router_mandatory` (a send to a vanished peer
fails instead of vanishing) and `linger = 0` everywhere, and an OUTBOUND send never blocks.

Peer events on a ROUTER come from its socket monitor: a closed connection ends the peer identities
*of that connection* (`connections.py`, which ties the monitor's descriptors to the identities that
messages carry), read before any message of an unknown identity; a refused CurveZMQ handshake is a
HANDSHAKE_FAILED. A DEALER's monitor says when its connection to the server closed.
"""
from __future__ import annotations

import itertools
import logging
import time
from collections import deque
from collections.abc import Sequence
from pathlib import Path
from typing import Any, TypeVar

import zmq
from zmq.utils.monitor import parse_monitor_message

from flowedge.errors import AddressInUse, LinkError, PeerUnreachable
from flowedge.transport.connections import ConnectionTracker
from flowedge.transport.link import Endpoint, Event, Inbound, Kind, Link, PeerEvent
from flowedge.transport.security import Security

log = logging.getLogger(__name__)

_SOCKET = {Kind.ROUTER: zmq.ROUTER, Kind.INBOUND: zmq.PULL, Kind.DEALER: zmq.DEALER, Kind.OUTBOUND: zmq.PUSH}
_HANDSHAKE_FAILED = (zmq.EVENT_HANDSHAKE_FAILED_AUTH | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
                     | zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL)


_MONITOR_NUMBERS = itertools.count()
_Socket = TypeVar("_Socket", bound=zmq.Socket)


def tcp(host: str, port: int) -> str:
    return f"tcp://{host}:{port}"


def monitor_of(sock: _Socket, events: int) -> _Socket:
    """`sock`'s monitor on an inproc address no other socket ever had. pyzmq's default names it after the
    socket's file descriptor, which a new socket reuses while libzmq still holds the closed one's address:
    "Address already in use" for the new socket (seen as an HTTP 500 when the API opened a connection)."""
    return sock.get_monitor_socket(events, f"inproc://flowedge-monitor-{next(_MONITOR_NUMBERS)}")


class ZmqEndpoint(Endpoint):
    """One socket, and its monitor where the kind has peer events."""

    def __init__(self, kind: Kind, sock: zmq.Socket, address: str, monitor: zmq.Socket | None = None) -> None:
        self.kind, self.sock, self.address, self.monitor = kind, sock, address, monitor
        self.pending: deque[Inbound | PeerEvent] = deque()
        self.closed = False

    def sockets(self) -> list[zmq.Socket]:
        return [s for s in (self.sock, self.monitor) if s is not None]

    def send_frames(self, frames: Sequence[Any], to: bytes | None = None) -> None:
        if self.kind is Kind.INBOUND:
            raise LinkError("an INBOUND endpoint only receives")
        parts = list(frames)
        if self.kind is Kind.ROUTER:
            if to is None:   # as on the memory link: nobody by that name
                raise PeerUnreachable(f"{self.kind.value} {self.address}: a send must name its peer")
            parts.insert(0, to)
        try:
            self.sock.send_multipart(parts, copy=False, flags=zmq.NOBLOCK if self.kind is Kind.OUTBOUND else 0)
        except zmq.ZMQError as err:   # EHOSTUNREACH (the peer left), EAGAIN (not taking more)
            raise PeerUnreachable(f"{self.kind.value} {self.address}: {err}") from None

    def receive(self, timeout_s: float = 0.0) -> Inbound | PeerEvent | None:
        deadline = time.monotonic() + timeout_s
        while not self.closed:
            if self.pending:
                return self.pending.popleft()
            self._read_monitor()
            if not self.pending and not self._read_message():
                left_ms = int(1000 * (deadline - time.monotonic()))
                if left_ms <= 0 or not zmq.select(self.sockets(), [], [], left_ms / 1000)[0]:
                    return None
        return None

    def has_pending(self) -> bool:
        return bool(self.pending)

    def _read_message(self) -> bool:
        """One message off the socket into `pending` (with the events it brings); False if none was there."""
        try:
            frames = self.sock.recv_multipart(zmq.NOBLOCK, copy=False)
        except zmq.Again:
            return False
        self.pending.append(Inbound(frames))
        return True

    def _read_monitor(self) -> None:
        if self.monitor is None:
            return
        while True:
            try:
                event = parse_monitor_message(self.monitor.recv_multipart(zmq.NOBLOCK))
            except zmq.Again:
                return
            if event["event"] == zmq.EVENT_DISCONNECTED:
                self.pending.append(PeerEvent(Event.DISCONNECTED, detail=self.address))

    def close(self) -> None:
        if not self.closed:
            self.closed = True
            for sock in self.sockets():
                sock.close(0)


class ZmqRouter(ZmqEndpoint):
    """A ROUTER: every message names its sender (the identity ZeroMQ gave its connection)."""

    monitor: zmq.Socket   # always there: its peer events

    def __init__(self, sock: zmq.Socket, address: str) -> None:
        monitor = monitor_of(sock, _HANDSHAKE_FAILED | zmq.EVENT_ACCEPTED | zmq.EVENT_DISCONNECTED)
        super().__init__(Kind.ROUTER, sock, address, monitor)
        self.connections = ConnectionTracker()

    def _read_message(self) -> bool:
        try:
            frames = self.sock.recv_multipart(zmq.NOBLOCK, copy=False)
        except zmq.Again:
            return False
        identity, body = frames[0].bytes, frames[1:]
        if not body:
            return True
        first = not self.connections.knows(identity)
        if first:   # its connection's ACCEPTED is in the monitor by now: read it up to date first
            self._read_monitor()
        if not self.connections.bind(frames[0].get(zmq.SRCFD), identity):
            return True   # from a connection already closed: nobody to answer
        if first:
            self.pending.append(PeerEvent(Event.CONNECTED, identity))
        self.pending.append(Inbound(body, identity))
        return True

    def _read_monitor(self) -> None:
        while True:
            try:
                event = parse_monitor_message(self.monitor.recv_multipart(zmq.NOBLOCK))
            except zmq.Again:
                return
            if event["event"] in (zmq.EVENT_ACCEPTED, zmq.EVENT_DISCONNECTED):
                track = self.connections.accepted if event["event"] == zmq.EVENT_ACCEPTED else self.connections.closed
                self.pending.extend(PeerEvent(Event.DISCONNECTED, identity) for identity in track(event["value"]))
            else:
                where = event.get("endpoint", b"?")
                self.pending.append(PeerEvent(Event.HANDSHAKE_FAILED, detail=f"{where!r} (event {event['event']})"))


class ZmqLink(Link):
    """Endpoints on one ZeroMQ context, secured with the cluster's keys unless `insecure`."""

    def __init__(self, keys_dir: Path | str | None = None, insecure: bool = False,
                 context: zmq.Context | None = None) -> None:
        self.ctx = context or zmq.Context()
        self.own_ctx = context is None
        self.security = Security.start(self.ctx, keys_dir, insecure)
        self.endpoints: list[ZmqEndpoint] = []

    def _socket(self, kind: Kind) -> zmq.Socket:
        sock = self.ctx.socket(_SOCKET[kind])
        sock.linger = 0
        if kind is Kind.ROUTER:
            sock.router_mandatory = True   # a send to a vanished peer raises instead of vanishing
        return sock

    def listen(self, kind: Kind, interface: str, ports: tuple[int, int] = (0, 0)) -> ZmqEndpoint:
        if kind not in (Kind.ROUTER, Kind.INBOUND):
            raise LinkError(f"{kind.value} endpoints connect; they do not listen")
        sock = self._socket(kind)
        self.security.server(sock)
        interface = "*" if interface in ("0.0.0.0", "*") else interface
        try:
            _bind(sock, interface, *ports)
        except AddressInUse:
            sock.close(0)
            raise
        address = sock.getsockopt_string(zmq.LAST_ENDPOINT)
        return self._keep(ZmqRouter(sock, address) if kind is Kind.ROUTER else ZmqEndpoint(kind, sock, address))

    def connect(self, kind: Kind, address: str) -> ZmqEndpoint:
        if kind not in (Kind.DEALER, Kind.OUTBOUND):
            raise LinkError(f"{kind.value} endpoints listen; they do not connect")
        sock = self._socket(kind)
        self.security.client(sock)
        monitor = monitor_of(sock, zmq.EVENT_DISCONNECTED) if kind is Kind.DEALER else None
        sock.connect(address)
        return self._keep(ZmqEndpoint(kind, sock, address, monitor))

    def _keep(self, endpoint: ZmqEndpoint) -> ZmqEndpoint:
        self.endpoints = [e for e in self.endpoints if not e.closed] + [endpoint]
        return endpoint

    def wait(self, endpoints: Sequence[Endpoint], timeout_s: float) -> list[Endpoint]:
        mine = [_own(e) for e in endpoints]
        ready: list[Endpoint] = [e for e in mine if e.has_pending()]
        poller = zmq.Poller()
        owner: dict[zmq.Socket, Endpoint] = {}
        for e in mine:
            for sock in e.sockets():
                poller.register(sock, zmq.POLLIN)
                owner[sock] = e
        got = poller.poll(0 if ready else max(0, int(1000 * timeout_s)))
        ready += [owner[s] for s, _ in got if owner[s] not in ready]
        return ready

    def close(self) -> None:
        for e in self.endpoints:
            e.close()
        self.endpoints = []
        self.security.stop()
        if self.own_ctx:
            self.ctx.term()


def _own(endpoint: Endpoint) -> ZmqEndpoint:
    """`endpoint` as the ZmqEndpoint it is: a link waits only on endpoints it made."""
    if not isinstance(endpoint, ZmqEndpoint):
        raise LinkError(f"a ZeroMQ link cannot wait on a {type(endpoint).__name__}")
    return endpoint


def _bind(sock: zmq.Socket, interface: str, lo: int, hi: int) -> int:
    """The first free port of lo..hi (0..0: any free port the kernel picks)."""
    if lo == 0:
        try:
            return sock.bind_to_random_port(f"tcp://{interface}")
        except zmq.ZMQError as err:
            raise AddressInUse(f"{interface}: {err}") from None
    for port in range(lo, hi + 1):
        try:
            sock.bind(tcp(interface, port))
            return port
        except zmq.ZMQError as err:
            last = err
    where = f"port {lo}" if lo == hi else f"any port of {lo}-{hi}"
    raise AddressInUse(f"{interface}, {where}: {last}")
