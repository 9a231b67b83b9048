"""A pipeline trace: what each device and link did, and when, on the simulator's virtual clock.

Kept as plain records so the benchmark can save it as JSON and plot it later without the engine.
"""
from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import asdict, dataclass
from typing import Any

from flowedge.errors import ConfigError

KINDS = ("compute", "transfer")


@dataclass(frozen=True, slots=True)
class TraceEvent:
    """One busy interval of one lane (a device "node0", "stage1"… or a link "link0->1")."""

    lane: str
    kind: str  # "compute" | "transfer"
    phase: str  # "prefill" | "draft" | "init-segment" | "expansion" | "verify" | "prune" | "ar" …
    start_s: float
    end_s: float
    tokens: int = 0
    nbytes: int = 0
    label: str = ""

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ConfigError(f"trace event kind must be one of {KINDS}, got {self.kind!r}")
        if not self.end_s >= self.start_s >= 0:
            raise ConfigError(f"trace event needs 0 <= start_s <= end_s, got {self.start_s}, {self.end_s}")
        if self.tokens < 0 or self.nbytes < 0:
            raise ConfigError("trace event tokens and nbytes must be >= 0")

    @property
    def duration_s(self) -> float:
        return self.end_s - self.start_s


class Trace:
    """Append-only list of events plus the summaries the benchmark reports."""

    def __init__(self, events: Iterable[TraceEvent] = ()) -> None:
        self._events: list[TraceEvent] = list(events)

    def add(self, ev: TraceEvent) -> None:
        self._events.append(ev)

    @property
    def events(self) -> tuple[TraceEvent, ...]:
        return tuple(self._events)

    def __len__(self) -> int:
        return len(self._events)

    def __iter__(self) -> Iterator[TraceEvent]:
        return iter(self._events)

    def lanes(self) -> list[str]:
        """Lanes in order of first appearance."""
        return list(dict.fromkeys(ev.lane for ev in self._events))

    def makespan_s(self) -> float:
        """From the earliest start to the latest end (0.0 for an empty trace)."""
        if not self._events:
            return 0.0
        return max(ev.end_s for ev in self._events) - min(ev.start_s for ev in self._events)

    def busy_fraction(self) -> dict[str, float]:
        """Per lane: time covered by its events / makespan; overlaps count once, idle-wait not at all."""
        span_s = self.makespan_s()
        by_lane: dict[str, list[tuple[float, float]]] = {}
        for ev in self._events:
            if ev.phase != "idle-wait":
                by_lane.setdefault(ev.lane, []).append((ev.start_s, ev.end_s))
        fractions = {lane: 0.0 for lane in self.lanes()}
        if span_s <= 0:
            return fractions
        for lane, intervals in by_lane.items():
            fractions[lane] = _covered_s(intervals) / span_s
        return fractions

    def to_json(self) -> list[dict[str, Any]]:
        return [asdict(ev) for ev in self._events]

    @classmethod
    def from_json(cls, data: list[dict[str, Any]]) -> Trace:
        try:
            return cls(TraceEvent(**item) for item in data)
        except TypeError as exc:
            raise ConfigError(f"bad trace record: {exc}") from exc


def _covered_s(intervals: list[tuple[float, float]]) -> float:
    """Total length of the union of intervals."""
    total_s = 0.0
    cur: tuple[float, float] | None = None   # the union's interval being grown
    for start, end in sorted(intervals):
        if cur is not None and start <= cur[1]:
            cur = (cur[0], max(cur[1], end))
            continue
        if cur is not None:
            total_s += cur[1] - cur[0]
        cur = (start, end)
    return total_s + (cur[1] - cur[0] if cur is not None else 0.0)
