"""The transport seam: what a node needs from the network, and nothing about how it is carried.

A node opens endpoints on its `Link` (four kinds, the patterns flowedge uses), sends protocol messages
through them and polls them with a deadline. What arrives is either a message, still as frames (the
codec and validation run on the receiving side whatever carried it), or a `PeerEvent`: a peer
connected, went away, or failed the handshake. Two links implement it: ZeroMQ (`zmq_link.py`:
CurveZMQ, zero-copy tensor frames, one identity per connection) and memory (`memory_link.py`: queues
in one process, for whole-cluster tests). Nothing outside `transport/` knows which one it runs on.
"""
from __future__ import annotations

import enum
import time
from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from flowedge.errors import AddressInUse, LinkError, PeerUnreachable
from flowedge.transport.codec import Message

__all__ = ["AddressInUse", "Endpoint", "Event", "Inbound", "Kind", "Link", "LinkError", "PeerEvent",
           "PeerUnreachable", "port_of"]


class Kind(enum.Enum):
    ROUTER = "router"      # listens; many peers, each message names its sender; replies go to one peer
    INBOUND = "inbound"    # listens; many senders, receive only (a stage's data port, the head's return)
    DEALER = "dealer"      # connects to one ROUTER; two-way
    OUTBOUND = "outbound"  # connects to one INBOUND; send only, never blocks


class Event(enum.Enum):
    CONNECTED = "connected"                  # a peer's first message (ROUTER)
    DISCONNECTED = "disconnected"            # a peer's connection closed (ROUTER: that peer; DEALER: the server)
    HANDSHAKE_FAILED = "handshake_failed"    # a peer was refused before it could send (keys, protocol)


@dataclass(frozen=True, slots=True)
class PeerEvent:
    kind: Event
    peer: bytes | None = None   # the peer's identity on a ROUTER; None on a DEALER or when unknown
    detail: str = ""


@dataclass(frozen=True, slots=True)
class Inbound:
    """One message as it arrived: its frames undecoded, and on a ROUTER who sent it."""
    frames: list[Any]
    peer: bytes | None = None


class Endpoint(ABC):
    """One socket's worth of link."""

    kind: Kind
    address: str   # where it listens, or where it connects to

    @abstractmethod
    def send_frames(self, frames: Sequence[Any], to: bytes | None = None) -> None:
        """Queue frames for the peer `to` (ROUTER) or the one peer; PeerUnreachable if nobody takes them."""

    @abstractmethod
    def receive(self, timeout_s: float = 0.0) -> Inbound | PeerEvent | None:
        """The next message or peer event, waiting up to `timeout_s`; None if none came."""

    @abstractmethod
    def close(self) -> None:
        """Stop; a peer connected to it sees it go (DISCONNECTED). Closing twice is harmless."""

    def send(self, msg: Message, to: bytes | None = None) -> None:
        self.send_frames(msg.to_frames(), to)

    def next_message(self, timeout_s: float) -> Inbound | None:
        """The next message within `timeout_s`, peer events skipped."""
        deadline = time.monotonic() + timeout_s
        while True:
            got = self.receive(max(0.0, deadline - time.monotonic()))
            if got is None or isinstance(got, Inbound):
                return got


class Link(ABC):
    """A node's way onto the network: it makes endpoints and waits on several at once."""

    @abstractmethod
    def listen(self, kind: Kind, interface: str, ports: tuple[int, int] = (0, 0)) -> Endpoint:
        """A ROUTER or INBOUND on the first free port of `ports` ((0, 0): any); AddressInUse if none is."""

    @abstractmethod
    def connect(self, kind: Kind, address: str) -> Endpoint:
        """A DEALER or OUTBOUND to `address` (as a listening endpoint's `address` names it)."""

    @abstractmethod
    def wait(self, endpoints: Sequence[Endpoint], timeout_s: float) -> list[Endpoint]:
        """The endpoints with something to receive, waiting up to `timeout_s` for one to have it."""

    @abstractmethod
    def close(self) -> None:
        """Close every endpoint still open, then the link itself."""


def port_of(address: str) -> int:
    """The port of a "tcp://host:port" address."""
    return int(address.rsplit(":", 1)[1])
