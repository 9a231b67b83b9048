"""The head's recent past (node/timeline.py): a sample a second, bounded in count and in bytes, each
sample read from the status the head already builds (an empty slot and an odd stat drawn as null)."""
from __future__ import annotations

import json

from flowedge.node.timeline import FIELDS, STAGE_FIELDS, Timeline, sample, stage_figures

LIVE = {"queued": 2, "running": 1, "tokens_per_s": 12.3456}


def stage(k: int, **extra) -> dict:
    return {"role": "stage", "stage": k, "load": 0.5, "step_ms_median": 12.345, "kv_tokens": 300} | extra


def test_a_sample_names_what_the_status_shows_moving():
    rows = [stage(1), {"role": "stage", "stage": 2, "missing": True}, {"role": "drafter", "load": 1.0}]
    got = sample(1000.0, LIVE, 0.25, rows)
    assert got == [1000.0, 12.346, 2, 1, 0.25, [[1, 0.5, 12.35, 300], [2, None, None, None]]]
    assert len(FIELDS) == len(got) and len(STAGE_FIELDS) == len(got[-1][0])


def test_odd_stats_become_null_not_errors():
    assert stage_figures(stage(1, load=True, step_ms_median="x", kv_tokens=float("nan"))) == [1, None, None, None]


def test_one_sample_a_second_however_often_the_loop_asks():
    t = Timeline(every_s=1.0)
    for i in range(50):   # the head's loop runs far more often than once a second
        t.tick(i * 0.1, lambda: [i])
    assert [s[0] for s in t.snapshot()["samples"]] == [0, 10, 20, 30, 40]


def test_the_ring_keeps_the_last_span_only():
    t = Timeline(every_s=1.0, span_s=10.0)
    for i in range(25):
        t.add([i], float(i))
    assert [s[0] for s in t.samples] == list(range(15, 25))
    assert t.bytes == sum(len(json.dumps(s, separators=(",", ":"))) + 1 for s in t.samples)


def test_the_ring_is_capped_in_bytes_too():
    t = Timeline(every_s=1.0, span_s=600.0, max_bytes=2000)
    big = sample(1.0, LIVE, 0.1, [stage(k) for k in range(1, 9)])
    for i in range(600):
        t.add(big, float(i))
    assert t.bytes <= 2000 and len(json.dumps(list(t.samples), separators=(",", ":"))) <= 2000
    assert 1 < len(t.samples) < 600


def test_the_snapshot_names_its_fields():
    t = Timeline()
    t.add(sample(5.0, LIVE, 0.0, [stage(1)]), 0.0)
    snap = t.snapshot()
    assert snap["fields"] == list(FIELDS) and snap["stage_fields"] == list(STAGE_FIELDS)
    assert snap["every_s"] == 1.0 and snap["span_s"] == 600.0 and len(snap["samples"]) == 1
    json.dumps(snap)   # it travels in a status reply
