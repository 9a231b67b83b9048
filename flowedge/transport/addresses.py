"""A head's address: HOST:PORT as operators write it, checked in one place, and the default port.

The client, the nodes and the launch commands all read addresses; this module is here, beside the
link, so that the client (which imports only transport and errors) needs nothing of the node's config.
"""
from __future__ import annotations

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


def tcp(host: str, port: int) -> str:
    return f"tcp://{host}:{port}"
