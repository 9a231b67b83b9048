"""A head's address: HOST:PORT as operators write it, checked in one place, and the default port.

The client, the nodes and the launch commands all read addresses; this module is here, beside the
link, so that the client (which imports only transport and errors) needs nothing of the node's config.
"""
from __future__ import annotations

import random
import socket

from flowedge.errors import ConfigError

DEFAULT_PORT = 5555          # head: control + clients (ROUTER); port + 1: pipeline return (PULL)


def split_addr(addr: str) -> tuple[str, int]:
    """'host:port' (or 'tcp://host:port', or ':port') -> (host, port); a URL of another scheme is refused
    in one line (the head speaks ZMQ, not HTTP: `http://` is most often the HTTP API's address)."""
    scheme, sep, rest = addr.partition("://")
    if sep and scheme != "tcp":
        example = rest.rstrip("/") or f"127.0.0.1:{DEFAULT_PORT}"
        raise ConfigError(f"address {addr!r}: a head is addressed as HOST:PORT (e.g. {example}), "
                          f"not a {scheme}:// URL")
    rest = rest if sep else addr
    host, sep, port = rest.rpartition(":")
    if not sep or not port.isdigit() or not 0 < int(port) < 65535:
        raise ConfigError(f"address {addr!r} is not HOST:PORT (e.g. 127.0.0.1:{DEFAULT_PORT})")
    return host or "127.0.0.1", int(port)


def head_addresses(addr: str) -> list[str]:
    """'A' or 'A,B,...' (a head and its standbys, tried in turn) -> the addresses, each checked here so
    that an address mistake is named before a missing key (a client's link loads the keys)."""
    heads = [a.strip() for a in addr.split(",") if a.strip()] or [addr]
    for one in heads:
        split_addr(one)
    return heads


def is_wildcard(host: str) -> bool:
    """A bind to every interface (`0.0.0.0`, `*`, or no host): not an address a peer can dial."""
    return host in ("0.0.0.0", "*", "")


def tcp(host: str, port: int) -> str:
    return f"tcp://{host}:{port}"


def free_port_run(span: int = 1, host: str = "127.0.0.1") -> int:
    """A port p with p .. p + span - 1 all free on `host` now (a head listens on two, a standby beside it on
    more), for local clusters whose ports nobody configured (tests, soaks, benchmarks).

    Picked below the kernel's ephemeral range: a port taken from that range (bind to port 0) can be taken
    again, between the pick and the listener's bind, as the source port of any outgoing connection, and a
    cluster's own nodes connect to each other all the time; seen as "Address already in use" at a standby's
    start."""
    low, _ = _ephemeral_range()
    for _ in range(200):
        port = random.randrange(max(1024, low - 12000), low - span)
        if all(_bindable(host, port + k) for k in range(span)):
            return port
    raise RuntimeError(f"no {span} free ports in a row below {low} on {host}")


def _ephemeral_range() -> tuple[int, int]:
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            low, high = (int(x) for x in f.read().split())
        return low, high
    except (OSError, ValueError):
        return 32768, 60999   # Linux's default


def _bindable(host: str, port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind((host, port))
            return True
        except OSError:
            return False
