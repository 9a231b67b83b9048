"""What `flowedge http` is told, and the rule that keeps it from serving a network without keys."""
from __future__ import annotations

import ipaddress
import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from flowedge.errors import ConfigError

API_KEYS_ENV = "FLOWEDGE_API_KEYS"   # comma-separated
MAX_HEAD_BYTES = 16 * 1024   # a request's line + headers (h11's default, stated here on purpose)
MIN_KEY_CHARS = 16


@dataclass(frozen=True)
class ApiSettings:
    head: str = "127.0.0.1:5555"
    keys_dir: str | None = None            # the cluster's CurveZMQ keys (to reach the head)
    insecure: bool = False
    api_keys: tuple[str, ...] = ()         # bearer tokens; empty = no authentication (loopback only)
    read_timeout_s: float = 10.0           # longest wait for the next piece of a request body
    header_timeout_s: float = 10.0         # longest wait for a whole request head (api/header_deadline.py)
    max_connections: int = 128             # open connections + running requests; 503 beyond (uvicorn)
    max_connections_per_address: int = 16  # connections of one client address without a complete request head
                                           # (past it: api/admission.py)
    max_body_bytes: int = 1 << 20
    requests_per_s_per_address: float = 20.0   # sustained, per client address; 0 = no limit (api/rate_limit.py)
    request_burst_per_address: int = 40        # requests one address may send at once before the rate applies
    request_timeout_s: float = 300.0       # longest silence from the head during one answer
    status_timeout_s: float = 3.0          # /health and /metrics asking the head
    default_max_tokens: int = 256          # chat completions without max_tokens


def load_api_keys(given: tuple[str, ...] = (), key_file: str | None = None,
                  env: Mapping[str, str] | None = None) -> tuple[str, ...]:
    """API keys from --api-key (repeatable), FLOWEDGE_API_KEYS and --api-key-file (one a line, # comments)."""
    keys = [k.strip() for k in given]
    keys += [k.strip() for k in (os.environ if env is None else env).get(API_KEYS_ENV, "").split(",")]
    if key_file:
        try:
            lines = Path(key_file).read_text(encoding="utf-8").splitlines()
        except OSError as err:
            raise ConfigError(f"cannot read the API key file {key_file}: {err}") from None
        keys += [line.strip() for line in lines if not line.strip().startswith("#")]
    keys = [k for k in keys if k]
    short = [k for k in keys if len(k) < MIN_KEY_CHARS or any(c.isspace() for c in k)]
    if short:
        raise ConfigError(f"API keys must be at least {MIN_KEY_CHARS} characters without spaces "
                          f"(`python -c 'import secrets; print(secrets.token_urlsafe(32))'` makes one)")
    return tuple(dict.fromkeys(keys))


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def check_exposure(host: str, api_keys: tuple[str, ...]) -> None:
    """Refuse to listen beyond loopback without API keys: anyone on the network could use the cluster."""
    if not api_keys and not is_loopback(host):
        raise ConfigError(f"refusing to listen on {host} without an API key: anyone who can reach it could "
                          f"use the cluster. Give --api-key KEY (or {API_KEYS_ENV}, or --api-key-file), "
                          f"or listen on 127.0.0.1")


def split_listen(listen: str) -> tuple[str, int]:
    """HOST:PORT, or http://HOST:PORT (the address clients will use); https:// is refused (no TLS here:
    put a TLS proxy in front)."""
    scheme, sep, rest = listen.partition("://")
    if sep and scheme != "http":
        raise ConfigError(f"--listen {listen!r}: flowedge http serves plain http:// (put a TLS proxy in front "
                          f"for https); give HOST:PORT, e.g. {rest.rstrip('/') or '127.0.0.1:8080'}")
    listen = rest.rstrip("/") if sep else listen
    host, sep, port = listen.rpartition(":")
    if not sep or not port.isdigit() or not 0 <= int(port) <= 65535:
        raise ConfigError(f"--listen wants HOST:PORT, got {listen!r}")
    return host or "127.0.0.1", int(port)
