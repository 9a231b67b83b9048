"""Each link's round trip, timed by heartbeats: the pieces on fake clocks, the wire compatible with 1.7
peers, and from outside a real cluster where one stage reaches the head through a relay adding delay."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import msgpack
import pytest

from cluster_helpers import free_port_pair, logs, spawn_join
from flowedge.api.metrics import ApiMetrics
from flowedge.client.sync_client import wait_ready
from flowedge.errors import ProtocolError
from flowedge.launch.status_view import render
from flowedge.node.link_rtt import KEEP_PINGS, Echo, RttProbe, RttSamples
from flowedge.transport import protocol as proto
from flowedge.transport import security

ROOT = Path(__file__).resolve().parents[1]


class Clock:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


def test_a_round_trip_is_sent_to_echoed_less_the_time_the_peer_held_it():
    head, peer = Clock(), Clock()
    probe, echo = RttProbe(head), Echo(peer)
    n = probe.stamp()
    head.t += 0.010
    peer.t += 3.0                           # the clocks need not agree
    echo.read(n)
    peer.t += 0.200                         # the peer's next heartbeat is due 200 ms later
    fields = echo.fields()
    head.t += 0.200 + 0.010
    assert fields["echo"] == n and fields["held_ms"] == pytest.approx(200.0)
    assert probe.sample_ms(fields["echo"], fields["held_ms"]) == pytest.approx(20.0)
    assert echo.fields() == {}              # each number once
    assert probe.sample_ms(None, 0.0) is None and probe.sample_ms(n + 99, 0.0) is None
    assert probe.sample_ms(n, 1e6) is None  # a peer cannot make a round trip negative


def test_old_numbers_are_forgotten_and_the_median_ignores_one_late_beat():
    probe = RttProbe(Clock())
    first = probe.stamp()
    for _ in range(KEEP_PINGS):
        probe.stamp()
    assert probe.sample_ms(first, 0.0) is None
    samples = RttSamples()
    assert samples.median_ms() is None
    for ms in (10.0, 11.0, 12.0, 500.0, 10.5):
        samples.add(ms)
    samples.add(None)
    assert samples.median_ms() == 11.0


def test_heartbeats_carry_the_numbers_and_stay_readable_both_ways_with_17_peers():
    beat = proto.Heartbeat(node_id="s", load=0.1, rss_bytes=5, echo=7, held_ms=12.5)
    again = proto.decode(proto.encode(beat))
    assert (again.echo, again.held_ms, again.ping) == (7, 12.5, None)
    # a 1.7 peer's heartbeat: no such fields, read with no round trip
    old = msgpack.packb({"v": [1, 7], "type": "heartbeat", "node_id": "s", "load": 0.0, "rss_bytes": 0,
                         "stats": {}, "tensors": {}})
    got = proto.decode([old])
    assert got.echo is None and got.held_ms == 0.0
    # a 1.7 peer reads ours: the codec ignores header fields a message does not have (a 1.7 node's view)
    frames = proto.encode(proto.Heartbeat(node_id="h", load=0.0, rss_bytes=0, ping=3))
    header = msgpack.unpackb(frames[0])
    assert header["ping"] == 3 and {"node_id", "load", "rss_bytes"} <= set(header)
    for bad in ({"held_ms": -1.0}, {"echo": -2}, {"ping": 1.5}):
        with pytest.raises(ProtocolError):
            proto.Heartbeat(node_id="s", load=0.0, rss_bytes=0, **bad)


def test_status_and_metrics_show_each_links_round_trip():
    nodes = [{"node_id": "head", "role": "head", "layers": []},
             {"node_id": "far", "role": "stage", "stage": 1, "layers": [0, 2], "rtt_ms": 61.25, "ready": True},
             {"node_id": "old", "role": "stage", "stage": 2, "layers": [2, 4], "rtt_ms": None, "ready": True}]
    text = render(nodes)
    assert "rtt ms" in text.splitlines()[0]
    assert "61.25" in next(line for line in text.splitlines() if line.startswith("far"))
    m = ApiMetrics()
    m.cluster(nodes)
    out = m.render().decode()
    assert 'flowedge_stage_rtt_ms{node="far",stage="1"} 61.25' in out
    assert 'node="old"' not in "".join(line for line in out.splitlines() if "rtt" in line)
    js = (ROOT / "flowedge" / "api" / "static" / "dashboard.js").read_text()
    assert '["rtt", num(n.rtt_ms)' in js   # each card shows its link's round trip


# ---- from outside: a real head, one stage near, one behind a relay ------------------------------------
DELAY_MS = 40.0


def _relay(tmp_path: Path, listen: int, target: int) -> subprocess.Popen:
    """tools/testbed's relay on loopback: both of the head's ports, 40 ms each way."""
    routes = [{"listen_host": "127.0.0.1", "listen_port": listen + k, "target_host": "127.0.0.1",
               "target_port": target + k, "dst": "head"} for k in (0, 1)]
    spec = tmp_path / "relay.json"
    spec.write_text(json.dumps({"routes": routes, "links": [], "peers": {}, "default": {"delay_ms": DELAY_MS}}))
    ready = tmp_path / "relay.ready"
    proc = subprocess.Popen([sys.executable, "-m", "tools.testbed.relay", str(spec), str(ready)], cwd=ROOT,
                            stdout=open(tmp_path / "relay.log", "ab"), stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 30
    while not ready.is_file() and time.monotonic() < deadline and proc.poll() is None:
        time.sleep(0.1)
    assert ready.is_file(), (tmp_path / "relay.log").read_text()
    return proc


def _status(addr: str, keys: Path) -> list[dict]:
    out = subprocess.run([sys.executable, "-m", "flowedge", "status", "--head", addr, "--json", "--keys", str(keys)],
                         capture_output=True, text=True, timeout=60, check=True)
    return json.loads(out.stdout)


def _rtts(addr: str, keys: Path, timeout_s: float = 40.0) -> dict[str, float]:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        rtt = {n["node_id"]: n.get("rtt_ms") for n in _status(addr, keys) if n.get("role") == "stage"}
        if len(rtt) == 2 and all(v is not None for v in rtt.values()):
            time.sleep(4.0)   # a few more samples into the median
            return {n["node_id"]: n["rtt_ms"] for n in _status(addr, keys) if n.get("role") == "stage"}
        time.sleep(0.5)
    raise AssertionError(f"no round trips within {timeout_s} s: {rtt}")


def test_a_relay_adding_delay_shows_in_that_stages_round_trip(tiny_pair, tmp_path):
    base, draft = tiny_pair
    home = tmp_path / "home"
    security.init_keys(home / "keys")
    port, relayed = free_port_pair(), free_port_pair()
    addr = f"127.0.0.1:{port}"
    cfg = tmp_path / "head.toml"
    cfg.write_text(f'role = "head"\nhead = "{addr}"\nmodel = "{base}"\ndraft = "{draft}"\nstages = 2\n'
                   f'threads = 1\nheartbeat_ms = 250\n')
    env = {**os.environ, "FLOWEDGE_HOME": str(home)}
    procs = [subprocess.Popen([sys.executable, "-m", "flowedge", "-v", "serve", "--config", str(cfg)], env=env,
                              stdout=open(tmp_path / "head.log", "ab"), stderr=subprocess.STDOUT)]
    keys = ["--keys", str(home / "keys")]
    try:
        procs.append(_relay(tmp_path, relayed, port))
        procs.append(spawn_join(addr, *keys, "--node-id", "near", log_path=tmp_path / "near.log",
                                env={"FLOWEDGE_HOME": str(tmp_path / "near")}))
        procs.append(spawn_join(f"127.0.0.1:{relayed}", *keys, "--node-id", "far", log_path=tmp_path / "far.log",
                                env={"FLOWEDGE_HOME": str(tmp_path / "far")}))
        os.environ["FLOWEDGE_HOME"] = str(home)
        wait_ready(addr, 150, alive=lambda: all(p.poll() is None for p in procs))
        rtt = _rtts(addr, home / "keys")
        print("round trips (ms):", rtt)
        # the relay's 2 x 40 ms, on top of what loopback and a busy box cost the near stage too
        assert 2 * DELAY_MS <= rtt["far"] < 2 * DELAY_MS + 80.0, rtt
        assert rtt["near"] < DELAY_MS and rtt["far"] - rtt["near"] >= 1.5 * DELAY_MS, rtt
        table = subprocess.run([sys.executable, "-m", "flowedge", "status", "--head", addr, *keys], capture_output=True,
                               text=True, timeout=60, check=True).stdout
        header, *rows = table.splitlines()
        end = header.index("rtt ms") + len("rtt ms")
        shown = {row.split()[0]: row[end - 7:end].strip() for row in rows if row.split()[:1] in (["near"], ["far"])}
        assert float(shown["far"]) >= 2 * DELAY_MS and float(shown["near"]) < DELAY_MS, table
    except BaseException:
        print(logs(tmp_path))
        raise
    finally:
        os.environ.pop("FLOWEDGE_HOME", None)
        for p in reversed(procs):
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        for p in procs:
            try:
                p.wait(20)
            except subprocess.TimeoutExpired:
                p.kill()
