"""The head's recent past, for the dashboard: one sample a second of what its status shows moving (tokens
a second, requests queued and running, the head's load, and each stage's load, step time and KV entries),
the last ten minutes of them, so a page opened late draws what happened before it opened.

The ring is bounded twice: in samples (`span_s / every_s`) and in bytes (`max_bytes` of compact JSON, so
a cluster of many stages keeps a shorter past rather than a bigger one, far under a status reply's cap).
A sample is a list, its fields named once in `snapshot()`'s `fields` and `stage_fields`:

    [t_unix, tokens_per_s, queued, running, head_load, [[stage, load, step_ms, kv_tokens], ...]]

A number a stage did not report is null; so is every figure of an empty stage slot (load null = missing).
No I/O and no clock of its own: the head passes the time in.
"""
from __future__ import annotations

import json
import math
from collections import deque
from collections.abc import Callable

EVERY_S = 1.0                 # one sample a second
SPAN_S = 600.0                # ten minutes of them
MAX_BYTES = 192 * 1024        # of samples as compact JSON: a status reply may carry the lot
MAX_STAGES = 64               # stage figures kept per sample (a pipeline this long is already unusual)
FIELDS = ("t", "tokens_per_s", "queued", "running", "head_load", "stages")
STAGE_FIELDS = ("stage", "load", "step_ms", "kv_tokens")


class Timeline:
    """A ring of samples, at most one per `every_s`, the last `span_s` of them in at most `max_bytes`."""

    def __init__(self, every_s: float = EVERY_S, span_s: float = SPAN_S, max_bytes: int = MAX_BYTES) -> None:
        self.every_s, self.span_s, self.max_bytes = every_s, span_s, max_bytes
        self.samples: deque[list] = deque(maxlen=max(1, int(span_s / every_s)))
        self.sizes: deque[int] = deque()
        self.bytes = 0
        self.next_s = -math.inf   # monotonic time of the next sample

    def due(self, now_s: float) -> bool:
        return now_s >= self.next_s

    def tick(self, now_s: float, take: Callable[[], list]) -> None:
        """Take a sample (`take()`) if one is due: the caller's loop may call this as often as it likes."""
        if self.due(now_s):
            self.add(take(), now_s)

    def add(self, sample: list, now_s: float) -> None:
        """Keep `sample` (taken at monotonic `now_s`), forgetting the oldest past the count or the bytes."""
        self.next_s = now_s + self.every_s
        size = len(json.dumps(sample, separators=(",", ":"))) + 1
        if len(self.samples) == self.samples.maxlen:
            self.bytes -= self.sizes.popleft()   # the deque drops its oldest as this one goes in
        self.samples.append(sample)
        self.sizes.append(size)
        self.bytes += size
        while self.bytes > self.max_bytes and len(self.samples) > 1:
            self.samples.popleft()
            self.bytes -= self.sizes.popleft()

    def snapshot(self) -> dict:
        return {"every_s": self.every_s, "span_s": self.span_s, "fields": list(FIELDS),
                "stage_fields": list(STAGE_FIELDS), "samples": list(self.samples)}


def _num(value: object, digits: int = 3) -> float | None:
    """A finite number rounded, else None (a stage's stats were checked at the head, but a bool is an int)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        return None
    return round(value, digits)


def stage_figures(row: dict) -> list:
    """One stage's [stage, load, step_ms, kv_tokens] from its status row; an empty slot has no figures."""
    if row.get("missing"):
        return [row.get("stage"), None, None, None]
    return [row.get("stage"), _num(row.get("load")), _num(row.get("step_ms_median"), 2),
            _num(row.get("kv_tokens"), 0)]


def sample(t_unix: float, live: dict, head_load: float, rows: list[dict]) -> list:
    """One sample from the head's live request figures (`HeadRequests.live`), its load and the stage rows
    (`Membership.status_rows`; drafter rows are left out)."""
    stages = [stage_figures(r) for r in rows if r.get("role") == "stage"][:MAX_STAGES]
    return [round(t_unix, 3), _num(live.get("tokens_per_s")), live.get("queued", 0), live.get("running", 0),
            _num(head_load), stages]
