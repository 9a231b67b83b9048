"""The heartbeat stats a peer may put into the head's status, as a typed, bounded schema checked at the
boundary (the head's membership, on every heartbeat).

A peer (a stage, a drafter, a client: anything holding the cluster key) sends a free map with each
heartbeat (`Heartbeat.stats`); the head shows a stage's and a drafter's in `status`, which feeds
`flowedge status`, `/metrics` and the dashboard. Only the keys `STATS` names are kept, each value of its
type: numbers finite, non-negative and bounded (integers within JavaScript's exact range), text cut to
a few hundred printable characters, maps with at most a few dozen short names. Everything else is
dropped and reported, so a peer can neither break a reader (a string where a number goes, NaN, which is
not JSON) nor grow the status reply: what is kept packs to at most `MAX_STATS_BYTES`, whatever was sent.
"""
from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from typing import Any

from flowedge.errors import UnfitStat as Unfit

MAX_COUNT = (1 << 53) - 1      # counters: integers a JSON reader (JavaScript) holds exactly
MAX_MS = 1e9                   # durations in ms (11 days): a step time past this is not one
MAX_TEXT_CHARS = 200
MAX_MAP_KEYS = 32
MAX_NAME_CHARS = 40
MAX_STATS_BYTES = 8192         # what STATS keeps, packed, at most (tests/test_node_peer_stats.py)
NAME = re.compile(r"[A-Za-z0-9_.:-]{1,%d}" % MAX_NAME_CHARS)   # rule names, message types
UNPRINTABLE = re.compile(r"[\x00-\x1f\x7f-\x9f]")


@dataclass(frozen=True, slots=True)
class Number:
    hi: float = MAX_COUNT
    integer: bool = False
    nullable: bool = False

    def clean(self, v: Any, refused: list[str], at: str) -> Any:
        if v is None and self.nullable:
            return None
        if type(v) is int or (type(v) is float and not self.integer):
            if math.isfinite(v) and 0 <= v <= self.hi:
                return v
        raise Unfit(f"{'an integer' if self.integer else 'a number'} in [0, {self.hi:g}]")


@dataclass(frozen=True, slots=True)
class Text:
    max_chars: int = MAX_TEXT_CHARS

    def clean(self, v: Any, refused: list[str], at: str) -> str:
        if not isinstance(v, str):
            raise Unfit("text")
        return UNPRINTABLE.sub("?", v[: self.max_chars])


@dataclass(frozen=True, slots=True)
class Record:
    """A map with known keys, each its own kind; unknown keys and unfit values are dropped."""
    fields: dict[str, Any] = field(default_factory=dict)
    nullable: bool = False

    def clean(self, v: Any, refused: list[str], at: str) -> dict | None:
        if v is None and self.nullable:
            return None
        if not isinstance(v, dict):
            raise Unfit("a map")
        out: dict[str, Any] = {}
        for key, value in v.items():
            kind = self.fields.get(key) if isinstance(key, str) else None
            if kind is None:
                refused.append(at + name_of(key))
                continue
            _keep(out, key, kind, value, refused, at)
        return out


@dataclass(frozen=True, slots=True)
class Names:
    """A map of short names (drop rules, message types) to values of one kind, at most MAX_MAP_KEYS."""
    value: Any

    def clean(self, v: Any, refused: list[str], at: str) -> dict:
        if not isinstance(v, dict):
            raise Unfit("a map")
        out: dict = {}
        for key, value in v.items():
            if not (isinstance(key, str) and NAME.fullmatch(key)) or len(out) >= MAX_MAP_KEYS:
                refused.append(at + name_of(key))
                continue
            _keep(out, key, self.value, value, refused, at)
        return out


def _keep(out: dict, key: str, kind, value: Any, refused: list[str], at: str) -> None:
    try:
        out[key] = kind.clean(value, refused, f"{at}{key}.")
    except Unfit:
        refused.append(at + key)


def name_of(key: Any) -> str:
    """A refused key as a log may quote it: short and printable."""
    text = key if isinstance(key, str) else repr(key)
    return UNPRINTABLE.sub("?", text[:MAX_NAME_CHARS]) + ("…" if len(text) > MAX_NAME_CHARS else "")


COUNT = Number(integer=True)
MS = Number(MAX_MS)

# What stages (node/stage_node.py), drafters (node/drafter_node.py) and standby heads (node/standby.py)
# report.
STATS = Record({
    "steps": COUNT,
    "step_ms_median": Number(MAX_MS, nullable=True),
    "step_ms_longest": MS,
    "threads": Number(4096, integer=True),
    "wire": Names(Record({"messages": COUNT, "wire_bytes": COUNT, "payload_bytes": COUNT})),
    "kv_tokens": COUNT,
    "requests": COUNT,
    "batched": Record({"forwards": COUNT, "requests": COUNT}, nullable=True),
    "dropped": Names(COUNT),
    "phase": Text(),
    "model": Text(),
    "model_sha256": Text(max_chars=64),   # the content key of the layers a stage holds (node/model_check.py)
    "drafter": Record({"jobs": COUNT, "answered": COUNT, "behind": COUNT, "errors": COUNT, "replicas": COUNT,
                       "job_ms_median": Number(MAX_MS, nullable=True)}, nullable=True),
    "log_tokens": COUNT,        # a standby head: request-log tokens applied (node/standby_status.py)
    "state_age_s": Number(1e7),  # a standby head: the age of the head's last HeadState
})


def clean_stats(stats: Any) -> tuple[dict[str, Any], list[str]]:
    """What of a heartbeat's stats the head keeps, and the keys it dropped (dotted paths, shortened)."""
    refused: list[str] = []
    try:
        kept = STATS.clean(stats, refused, "")
    except Unfit:
        return {}, ["(not a map)"]
    assert kept is not None, "STATS is not nullable"
    return kept, refused
