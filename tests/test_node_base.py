"""The node lifecycle a stage and a drafter share (node/node_base.py), on the in-memory link against a head
played by the test: HELLO until WELCOME, heartbeats at the head's period carrying the node's stats, a silent
head or a REFUSE sends the node back to HELLO, a SHUTDOWN ends it, malformed input is dropped and counted,
shard chunks are waited for with heartbeats, and a load that fails its checksum finds its files again after a
repair (files that are not the node's to repair end it)."""
from __future__ import annotations

import logging
import threading
import time
from pathlib import Path

import pytest

from cluster_helpers import ScriptedHead
from flowedge.errors import ChecksumError, ConfigError, FlowedgeError
from flowedge.node import shard_fetch
from flowedge.node.droplog import DropLog
from flowedge.node.node_base import NodeBase, NodeParts, offered_bytes
from flowedge.node.node_config import NodeConfig
from flowedge.transport import protocol as p
from flowedge.transport.memory_link import MemoryNetwork

log = logging.getLogger(__name__)


class TinyNode(NodeBase):
    """The smallest node kind: no setup after the WELCOME, only control messages."""
    ROLE = "stage"
    FETCHING = "the tiny fetch"

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.joins = 0
        self.seen: list[p.Message | None] = []
        self.capabilities: dict = {"tiny": True}
        self.refusals: list[str] = []

    def _join(self) -> None:
        self.joins += 1
        self.phase = "joining"
        if self._hello(lambda: dict(self.capabilities)) is not None:
            self.phase = "serving"

    def _hello_refused(self, reason: str) -> None:
        self.refusals.append(reason)
        self.capabilities = {"tiny": "refused once"}

    def _poll(self, wait_s: float) -> None:
        got = self.ctrl.next_message(wait_s)
        if got is not None:
            msg = self._decode_ctrl(got)
            self.seen.append(msg)
            self._on_other(msg)

    def _stats(self) -> dict:
        return {"joins": self.joins}


@pytest.fixture
def net():
    return MemoryNetwork()


def _node(net: MemoryNetwork, head: ScriptedHead, tmp_path: Path, **config) -> TinyNode:
    cfg = NodeConfig(role="stage", node_id="tiny", head=head.addr, insecure=True,
                     **({"heartbeat_ms": 50, "stage_timeout_s": 10.0} | config))
    return TinyNode(cfg, NodeParts(net.link(), DropLog(log), tmp_path))


def _running(node: TinyNode) -> threading.Thread:
    thread = threading.Thread(target=node.run, daemon=True)
    thread.start()
    return thread


def test_hello_welcome_heartbeats_with_the_nodes_stats_then_shutdown_ends_it(net, tmp_path):
    head = ScriptedHead(net)
    node = _node(net, head, tmp_path)
    thread = _running(node)
    hello, peer = head.welcome(heartbeat_ms=40)
    assert hello.role == "stage" and hello.node_id == "tiny" and hello.capabilities == {"tiny": True}
    beats = [head.next(p.Heartbeat)[0] for _ in range(3)]
    assert all(b.node_id == "tiny" and b.stats == {"joins": 1} for b in beats)
    assert node.heartbeat_s == 0.04   # the head's period, not the config's 50 ms
    head.router.send(p.Shutdown(reason="test"), peer)
    thread.join(5)
    assert not thread.is_alive() and node.stop.is_set() and node.joins == 1


def test_a_silent_head_sends_the_node_back_to_hello(net, tmp_path, caplog):
    head = ScriptedHead(net)
    node = _node(net, head, tmp_path, stage_timeout_s=0.3)
    thread = _running(node)
    try:
        head.welcome()
        t0 = time.monotonic()
        with caplog.at_level(logging.WARNING):
            head.welcome()   # a second HELLO: the node gave up on the silent head
        assert time.monotonic() - t0 >= 0.25 and node.joins == 2
        assert any("rejoining: no word from the head for 0.3 s" in r.getMessage() for r in caplog.records)
        # the log is the node kind's own module's, as before the lifecycle moved to node_base
        assert any(r.name == __name__ for r in caplog.records)
    finally:
        node.stop.set()
        thread.join(5)


def test_a_refuse_rejoins_and_bad_input_is_dropped_not_fatal(net, tmp_path):
    head = ScriptedHead(net)
    node = _node(net, head, tmp_path)
    thread = _running(node)
    try:
        _, peer = head.welcome()
        head.router.send_frames([b"\x00not msgpack"], peer)
        head.router.send(p.Ready(stage_index=1), peer)   # not for a node: ignored
        head.router.send(p.Refuse(reason="slot taken"), peer)
        head.welcome()
        assert node.drops.counts["malformed"] == 1 and node.joins == 2
        assert [type(m) for m in node.seen] == [type(None), p.Ready, p.Refuse]
    finally:
        node.stop.set()
        thread.join(5)


def test_a_refused_hello_is_told_to_the_node_and_the_next_hello_says_what_it_holds_then(net, tmp_path):
    head = ScriptedHead(net)
    node = _node(net, head, tmp_path)
    thread = _running(node)
    try:
        hello, peer = head.next(p.Hello)
        assert hello.capabilities == {"tiny": True}
        head.router.send(p.Refuse(reason="you hold the wrong thing"), peer)
        again, _ = head.welcome()
        assert again.capabilities == {"tiny": "refused once"}
        assert len(node.refusals) == 1 and "you hold the wrong thing" in node.refusals[0]
    finally:
        node.stop.set()
        thread.join(5)


def _connected(net: MemoryNetwork, head: ScriptedHead, tmp_path: Path) -> tuple[TinyNode, bytes]:
    """A node with its control socket up (no thread): the test calls its methods itself."""
    node = _node(net, head, tmp_path)
    node._connect_ctrl()
    node.ctrl.send(p.Heartbeat(node_id="tiny", load=0.0, rss_bytes=0))
    return node, head.next(p.Heartbeat)[1]


def test_next_chunk_waits_heartbeating_and_a_shutdown_ends_the_fetch(net, tmp_path):
    head = ScriptedHead(net)
    node, peer = _connected(net, head, tmp_path)
    node.heartbeat_s = 0.05
    assert node._next_chunk(0.3) is None
    assert head.next(p.Heartbeat, 0.1)[0].node_id == "tiny"   # it beat while it waited
    chunk = p.ShardChunk(offset=0, total=3, sha256="a" * 64, data=b"abc")
    head.router.send(chunk, peer)
    assert bytes(node._next_chunk(1.0).data) == b"abc"
    head.router.send(p.Shutdown(reason="bye"), peer)
    with pytest.raises(FlowedgeError, match="during the tiny fetch: bye"):
        node._next_chunk(1.0)
    assert node.stop.is_set()
    node.close()


class FakeRepair:
    def __init__(self) -> None:
        self.repaired: list[Path] = []

    def repair(self, entry: Path, assign, err: ChecksumError) -> None:
        self.repaired.append(entry)


def test_load_fetched_finds_again_after_a_repair_and_stops_where_it_may_not_repair(net, tmp_path):
    head = ScriptedHead(net)
    node = _node(net, head, tmp_path)
    node.repair = FakeRepair()
    finds, tries = iter([tmp_path / "first", tmp_path / "again"]), []

    def load(where: Path) -> str:
        tries.append(where)
        if len(tries) == 1:
            raise ChecksumError("bad sha256")
        return f"loaded {where.name}"

    assert node._load_fetched(None, lambda: next(finds), load) == "loaded again"
    assert node.repair.repaired == [tmp_path / "first"] and tries == [tmp_path / "first", tmp_path / "again"]
    # the real repair: files outside this node's cache (the head's own split, same host) are not its to fix
    node.repair = shard_fetch.CacheRepair(tmp_path)
    tries.clear()
    with pytest.raises(ChecksumError, match="the head's copy is damaged"):
        node._load_fetched(None, lambda: tmp_path / "split", load)
    assert tries == [tmp_path / "split"]
    node.close()


def test_a_node_waiting_for_an_absent_head_backs_off_says_why_and_joins_once_it_listens(net, tmp_path, caplog,
                                                                                      monkeypatch):
    """Before: a HELLO every 5 s for ever, each the same line, and no word of the next wait."""
    from flowedge.node import node_base
    from flowedge.transport.link import Kind

    monkeypatch.setattr(node_base, "HELLO_TIMEOUT_S", 0.05)
    monkeypatch.setattr(node_base, "HELLO_MAX_WAIT_S", 0.2)
    port = 20999   # nobody listens there yet
    cfg = NodeConfig(role="stage", node_id="tiny", head=f"127.0.0.1:{port}", insecure=True, heartbeat_ms=50,
                     stage_timeout_s=10.0)
    node = TinyNode(cfg, NodeParts(net.link(), DropLog(log), tmp_path))
    with caplog.at_level(logging.WARNING):
        thread = _running(node)
        try:
            deadline = time.monotonic() + 10
            while sum("joining" in r.getMessage() for r in caplog.records) < 4 and time.monotonic() < deadline:
                time.sleep(0.02)
            said = [r.getMessage() for r in caplog.records if "joining" in r.getMessage()]
            assert [s.split("waiting up to ")[1] for s in said[:4]] == ["0.1 s for an answer", "0.2 s for an answer",
                                                                       "0.2 s for an answer", "0.2 s for an answer"]
            assert "(try 1): no answer to HELLO within 50 ms" in said[0] and "is the head up" in said[0]
            assert node.phase.startswith(f"waiting for the head at 127.0.0.1:{port}: no answer to HELLO")
            router = net.link().listen(Kind.ROUTER, "127.0.0.1", (port, port))   # the head comes up
            t0 = time.monotonic()
            got = router.next_message(5.0)   # the HELLO that was waiting for it
            router.send(p.Welcome(node_id="head", heartbeat_interval_ms=40), got.peer)
            while node.phase != "serving" and time.monotonic() - t0 < 5:
                time.sleep(0.01)
            assert node.phase == "serving" and time.monotonic() - t0 < 1.0
        finally:
            node.stop.set()
            thread.join(5)
    assert not thread.is_alive()


def test_a_node_offers_the_planner_at_most_its_memory_offer():
    """`memory_offer_gib` caps the free memory a node announces (what the planner may fill on it)."""

    assert offered_bytes(NodeConfig(role="stage", memory_offer_gib=0.25)) == 1 << 28
    assert offered_bytes(NodeConfig(role="stage")) > 1 << 28   # 0: what the OS reports free
    with pytest.raises(ConfigError, match="memory_offer_gib"):
        NodeConfig(role="stage", memory_offer_gib=-1)
