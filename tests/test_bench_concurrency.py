"""The concurrency sweep's row helpers (flowedge/bench/concurrency.py)."""
from __future__ import annotations

from flowedge.bench.concurrency import _auto_summary, percentile


def test_percentile_is_nearest_rank():
    assert percentile([], 50) is None
    assert percentile([3.0, 1.0, 2.0], 50) == 2.0
    assert percentile([5.0, 1.0, 4.0, 2.0], 0) == 1.0 and percentile([5.0, 1.0, 4.0, 2.0], 100) == 5.0


def test_auto_summary_sums_tokens_and_switches_and_keeps_each_report():
    reports = [{"choice": "flowspec", "tokens": {"flowspec": 10, "ar-pp": 5},
                "switches": [{"to": "ar-pp"}, {"to": "flowspec"}]},
               None,
               {"choice": "ar-pp", "tokens": {"ar-pp": 7}, "switches": []}]
    out = _auto_summary(reports)
    assert out["auto_tokens"] == {"flowspec": 10, "ar-pp": 12} and out["auto_switches"] == 2
    assert [r["choice"] for r in out["auto"]] == ["flowspec", "ar-pp"]   # the reasons stay readable per request
    assert _auto_summary([None, {}]) == {}
