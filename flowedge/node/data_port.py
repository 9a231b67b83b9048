"""Where a stage's data port listens: on the interface the head is reached through, never on every
interface, and on a port the operator can pin (one port, or a range for several stages on one host).

The previous hop (the head, or the stage before) connects to the address the stage announces in its
HELLO. Listening on 0.0.0.0 would also expose the port on interfaces no peer uses (a loopback
cluster's stages were reachable from the whole network). The interface is the one the kernel routes
to the head by (loopback for a head on 127.0.0.1); `advertise` names it instead when it is an address
of this host, and when it is not (a NAT or port forward in between) the port listens on all
interfaces, since the traffic then arrives on one we cannot name.
"""
from __future__ import annotations

import logging
import socket

from flowedge.errors import AddressInUse, ConfigError
from flowedge.node.node_config import NodeConfig
from flowedge.transport.addresses import tcp
from flowedge.transport.link import Endpoint, Kind, Link, port_of

log = logging.getLogger(__name__)


def reachable_ip(head_host: str) -> str:
    """The local address a peer on the head's network reaches us at (no packet is sent)."""
    if head_host in ("127.0.0.1", "localhost", "::1"):
        return "127.0.0.1"
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.connect((head_host, 9))
            return s.getsockname()[0]
    except OSError:
        return socket.gethostbyname(socket.gethostname())


def local_address(host: str) -> str | None:
    """`host` as an IPv4 address of this machine, or None (not ours, or not resolvable)."""
    try:
        ip = socket.gethostbyname(host)
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            s.bind((ip, 0))
        return ip
    except OSError:
        return None


def bind_data_port(link: Link, config: NodeConfig, head_host: str) -> tuple[Endpoint, str]:
    """The stage's INBOUND, listening as the module docstring says, and the address to announce."""
    local = reachable_ip(head_host)
    interface = local
    if config.advertise:
        interface = local_address(config.advertise) or "*"
        if interface == "*":
            log.info("advertised address %s is not this host's: the data port listens on every interface",
                     config.advertise)
    try:
        endpoint = link.listen(Kind.INBOUND, interface, config.data_ports())
    except AddressInUse as err:
        raise ConfigError(f"cannot listen for segments on {err} "
                          f"(another stage or program holds it; set data_port to a free port or range)") from None
    return endpoint, tcp(config.advertise or local, port_of(endpoint.address))
