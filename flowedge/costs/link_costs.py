"""What a message costs on an impaired link: the testbed relay's behaviour as a cost model.

A link carries a message in chunks of at most `CHUNK_BYTES` (the relay reads its sockets that way). Each
chunk first waits for the wire (bandwidth as serialisation, one sender at a time: a token bucket with a
one-chunk burst), then takes the one-way latency, uniform jitter of +-`jitter_s` (never below 0) and, with
probability `stall_prob`, a stall of `stall_s` standing in for a TCP retransmission. A stream stays in
order, so a chunk never arrives before the one ahead of it: jitter only delays. Every message also pays
`message_s`, the fixed cost of one more forwarding hop (the relay's socket read, wake-up and write).

`LinkClock` is one directed link's state, seeded per link, so a simulation is repeatable; `expected_s`
is the mean the head's `auto` policy and the planner price with.
"""
from __future__ import annotations

import math
import random
from dataclasses import dataclass

from flowedge.costs.profiles import LinkProfile
from flowedge.errors import ConfigError

CHUNK_BYTES = 64 * 1024


def chunks_of(nbytes: int) -> int:
    """Chunks a message of `nbytes` crosses the relay in (an empty message still is one)."""
    if nbytes < 0:
        raise ConfigError(f"nbytes must be >= 0, got {nbytes}")
    return max(1, math.ceil(nbytes / CHUNK_BYTES))


def serialise_s(link: LinkProfile, nbytes: int) -> float:
    """Time on the wire at the link's goodput."""
    return 8.0 * nbytes / link.bandwidth_bps


def expected_s(link: LinkProfile, nbytes: int) -> float:
    """Mean one-way time of one message on an idle link: what a cost estimate should charge."""
    stalls = link.stall_prob * link.stall_s * chunks_of(nbytes)
    return link.latency_s + link.message_s + serialise_s(link, nbytes) + stalls


def expected_rtt_s(link: LinkProfile, nbytes: int = 0) -> float:
    """Mean round trip of a small message and its answer."""
    return 2.0 * expected_s(link, nbytes)


def ring_s_for_link(link: LinkProfile, n_stages: int, nbytes: int = 0) -> float:
    """One trip around an `n_stages` pipeline (node 0 -> stage 1 -> ... -> stage n -> node 0) on `link`:
    the links' share, n + 1 messages of `nbytes` (a one-token segment is a few KB: latency dominates)."""
    return (n_stages + 1) * expected_s(link, nbytes)


def ring_s_from_rtts(rtts_ms: list[float | None], n_stages: int) -> float:
    """One trip's link time from the round trips the head measures to each stage (node/link_rtt.py):
    n + 1 one-way hops at half the median round trip. A stage without a figure yet (an older peer, no
    heartbeat echoed so far) counts as the others; none at all: 0 (the profiles' view, links free)."""
    known = sorted(r for r in rtts_ms if r is not None and r >= 0)
    if not known:
        return 0.0
    mid = len(known) // 2
    median_ms = known[mid] if len(known) % 2 else (known[mid - 1] + known[mid]) / 2
    return (n_stages + 1) * median_ms / 2e3


@dataclass(frozen=True, slots=True)
class Crossing:
    """One message on a link: the wire was busy [start_s, wire_end_s); it arrived at arrive_s."""
    start_s: float
    wire_end_s: float
    arrive_s: float


class LinkClock:
    """One directed link: when its wire is free, when its last chunk arrived, its own random stream."""

    def __init__(self, link: LinkProfile, seed: int | str, src: int, dst: int) -> None:
        self.link = link
        self.rng = random.Random(f"{seed}:{src}:{dst}")
        self.wire_free_s = 0.0
        self.last_arrive_s = 0.0
        self.stalls = 0

    def delay_s(self) -> float:
        """One chunk's latency: delay +- jitter, plus a stall now and then."""
        lk = self.link
        d = max(0.0, lk.latency_s + (self.rng.uniform(-lk.jitter_s, lk.jitter_s) if lk.jitter_s else 0.0))
        if lk.stall_prob and self.rng.random() < lk.stall_prob:
            self.stalls += 1
            d += lk.stall_s
        return d

    def send(self, t: float, nbytes: int) -> Crossing:
        """Send `nbytes` at `t`: chunk by chunk through the wire, each delayed, delivered in order."""
        start = wire = max(t, self.wire_free_s)
        arrive = self.last_arrive_s
        left = nbytes
        for _ in range(chunks_of(nbytes)):
            size = min(left, CHUNK_BYTES)
            left -= size
            wire += serialise_s(self.link, size)
            arrive = max(arrive, wire + self.delay_s())
        arrive += self.link.message_s
        self.wire_free_s, self.last_arrive_s = wire, arrive
        return Crossing(start, wire, arrive)


class LinkClocks:
    """Every directed link of one simulation, made on first use; (-1: the drafter device)."""

    def __init__(self, link: LinkProfile, seed: int | str = 0) -> None:
        self.link, self.seed = link, seed
        self.clocks: dict[tuple[int, int], LinkClock] = {}

    def send(self, src: int, dst: int, t: float, nbytes: int) -> Crossing:
        key = (src, dst)
        if key not in self.clocks:
            self.clocks[key] = LinkClock(self.link, self.seed, src, dst)
        return self.clocks[key].send(t, nbytes)
