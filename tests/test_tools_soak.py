"""tools/soak.py and tools/soak_load.py: the slopes (least squares per hour, a restarted process from its
new pid, the warm-up left out), how a 503 is judged spurious, and a short soak of a real tiny cluster."""
from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tools"))

import soak  # noqa: E402
import soak_load  # noqa: E402


def test_the_slope_is_per_hour_and_flat_is_zero():
    assert soak.slope_per_hour([(t, 100 + 2 * t) for t in range(0, 60, 5)]) == pytest.approx(7200)
    assert soak.slope_per_hour([(t, 5.0) for t in range(10)]) == 0
    assert soak.slope_per_hour([(0, 1), (1, 2)]) is None   # too few points to say


def test_slopes_leave_out_the_warm_up_and_a_restarted_stage_starts_over():
    rows = [(t, "head", 1, 100.0 + (50 if t < 60 else t / 36), 20, 5) for t in range(0, 300, 5)]
    rows += [(t, "stage-1", 2, 500.0, 20, 5) for t in range(0, 100, 5)]        # killed at 100 s
    rows += [(t, "stage-1", 3, 200.0 + t / 3600, 21, 5) for t in range(105, 300, 5)]   # its restart
    out = soak.slopes(rows, warmup_s=60)
    assert out["head"]["rss_mb_per_h"] == pytest.approx(100, rel=1e-6)   # the jump before 60 s is not in it
    assert out["stage-1"]["pid"] == 3 and out["stage-1"]["rss_mb_per_h"] == pytest.approx(1, rel=1e-6)
    assert out["stage-1"]["fds"] == [21, 21]


def test_a_503_is_spurious_only_when_the_head_was_ready_and_nothing_was_hurt():
    r = soak_load.Readiness("127.0.0.1:1")
    now = time.monotonic()
    assert r.calm(now - 5, now)
    r.hurt()
    assert not r.calm(now - 5, time.monotonic())
    assert r.calm(now + 10, now + 20)
    r.unready.append(now + 15)
    assert not r.calm(now + 10, now + 20)


def test_a_wrong_answer_is_counted():
    tally = soak_load.Tally()
    load = soak_load.Load("127.0.0.1:1", "http://127.0.0.1:1", tally, soak_load.Readiness("127.0.0.1:1"),
                          concurrency=1, rate=1.0)
    load.refs["zmq", 0] = [1, 2, 3]
    load._check("zmq", "zmq", 0, [1, 2, 3])
    load._check("zmq-stream", "zmq", 0, [1, 2, 4])
    assert tally.as_dict()["wrong_at_t0"] == 1 and tally.wrong == [("zmq-stream", 0)]


def test_a_short_soak_of_a_tiny_cluster_loses_nothing(tmp_path):
    out = tmp_path / "soak.json"
    proc = subprocess.run([sys.executable, str(ROOT / "tools" / "soak.py"), "--duration", "25", "--chaos-every",
                           "8", "--warmup", "5", "--sample-every", "2", "--json", str(out), "--home", str(tmp_path)],
                          capture_output=True, text=True, timeout=400)
    assert proc.returncode == 0, proc.stderr[-3000:]
    fig = json.loads(out.read_text())
    assert fig["requests"] >= 10 and sum(fig["chaos"].values()) >= 2, fig
    assert fig["failures"] == {} and fig["wrong_at_t0"] == 0 and fig["spurious_503"] == 0, fig
    assert {"head", "stage-1", "stage-2", "http"} <= set(fig["processes"]), fig["processes"]
