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

import zmq

from flowedge.daemon.config import NodeConfig, tcp
from flowedge.errors import ConfigError

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


def bind_data_port(sock: zmq.Socket, config: NodeConfig, head_host: str) -> str:
    """Bind `sock` (the stage's PULL) as the module docstring says; returns the address to announce."""
    local = reachable_ip(head_host)
    interface = local
    if config.advertise:
        interface = local_address(config.advertise) or "*"
        if interface == "*":
            log.info("advertised address %s is not this host's: the data port listens on every interface",
                     config.advertise)
    lo, hi = config.data_ports()
    port = _bind(sock, interface, lo, hi)
    return tcp(config.advertise or local, port)


def _bind(sock: zmq.Socket, interface: str, lo: int, hi: int) -> int:
    """The first free port of lo..hi (0..0: any free port the kernel picks)."""
    if lo == 0:
        return sock.bind_to_random_port(f"tcp://{interface}")
    for port in range(lo, hi + 1):
        try:
            sock.bind(tcp(interface, port))
            return port
        except zmq.ZMQError as err:
            last = err
    where = f"port {lo}" if lo == hi else f"any port of {lo}-{hi}"
    raise ConfigError(f"cannot listen for segments on {interface}, {where}: {last} "
                      f"(another stage or program holds it; set data_port to a free port or range)")
