"""Finding the head on the LAN by mDNS/DNS-SD (zeroconf), so `flowedge join` needs no address.

The head registers `NAME._flowedge._tcp.local.` (NAME: its cluster name) with its control port and
the addresses it listens on; `flowedge join` with no address browses for that type and takes the heads
of the one cluster there is, or of the one named with `--cluster` when there are several (which of them
it dials, and when it looks again, is head_search.py's). A head bound to loopback is not announced
(nobody else could reach it), nor one started with `--no-discovery`.

The name is advice, never proof: anyone on the LAN may announce it. When another responder already
holds the name (a second cluster left at the default name, or an impostor), the head takes the next
free one (`NAME-2`, zeroconf's renaming) and says so; its `cluster` property keeps the cluster's name,
so joining nodes still find it, and the cluster keys decide.
"""
from __future__ import annotations

import ipaddress
import logging
import socket
import threading
import time

import ifaddr
from zeroconf import ServiceBrowser, ServiceInfo, ServiceStateChange, Zeroconf

from flowedge.node.head_search import FoundHead
from flowedge.transport.addresses import is_wildcard

log = logging.getLogger(__name__)

SERVICE_TYPE = "_flowedge._tcp.local."
SETTLE_S = 1.5            # after the first head answers, how long to listen for others


def lan_addresses(host: str) -> list[str]:
    """The IPv4 addresses a head bound to `host` can be reached at: that one, or every non-loopback
    interface address for a wildcard bind; [] for loopback."""
    if not is_wildcard(host):
        try:
            ip = ipaddress.ip_address(socket.gethostbyname(host))
        except (OSError, ValueError):
            return []
        return [] if ip.is_loopback else [str(ip)]
    return [a.ip for adapter in ifaddr.get_adapters() for a in adapter.ips
            if isinstance(a.ip, str) and not ipaddress.ip_address(a.ip).is_loopback]


class Announcer:
    """The head's mDNS registration, for as long as it runs."""

    def __init__(self, cluster: str, host: str, port: int, model: str = "") -> None:
        self.addresses = lan_addresses(host)
        self.zc = None
        if not self.addresses:
            log.info("discovery: not announced (the head listens on loopback %s only)", host)
            return
        self.info = ServiceInfo(SERVICE_TYPE, f"{cluster}.{SERVICE_TYPE}", port=port,
                                parsed_addresses=self.addresses, server=f"{socket.gethostname()}.local.",
                                properties={"cluster": cluster, "model": model.rsplit("/", 1)[-1][:200]})
        wanted = self.info.name
        self.zc = Zeroconf()
        try:
            self.zc.register_service(self.info, allow_name_change=True)   # a name held elsewhere: NAME-2, ...
        except BaseException:
            self.zc.close()
            self.zc = None
            raise
        if self.info.name != wanted:
            log.warning("discovery: another responder on the LAN already announces %r (a second cluster of that "
                        "name, or an impostor): this head is announced as %r instead; nodes joining cluster %r by "
                        "mDNS try every head of that name, and the cluster keys decide", wanted, self.info.name,
                        cluster)
        log.info("discovery: announced cluster %r on %s port %d (mDNS %s)", cluster, ", ".join(self.addresses),
                 port, self.info.name)

    def close(self) -> None:
        """Withdraw the announcement; a failure to is logged (the head is stopping anyway)."""
        if self.zc is None:
            return
        try:
            self.zc.unregister_service(self.info)
        except Exception as err:  # noqa: BLE001 - an unsent goodbye only leaves the record to expire
            log.warning("discovery: withdrawing %r failed (%s: %s)", self.info.name, type(err).__name__, err)
        finally:
            self.zc.close()
            self.zc = None


def browse(timeout_s: float, settle_s: float = SETTLE_S) -> list[FoundHead]:
    """Every head that answers within `timeout_s`, listening `settle_s` more after the first."""
    found: dict[str, FoundHead] = {}
    names: list[str] = []
    lock = threading.Lock()

    def on_change(zeroconf, service_type, name, state_change) -> None:
        if state_change is ServiceStateChange.Added:
            with lock:
                names.append(name)

    zc = Zeroconf()
    try:
        browser = ServiceBrowser(zc, SERVICE_TYPE, handlers=[on_change])
        deadline, first = time.monotonic() + timeout_s, None
        while time.monotonic() < deadline and (first is None or time.monotonic() < first + settle_s):
            with lock:
                pending, names[:] = list(names), []
            for name in pending:
                head = _resolve(zc, name)
                if head is not None:
                    found[name] = head
                    first = first or time.monotonic()
            time.sleep(0.1)
        browser.cancel()
    finally:
        zc.close()
    return sorted(found.values(), key=lambda h: h.cluster)


def _resolve(zc, name: str) -> FoundHead | None:
    info = ServiceInfo(SERVICE_TYPE, name)
    if not info.request(zc, 3000) or not info.parsed_addresses() or not info.port:
        return None
    props = {k.decode(): (v or b"").decode() for k, v in info.properties.items()}
    cluster = props.get("cluster") or name.removesuffix("." + SERVICE_TYPE)
    return FoundHead(cluster, info.parsed_addresses()[0], info.port, props.get("model", ""))
