"""The heartbeat stats schema (node/peer_stats.py) and the head's membership using it: a peer's stats
keep only known keys of the right type and range (a string `stage` or `last_seen_s`, markup in
`step_ms_median`, NaN, an unknown key: dropped and counted), can never stand for what the head knows of
the peer, and stay small: two peers sending 600 KB each no longer push `status` past what a client reads.
What real stages and drafters report passes whole."""
from __future__ import annotations

import json
import logging
from types import SimpleNamespace

import msgpack

from flowedge.node.droplog import DropLog
from flowedge.node.membership import MAX_ADDR_CHARS, MAX_DRAFTERS, Membership
from flowedge.node.node_config import NodeConfig
from flowedge.node.peer_stats import MAX_STATS_BYTES, clean_stats
from flowedge.transport import protocol as proto

XSS = "<img src=x onerror=\"document.body.dataset.pwned='yes'\">"


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def hello(node_id: str, role: str = "stage", **caps) -> proto.Hello:
    caps = caps or ({"data_addr": f"tcp://127.0.0.1:{7000 + len(node_id)}"} if role == "stage" else {"role": role})
    return proto.Hello(node_id=node_id, role=role, device="x86-cpu", free_memory_bytes=1, capabilities=caps)


def members(stages: int = 2, joined: int = 2, **cfg) -> Membership:
    m = Membership(NodeConfig(stages=stages, heartbeat_ms=500, stage_timeout_s=2.0, **cfg), lambda i, msg: None,
                   Clock())
    for k in range(1, joined + 1):
        m.register(b"s%d" % k, hello(f"s{k}"))
    return m


def beat(m: Membership, identity: bytes, stats: dict) -> None:
    m.on_heartbeat(m.peers[identity], proto.Heartbeat(node_id="x", load=0.5, rss_bytes=10, stats=stats))


def status_bytes(m: Membership) -> int:
    """The status reply as the head sends it; decoding it is what a client (and `/health`) does."""
    frames = proto.StatusReply(nodes=[{"node_id": "head", "role": "head"}] + m.status_rows()).to_frames()
    assert proto.decode(frames).nodes[1]["role"] == "stage"
    return sum(len(f) for f in frames)


# ---- the schema --------------------------------------------------------------------------------------
def stage_stats() -> dict:
    from flowedge.node.stage_node import StageNode
    from flowedge.node.wire import WireCounter

    wire = WireCounter(curve=True)
    wire.count, wire.wire, wire.payload = {"segment": 3, "prune": 1}, {"segment": 900, "prune": 90}, \
        {"segment": 800, "prune": 10}
    node = SimpleNamespace(step_s=[0.01, 0.03], compute=SimpleNamespace(longest_s=0.5), wire=wire,
                           worker=SimpleNamespace(cached_tokens=lambda: 12, slots={1: 0}, forwards=4,
                                                  forward_requests=5),
                           drops=DropLog(logging.getLogger("t")), model_sha256="ab" * 32)
    node.drops.drop("segment_width", "x")
    return StageNode._stats(node)


def test_what_a_real_stage_and_drafter_report_passes_whole():
    stats = stage_stats()
    assert clean_stats(stats) == (stats, [])
    drafter = {"phase": "drafting with qwen", "model": "qwen", "dropped": {},
               "drafter": {"jobs": 3, "answered": 2, "behind": 1, "errors": 0, "replicas": 1, "job_ms_median": 4.5}}
    assert clean_stats(drafter) == (drafter, [])
    idle = {"steps": 0, "step_ms_median": None, "batched": None, "drafter": None, "wire": {}}
    assert clean_stats(idle) == (idle, [])


def test_unknown_keys_wrong_types_and_out_of_range_values_are_dropped():
    kept, refused = clean_stats({
        "stage": XSS, "last_seen_s": "soon", "step_ms_median": XSS, "steps": 7, "threads": float("nan"),
        "step_ms_longest": 1e300, "kv_tokens": -1, "requests": True, "batched": {"forwards": 2, "extra": 1},
        "dropped": {"segment_width": 2, "<b>x</b>": 1, "prune_order": "many"}, "phase": "a\x1b[2Jb" * 100,
        "wire": {"segment": {"messages": 1, "wire_bytes": 2, "payload_bytes": 3, "x": 4}, "prune": [1]},
        1: 2,
    })
    assert kept == {"steps": 7, "batched": {"forwards": 2}, "dropped": {"segment_width": 2},
                    "phase": "a?[2Jb" * 33 + "a?", "wire": {"segment": {"messages": 1, "wire_bytes": 2,
                                                                         "payload_bytes": 3}}}
    assert set(refused) == {"stage", "last_seen_s", "step_ms_median", "threads", "step_ms_longest", "kv_tokens",
                            "requests", "batched.extra", "dropped.<b>x</b>", "dropped.prune_order",
                            "wire.segment.x", "wire.prune", "1"}
    assert clean_stats([1, 2]) == ({}, ["(not a map)"])


def test_whatever_is_sent_what_is_kept_packs_under_the_cap():
    long_name = "n" * 40
    worst = {"phase": "\U0001F600" * 10_000, "model": "\U0001F600" * 10_000,
             "dropped": {f"{long_name[:-4]}{i:04d}": (1 << 53) - 1 for i in range(5000)},
             "wire": {f"{long_name[:-4]}{i:04d}": {"messages": (1 << 53) - 1, "wire_bytes": (1 << 53) - 1,
                                                 "payload_bytes": (1 << 53) - 1} for i in range(5000)},
             **{f"junk{i}": "y" * 1000 for i in range(600)}}
    kept, refused = clean_stats(worst)
    assert len(kept["dropped"]) == len(kept["wire"]) == 32 and len(refused) > 600
    assert len(msgpack.packb(kept)) <= MAX_STATS_BYTES
    json.dumps(kept, allow_nan=False)   # and it is JSON (no NaN), as the HTTP API and the dashboard need


# ---- the head's membership -------------------------------------------------------------------------------
def test_hostile_stats_cannot_stand_for_what_the_head_knows_and_are_counted():
    """Stats were merged over the head's own fields: a string `stage` and markup in `step_ms_median` reached
    the dashboard, a string `last_seen_s` stopped it drawing."""
    m = members()
    m.clock.now += 0.25
    beat(m, b"s1", {"stage": XSS, "step_ms_median": XSS, "last_seen_s": "soon", "node_id": "evil", "ready": True,
                    "steps": 5})
    row = m.status_rows()[0]
    assert row["stage"] == 1 and row["node_id"] == "s1" and row["ready"] is False and row["steps"] == 5
    assert row["last_seen_s"] == 0.25 and "step_ms_median" not in row
    assert m.drops.snapshot() == {"peer_stats": 1}
    beat(m, b"s1", stage_stats())
    assert m.drops.snapshot() == {"peer_stats": 1}


def test_two_peers_sending_600_kb_of_stats_leave_status_small():
    m = members()
    beat(m, b"s1", {"phase": "x" * 600_000, "step_ms_median": 3.0})
    beat(m, b"s2", {"junk": "y" * 300_000, "dropped": {f"rule{i}": i for i in range(30_000)}})
    assert status_bytes(m) < 16 * 1024
    assert m.status_rows()[0]["step_ms_median"] == 3.0 and len(m.status_rows()[1]["dropped"]) == 32


def test_drafters_are_capped_and_each_drafter_row_is_bounded():
    m = members()
    for k in range(MAX_DRAFTERS):
        assert m.admit(hello(f"d{k}", "drafter")) is None
        m.register(b"d%d" % k, hello(f"d{k}", "drafter"))
        m.on_draft_ready(m.peers[b"d%d" % k], proto.DraftReady(model="qwen", error="e" * 4000))
        beat(m, b"d%d" % k, {"phase": "p" * 600_000, "model": XSS, "stage": 3})
    assert "drafters already" in m.admit(hello("one-more", "drafter"))
    row = m.status_rows()[-1]
    assert row["stage"] is None and row["model"] == m.config.draft and len(row["error"]) <= 500
    assert status_bytes(m) < (2 + MAX_DRAFTERS) * (MAX_STATS_BYTES + 2048)


def test_a_stage_s_data_address_is_bounded():
    m = members(joined=0)
    assert m.admit(hello("s9", data_addr="tcp://" + "h" * (MAX_ADDR_CHARS - 6))) is None
    assert "data_addr" in m.admit(hello("s9", data_addr="tcp://" + "h" * MAX_ADDR_CHARS))
    assert "data_addr" in m.admit(hello("s9", data_addr=["tcp://x:1"]))
