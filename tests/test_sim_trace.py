"""Trace records: validation, busy fractions, JSON round trip."""
from __future__ import annotations

import json

import pytest

from flowedge.errors import ConfigError
from flowedge.sim.trace import Trace, TraceEvent


def _trace() -> Trace:
    tr = Trace()
    tr.add(TraceEvent("node0", "compute", "draft", 0.0, 1.0, tokens=16))
    tr.add(TraceEvent("link0->1", "transfer", "init-segment", 1.0, 1.5, nbytes=4096))
    tr.add(TraceEvent("stage1", "compute", "init-segment", 1.5, 3.5, tokens=16))
    tr.add(TraceEvent("stage1", "compute", "expansion", 3.0, 4.0, tokens=64))  # overlaps: count once
    tr.add(TraceEvent("node0", "compute", "idle-wait", 1.0, 4.0))  # waiting is not busy
    return tr


def test_busy_fraction_counts_overlaps_once_and_skips_idle() -> None:
    busy = _trace().busy_fraction()
    assert busy == pytest.approx({"node0": 0.25, "link0->1": 0.125, "stage1": 0.625})
    assert Trace().busy_fraction() == {}


def test_makespan_and_lanes_in_first_seen_order() -> None:
    tr = _trace()
    assert tr.makespan_s() == 4.0
    assert tr.lanes() == ["node0", "link0->1", "stage1"]
    assert len(tr) == 5


def test_json_round_trip() -> None:
    tr = _trace()
    data = json.loads(json.dumps(tr.to_json()))
    again = Trace.from_json(data)
    assert again.events == tr.events
    with pytest.raises(ConfigError):
        Trace.from_json([{"lane": "x"}])


@pytest.mark.parametrize(
    "kwargs",
    [
        {"kind": "sleep"},
        {"start_s": 2.0, "end_s": 1.0},
        {"start_s": -1.0},
        {"tokens": -3},
    ],
)
def test_invalid_events_cannot_exist(kwargs: dict) -> None:
    base = {"lane": "stage1", "kind": "compute", "phase": "verify", "start_s": 0.0, "end_s": 1.0}
    with pytest.raises(ConfigError):
        TraceEvent(**{**base, **kwargs})
