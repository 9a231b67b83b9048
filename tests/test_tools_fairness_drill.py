"""tools/fairness_drill.py on real processes (a tiny cluster and its HTTP front, over ZeroMQ and HTTP): a
flood of 40 requests on each channel from one client, and another client's 8-token request is still
answered within 2 x its idle time + one running request's time, token-identical; the flood past its cap
is refused with Busy / 429, and nothing goes unanswered. The in-process version of the same rule, and
the fair queue's finer rules, are in test_node_fairness.py and test_engine_fair_queue.py."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tools"))

import fairness_drill  # noqa: E402
from flowedge.errors import Busy  # noqa: E402

pytestmark = pytest.mark.serial   # judged against the clock: run alone (Makefile)


def test_a_non_answer_is_counted_by_its_error_not_taken_for_an_answer():
    import httpx

    results = [TimeoutError(), httpx.Response(429), httpx.Response(200), Busy("busy")]
    assert fairness_drill.outcome_counts(results) == {"TimeoutError": 1, "429": 1, "answered": 1, "Busy": 1}
    assert fairness_drill.tokens_of("http", httpx.Response(503)) is None

def test_a_polite_client_is_answered_within_the_bound_while_another_floods(tmp_path):
    out = tmp_path / "fairness.json"
    proc = subprocess.run([sys.executable, str(ROOT / "tools" / "fairness_drill.py"), "--flood", "40",
                           "--timeout", "120", "--deadline", "400", "--json", str(out)],
                          capture_output=True, text=True, timeout=500)
    fig = json.loads(out.read_text()) if out.is_file() else None
    assert proc.returncode == 0 and fig is not None, (fig, proc.stderr[-3000:])
    assert fig["queue_full_before_polite"], fig   # the polite requests went in behind the flood's full queue
    for channel, refused in (("zmq", "Busy"), ("http", "429")):
        c = fig[channel]
        assert c["answered"] and c["tokens"] == 8 and c["same_as_idle"], c
        assert c["polite_s"] <= c["bound_s"], c
        assert set(c["flood"]) == {"answered", refused} and c["flood"][refused] >= 4, c   # no timeouts, no cuts
