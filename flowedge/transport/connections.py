"""Which peer identities a ROUTER connection carries, so that a closed connection ends the peers of
*that* connection and no other.

The socket monitor names a connection by its file descriptor, and the kernel hands a closed
descriptor to the next accepted connection at once; messages name their sender by routing identity
(ZeroMQ makes a fresh one per connection) and carry the descriptor as SRCFD. The monitor's stream is
in order for each descriptor (ACCEPTED, DISCONNECTED, ACCEPTED, ...: a descriptor is reused only once
closed, and the DISCONNECTED is sent before it closes), but the head reads it apart from the
messages, so a DISCONNECTED of an old connection can be read after the first message of a new one on
the same descriptor. Keyed by descriptor, that late event removed the new peer.

So the tracker keeps connections, not descriptors: ACCEPTED starts a connection, DISCONNECTED ends
the newest connection on its descriptor with the identities bound to it, and an identity is bound
once, at its first message, to the newest connection on its descriptor. The head reads the monitor
up to date before it binds a new identity (`knows`): the ACCEPTED of a connection is sent before any
of its messages can arrive, so the newest connection is then the message's own, or a closed one
when the message outlived its connection (it is ignored: its sender is gone).
"""
from __future__ import annotations

import logging
from collections import OrderedDict
from dataclasses import dataclass, field

log = logging.getLogger(__name__)

GONE_REMEMBERED = 4096   # identities of closed connections kept, so their late messages are ignored


@dataclass
class Connection:
    """One accepted TCP connection of the ROUTER."""
    fd: int
    open: bool = True
    identities: list[bytes] = field(default_factory=list)


class ConnectionTracker:
    def __init__(self) -> None:
        self.newest: dict[int, Connection] = {}       # descriptor -> the last connection accepted on it
        self.connection_of: dict[bytes, Connection] = {}
        self.gone: OrderedDict[bytes, None] = OrderedDict()

    def knows(self, identity: bytes) -> bool:
        """Bound to a connection already (or to one that closed): no need to read the monitor first."""
        return identity in self.connection_of or identity in self.gone

    def accepted(self, fd: int) -> list[bytes]:
        """A connection was accepted on `fd`. Returns the identities of an earlier connection on this
        descriptor whose DISCONNECTED never came (the monitor dropped it): it is closed all the same."""
        missed = self.closed(fd)
        self.newest[fd] = Connection(fd)
        return missed

    def bind(self, fd: int | None, identity: bytes) -> bool:
        """A message from `identity` arrived through descriptor `fd`; False when it comes from a
        connection that has closed (drop it: there is nobody to answer)."""
        if identity in self.gone:
            return False
        if identity in self.connection_of or fd is None or fd < 0:
            return True
        conn = self.newest.get(fd)
        if conn is None:   # accepted before the monitor started (a head restart, stages reconnecting)
            conn = self.newest[fd] = Connection(fd)
        if not conn.open:
            log.debug("message from %r on closed connection fd %d ignored", identity, fd)
            return False
        conn.identities.append(identity)
        self.connection_of[identity] = conn
        return True

    def closed(self, fd: int) -> list[bytes]:
        """The newest connection on `fd` closed: the identities it carried (their peers are gone)."""
        conn = self.newest.get(fd)
        if conn is None or not conn.open:
            return []
        conn.open = False
        for identity in conn.identities:
            del self.connection_of[identity]
            self.gone[identity] = None
        while len(self.gone) > GONE_REMEMBERED:
            self.gone.popitem(last=False)
        return list(conn.identities)
