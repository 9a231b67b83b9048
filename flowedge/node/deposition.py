"""A head that a standby replaced stands down.

Fencing keeps a deposed head from driving any stage (node/fencing.py), but a head that was only paused or
cut off comes back believing it is the head: it would welcome clients and hold their requests with no
stage to serve them, and a client that lists it first (`Client("A,B")`) would wait there instead of moving
on to the head that took over. So a head left without a ready cluster asks its standbys' addresses, as a
client would, which term serves there; a higher term than its own means it was deposed. From then on it
refuses every HELLO with a line naming the head that serves (clients trying their addresses in turn move
on at once) and fails what waits on it with the same line. It does not serve again. A daemon's head
(`rejoins`) then leaves its loop, and its process rejoins as the new head's standby (node/rejoin.py); a
head without that stays up refusing, to be restarted as the new standby by hand (docs/operations.md).

The answer is trusted as far as the address is: the standby named it in its authenticated HELLO, and with
CurveZMQ on only a holder of the cluster's server key can answer there.
"""
from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

from flowedge.errors import PeerUnreachable, ProtocolError
from flowedge.transport import protocol as proto
from flowedge.transport.addresses import split_addr, tcp
from flowedge.transport.handshake import welcome_from
from flowedge.transport.link import Kind

log = logging.getLogger(__name__)

PROBE_AFTER_S = 2.0   # the cluster not ready this long before a standby's address is asked
PROBE_EVERY_S = 3.0   # then at most this often
PROBE_WAIT_S = 1.0    # for each address's answer (the head's loop waits: it has nothing to serve meanwhile)

Admit = Callable[[proto.Hello], "str | None"]


@dataclass(frozen=True)
class Deposed:
    """The head that replaced this one: its node id, where it serves and its fencing term."""
    head_id: str
    address: str
    term: int


class Deposition:
    """Whether a higher term serves at one of the standbys' addresses; the head's refusals once it does."""

    def __init__(self, link, term: Callable[[], int], members, requests, name: str, rejoins: bool = False) -> None:
        """`term`: this head's fencing term; `members`/`requests`: the head's Membership and HeadRequests;
        `rejoins`: once deposed, this head's process rejoins as the new head's standby (node/rejoin.py)."""
        self.link, self.term, self.members, self.requests, self.name = link, term, members, requests, name
        self.rejoins = rejoins
        self.addresses: dict[str, str] = {}   # standby node id -> where it serves once it takes over
        self.unready_since: float | None = None
        self.last_probe_s = 0.0
        self.reason = ""                      # set once deposed: every refusal and failure says it
        self.deposed: Deposed | None = None

    def joined(self, hello: proto.Hello) -> None:
        listen = hello.capabilities.get("listen")
        if hello.role == "standby" and isinstance(listen, str) and listen:
            self.addresses[hello.node_id] = listen

    def admit(self, inner: Admit) -> Admit:
        """`inner`'s admission, unless this head was deposed."""
        return lambda hello: self.reason or inner(hello)

    def tick(self, now: float | None = None) -> None:
        """One look (the head's loop): probe when the cluster has been down a while; fail what waits once
        deposed."""
        now = time.monotonic() if now is None else now
        if self.reason:
            self.requests.fail_waiting(self.reason)
            return
        if not self.addresses or self.members.cluster_ready():
            self.unready_since = None
            return
        if self.unready_since is None:
            self.unready_since = now
        if now - self.unready_since < PROBE_AFTER_S or now - self.last_probe_s < PROBE_EVERY_S:
            return
        self.last_probe_s = now
        for address in self.addresses.values():
            welcome = self._probe(address)
            if welcome is not None and welcome.term > self.term():
                self._depose(welcome, address)
                return

    def status(self) -> str:
        return self.reason

    @property
    def leaving(self) -> bool:
        """Deposed, and this head's process rejoins as the new head's standby: the head's loop ends."""
        return self.rejoins and self.deposed is not None

    def _probe(self, address: str) -> proto.Welcome | None:
        host, port = split_addr(address)
        endpoint = self.link.connect(Kind.DEALER, tcp(host, port))
        try:
            endpoint.send(proto.Hello(node_id=f"{self.name}-term-probe", role="client", device="head",
                                      free_memory_bytes=0))
            return welcome_from(endpoint.next_message(PROBE_WAIT_S), PROBE_WAIT_S)
        except (ProtocolError, PeerUnreachable):
            return None   # a standby still following (it refuses), or nobody there
        finally:
            endpoint.close()

    def _depose(self, welcome: proto.Welcome, address: str) -> None:
        then = "it rejoins as that head's standby" if self.rejoins else "restart this board as a standby"
        self.reason = (f"this head was deposed: {welcome.node_id} serves the cluster at {address} under fencing "
                       f"term {welcome.term} (this head's term is {self.term()}); {then}")
        self.deposed = Deposed(welcome.node_id, address, welcome.term)
        log.error("%s", self.reason)
        self.requests.fail_waiting(self.reason)
