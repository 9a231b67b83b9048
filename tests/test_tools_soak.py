"""tools/soak.py, soak_load.py and soak_faults.py: the slopes (least squares per hour, a restarted process
from its new pid, the warm-up left out), how a 503 is judged spurious and a failure lost or clear, the
fault schedule (a stage kill restarted or not, a board lost once, a head kill refused without a standby),
and a short soak of a real tiny cluster under HTTP and ZeroMQ load and scheduled faults (under 3 min)."""
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
import soak_faults  # noqa: E402
import soak_load  # noqa: E402
from flowedge.errors import ConfigError, FlowedgeError  # noqa: E402


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


def test_a_wrong_answer_is_counted_with_where_it_left_the_reference():
    tally = soak_load.Tally()
    load = soak_load.Load("127.0.0.1:1", "http://127.0.0.1:1", tally, soak_load.Readiness("127.0.0.1:1"),
                          concurrency=1, rate=1.0)
    load.refs["zmq", 0] = [1, 2, 3]
    load._check("zmq", "zmq", 0, [1, 2, 3])
    load._check("zmq-stream", "zmq", 0, [1, 2, 4])
    assert tally.as_dict()["wrong_at_t0"] == 1
    [seen] = tally.wrong
    assert (seen["kind"], seen["prompt"], seen["first_difference"]) == ("zmq-stream", 0, 2)
    assert (seen["got"], seen["ref"]) == ([1, 2, 4], [1, 2, 3])
    assert soak_load.difference("http", 1, "abc", "abcdef", 0.0)["first_difference"] == 3   # cut short


def test_a_failure_is_lost_only_when_nothing_said_what_happened():
    import httpx

    assert soak_load.is_lost(FlowedgeError("the head at x gave no answer for 120 s"))
    assert soak_load.is_lost(httpx.ReadError("cut")) and soak_load.is_lost(httpx.ReadTimeout("slow"))
    assert not soak_load.is_lost(FlowedgeError("stage 2 (stage-2) disconnected, and no node took its place"))
    tally = soak_load.Tally()
    tally.fail("zmq: no answer", lost=True, spurious=True)
    tally.fail("http: HTTP 503", spurious=True)
    tally.answered()
    assert (tally.lost, tally.clear_errors, tally.spurious_errors, tally.answered_ok) == (1, 1, 1, 1)


class FakeProcs:
    """Three slots (head and two stages) recording what the faults did to them."""

    def __init__(self) -> None:
        self.cluster = type("C", (), {"procs": [None, None, None]})()
        self.lost, self.did = set(), []

    def kill_restart(self, k, gap_s):
        self.did.append(("restart", k))

    def stop_cont(self, k, stop_for_s):
        self.did.append(("stop", k))

    def kill_for_good(self, k):
        self.did.append(("lost", k))
        self.lost.add(k)

    def kill_head(self):
        self.did.append(("head", 0))
        self.standby_left -= 1
        return "head killed"

    standby_left = 1

    def can_kill_head(self):
        return self.standby_left > 0


def _run(faults, for_s: float) -> tuple[FakeProcs, soak_faults.Schedule]:
    import threading

    procs, sched, stop = FakeProcs(), soak_faults.Schedule(faults), threading.Event()
    t = threading.Thread(target=sched.run, args=(procs, soak_load.Readiness("127.0.0.1:1"), stop))
    t.start()
    time.sleep(for_s)
    stop.set()
    t.join(5)
    return procs, sched


def test_stage_kills_come_on_schedule_and_a_board_is_lost_once_and_never_hurt_again():
    procs, sched = _run([soak_faults.StageKill(every_s=0.1), soak_faults.BoardLost(first_s=0.25)], 1.0)
    assert ("lost", 2) in procs.did and procs.did.count(("lost", 2)) == 1
    after = procs.did[procs.did.index(("lost", 2)) + 1:]
    assert after and all(k == 1 for _, k in after)              # the lost slot is never picked again
    assert sched.counts["board-lost"] == 1 and sched.counts["stage-kill"] >= 6, sched.counts
    procs, _ = _run([soak_faults.StageKill(every_s=0.1, restart=False)], 0.5)
    assert procs.did == [("lost", 1), ("lost", 2)] or procs.did == [("lost", 2), ("lost", 1)]   # then none left


def test_a_head_kill_is_refused_without_a_standby_and_the_schedule_is_built_from_the_command_line():
    with pytest.raises(ConfigError, match="standby"):
        soak_faults.Schedule([soak_faults.HeadKill(every_s=60)]).check(standby=False)
    soak_faults.Schedule([soak_faults.HeadKill(every_s=60)]).check(standby=True)
    args = type("A", (), dict(stage_kill_every=600.0, no_restart=True, gap=2.0, chaos_every=0.0, stop_for=3.0,
                              board_lost_at=900.0, head_kill_every=0.0))()
    faults = soak_faults.schedule(args)
    assert [f.name for f in faults] == ["stage-kill", "board-lost"] and not faults[0].restart
    proc = subprocess.run([sys.executable, str(ROOT / "tools" / "soak.py"), "--head-kill-every", "60"],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and "needs a standby head" in proc.stderr, proc.stderr[-2000:]


def test_a_head_kill_without_a_standby_to_spare_is_done_once():
    """--no-head-restart: the killed head stays dead, so the second kill has no standby: it is not tried."""
    procs, sched = _run([soak_faults.HeadKill(every_s=0.1)], 0.6)
    assert procs.did == [("head", 0)] and sched.counts == {"head-kill": 1}, (procs.did, sched.counts)


def test_the_standby_config_is_the_heads_with_the_standby_keys(tmp_path):
    import tomllib

    import soak_standby

    head = tmp_path / "head.toml"
    head.write_text('role = "head"\nhead = "127.0.0.1:5"\nnode_id = "head"\nstages = 2\nlayers = [2, 2]\n')
    cfg = soak_standby.standby_config(head, tmp_path / "s.toml", "127.0.0.1:5", "127.0.0.1:7", "standby-0")
    got = tomllib.loads(cfg.read_text())
    assert got == {"role": "standby", "head": "127.0.0.1:5", "listen": "127.0.0.1:7", "node_id": "standby-0",
                   "failover_s": soak_standby.FAILOVER_S, "stages": 2, "layers": [2, 2]}


@pytest.mark.serial   # spurious errors are judged against the clock: run alone (Makefile)
def test_a_short_soak_with_every_fault_loses_and_spoils_nothing(tmp_path):
    """The soak CI can afford, with every fault the hour-long one has: a tiny cluster with a standby head under
    HTTP and ZeroMQ load for 60 s, a stage kill -9'ed every 15 s (restarted), quick chaos every 8 s, and the
    head kill -9'ed every 25 s (the standby takes over; the old head comes back as the new standby, so the
    second kill hits the head that took over). Nothing lost, nothing wrong, no spurious error."""
    out = tmp_path / "soak.json"
    proc = subprocess.run([sys.executable, str(ROOT / "tools" / "soak.py"), "--duration", "60", "--standby",
                           "--head-kill-every", "25", "--stage-kill-every", "15", "--chaos-every", "8",
                           "--warmup", "5", "--sample-every", "2", "--json", str(out), "--home", str(tmp_path)],
                          capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:] + _trouble(tmp_path)
    fig = json.loads(out.read_text())
    chaos = fig["chaos"]
    assert chaos.get("stage-kill", 0) >= 2 and chaos.get("head-kill", 0) >= 1 and chaos.get("chaos"), fig["faults"]
    for _, what in fig["faults"]:
        assert not what.startswith("head at") or ("serving after" in what and "restarted at" in what), what
    assert {"http", "zmq"} & set(fig["by_kind"]) == {"http", "zmq"}, fig["by_kind"]
    seen = {k: fig[k] for k in ("sent", "answered_ok", "clear_errors", "lost", "wrong_at_t0", "wrong",
                                "spurious_errors", "spurious_503", "failures", "faults")}
    assert fig["lost"] == fig["wrong_at_t0"] == fig["spurious_errors"] == fig["spurious_503"] == 0, seen
    assert fig["requests"] >= 30 and fig["answered_ok"] >= fig["sent"] - fig["clear_errors"], seen
    assert {"head", "standby", "stage-1", "stage-2", "http"} <= set(fig["processes"]), fig["processes"]
    assert all("fds_pct_per_h" in p for p in fig["processes"].values() if "rss_mb_per_h" in p), fig["processes"]


def _trouble(home: Path, limit: int = 6000) -> str:
    """The nodes' errors and tracebacks from a soak's logs: a failure in CI is explained by its own output."""
    out = []
    for log in sorted(home.glob("run/*/*.log")):
        lines = log.read_text(errors="replace").splitlines()
        picked = [i for i, line in enumerate(lines) if " ERROR " in line or "Traceback" in line or " 500 " in line]
        shown = sorted({j for i in picked for j in range(i, min(i + 12, len(lines)))})
        out += [f"--- {log.name}"] + [lines[j] for j in shown]
    return "\n" + "\n".join(out)[-limit:]


def test_a_stream_that_ends_with_an_error_is_a_clear_error_not_a_wrong_answer(monkeypatch):
    """A stream cut by a lost board ends with an `error` event after a few chunks: it was compared as a
    short answer and counted wrong."""
    import httpx

    body = ('data: {"choices": [{"text": "Once"}]}\n\n'
            'data: {"error": {"message": "stage 2 disconnected, and no node took its place"}}\n\ndata: [DONE]\n\n')
    transport = httpx.MockTransport(lambda request: httpx.Response(200, text=body))
    monkeypatch.setattr(soak_load.httpx, "stream", lambda *a, **k: httpx.Client(transport=transport).stream(*a, **k))
    tally = soak_load.Tally()
    load = soak_load.Load("127.0.0.1:1", "http://127.0.0.1:1", tally, soak_load.Readiness("127.0.0.1:1"),
                          concurrency=1, rate=1.0)
    load.refs["http", 0] = "Once upon"
    with pytest.raises(FlowedgeError, match="no node took its place"):
        load._http_stream(0)
    assert tally.wrong == []
