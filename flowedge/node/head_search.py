"""Which head a node joining by mDNS dials, and when to look again (no zeroconf here: `browse` is given).

An announcement is advice, not proof: anyone on the LAN can announce a cluster's name without its keys,
and two clusters left at the default name announce the same one. So every head announcing the cluster
is a candidate, and the cluster keys (the CurveZMQ handshake under the HELLO) decide which one is the
head. A node that finds one keeps dialing it while it answers; after `forget_after` HELLOs in a row
with no answer it gives that address up and browses again, taking a head it has not given up on before
one it has (the one given up longest ago first). A head address the operator gave is never searched
for: such a node has no `HeadSearch`.
"""
from __future__ import annotations

import itertools
import logging
from collections.abc import Callable
from dataclasses import dataclass

from flowedge.errors import ConfigError

log = logging.getLogger(__name__)

FORGET_AFTER_TRIES = 3    # HELLOs in a row without an answer before a found head is given up
REBROWSE_S = 5.0          # how long a search after a give-up listens when no head answers


@dataclass(frozen=True)
class FoundHead:
    cluster: str
    host: str
    port: int
    model: str = ""

    @property
    def addr(self) -> str:
        return f"{self.host}:{self.port}"


Browse = Callable[[float], list[FoundHead]]   # every head that answers within the seconds given


def candidates(heads: list[FoundHead], cluster: str | None, timeout_s: float) -> list[FoundHead]:
    """The heads announcing the one cluster to join (`cluster`, or the only name there is), in the
    order found; ConfigError when there is none, or several names and none chosen."""
    if cluster:
        heads = [h for h in heads if h.cluster == cluster]
    if not heads:
        named = f" named {cluster!r}" if cluster else ""
        raise ConfigError(f"no flowedge head{named} answered on the LAN (mDNS) within {timeout_s:g} s: give its "
                          f"address (`flowedge join HOST:PORT`), or check it runs without --no-discovery")
    if len({h.cluster for h in heads}) > 1:
        listed = ", ".join(f"{h.cluster} at {h.addr}" for h in heads)
        raise ConfigError(f"several flowedge heads on the LAN: {listed}; choose one with "
                          f"`flowedge join --cluster NAME`")
    return heads


class HeadSearch:
    """The head a node found by mDNS dials now (`head`), given up after unanswered HELLOs (`missed`)."""

    def __init__(self, browse: Browse, cluster: str | None = None, rebrowse_s: float = REBROWSE_S,
                 forget_after: int = FORGET_AFTER_TRIES) -> None:
        self.browse, self.cluster = browse, cluster
        self.rebrowse_s, self.forget_after = rebrowse_s, forget_after
        self.head: FoundHead | None = None
        self.misses = 0                        # HELLOs to `head` in a row that nobody answered
        self.given_up: dict[str, int] = {}     # address -> when given up (a counter: older is smaller)
        self._clock = itertools.count()

    def start(self, timeout_s: float) -> FoundHead:
        """The first head to dial (ConfigError as `candidates` says); later searches keep to its cluster."""
        heads = candidates(self.browse(timeout_s), self.cluster, timeout_s)
        self.head, self.cluster = heads[0], heads[0].cluster
        if len(heads) > 1:
            log.warning("discovery: %d heads announce cluster %r (%s): trying %s first; the cluster keys "
                        "decide which is the head", len(heads), self.cluster, ", ".join(h.addr for h in heads),
                        self.head.addr)
        return self.head

    def answered(self) -> None:
        """The head WELCOMEd the node: keep it."""
        self.misses = 0
        if self.head is not None:
            self.given_up.pop(self.head.addr, None)

    def missed(self) -> FoundHead | None:
        """One more HELLO nobody answered; the head to dial instead, once this one is given up and
        another is announced (None: keep dialing this one)."""
        self.misses += 1
        if self.head is None or self.misses < self.forget_after:
            return None
        self.misses = 0
        self.given_up[self.head.addr] = next(self._clock)
        heads = [h for h in self.browse(self.rebrowse_s) if h.cluster == self.cluster]
        if not heads:
            log.info("discovery: no head of cluster %r announced now; still dialing %s", self.cluster,
                     self.head.addr)
            return None
        pick = min(heads, key=lambda h: self.given_up.get(h.addr, -1))
        if pick.addr == self.head.addr:
            return None
        log.warning("discovery: no answer from %s after %d HELLOs (gone, or not this cluster's head): trying "
                    "%s, also announced as cluster %r", self.head.addr, self.forget_after, pick.addr, self.cluster)
        self.head = pick
        return pick


def search_lan(browse: Browse, cluster: str | None, timeout_s: float, say: Callable[[str], None]) -> HeadSearch:
    """The head on the LAN (mDNS, `browse`) to join first, in a `HeadSearch` that looks again when it does
    not answer; `say` tells the operator what it is doing."""
    say(f"looking for a flowedge head{f' of cluster {cluster!r}' if cluster else ''} on the LAN "
        f"(mDNS, up to {timeout_s:g} s)...")
    search = HeadSearch(browse, cluster)
    found = search.start(timeout_s)
    say(f"found head of cluster {found.cluster!r} at {found.addr}"
        f"{f' serving {found.model}' if found.model else ''}; joining")
    return search
