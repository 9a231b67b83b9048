"""Requests per second, per client address: one client cannot flood the API for everyone else.

The connection caps (`admission.py`) bound how many sockets an address holds, not how fast it sends
requests over them: a client that fires requests in a loop (or guesses API keys) takes the head's queue
and the server's event loop from the gateway's other apps. Each address gets a token bucket: `burst`
requests at once, refilled at `rate` a second; a request over it is answered 429 with a Retry-After,
before its key is checked or its body read. `/health` is never limited (load balancers and systemd poll
it). At most `MAX_ADDRESSES` buckets are kept: the least recently seen is forgotten first (a forgotten
address starts again with a full bucket, which is what an idle one would have anyway).

Sans-IO: the caller passes the time.
"""
from __future__ import annotations

import math
from collections import OrderedDict
from dataclasses import dataclass

from flowedge.errors import ConfigError

MAX_ADDRESSES = 4096


@dataclass(slots=True)
class _Bucket:
    tokens: float
    at: float


class RateLimit:
    def __init__(self, rate: float, burst: int, max_addresses: int = MAX_ADDRESSES) -> None:
        if rate < 0 or burst < 1:
            raise ConfigError(f"request rate limit must be >= 0/s with a burst >= 1, got {rate}/s, burst {burst}")
        self.rate, self.burst, self.max_addresses = rate, burst, max_addresses
        self.buckets: OrderedDict[str, _Bucket] = OrderedDict()
        self.refused = 0

    @property
    def enabled(self) -> bool:
        return self.rate > 0

    def admit(self, address: str, now: float) -> float:
        """0.0 if a request from `address` may go on now (and take its token), else the seconds to wait."""
        if not self.enabled:
            return 0.0
        bucket = self.buckets.pop(address, None) or _Bucket(float(self.burst), now)
        bucket.tokens = min(float(self.burst), bucket.tokens + (now - bucket.at) * self.rate)
        bucket.at = now
        self.buckets[address] = bucket   # most recently seen last
        while len(self.buckets) > self.max_addresses:
            self.buckets.popitem(last=False)
        if bucket.tokens >= 1.0:
            bucket.tokens -= 1.0
            return 0.0
        self.refused += 1
        return (1.0 - bucket.tokens) / self.rate

    @staticmethod
    def retry_after(wait_s: float) -> str:
        """The Retry-After header's value: whole seconds, at least 1."""
        return str(max(1, math.ceil(wait_s)))
