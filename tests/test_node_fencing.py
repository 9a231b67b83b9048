"""Split brain ruled out (node/fencing.py): a node obeys only the highest fencing term it has seen.

The rule by itself (`TermGuard`), the head's side (its term on every WELCOME and HEARTBEAT it sends), and a
node on the in-memory link between two heads played by the test: the head it follows is lost, the standby
takes over under a higher term, and when the deposed head comes back its WELCOME (and any heartbeat under
its old term) is refused with StaleTerm, while the node goes on with the new head."""
from __future__ import annotations

import logging
import threading
import time

import pytest

from cluster_helpers import ScriptedHead
from flowedge.errors import HeadRefusedStandby, StaleTerm
from flowedge.node import wire
from flowedge.node.droplog import DropLog
from flowedge.node.fencing import TermGuard, next_term
from flowedge.node.head_ports import ControlPort
from flowedge.node.node_base import NodeParts
from flowedge.node.node_config import NodeConfig
from flowedge.node.standby import StandbyNode
from flowedge.transport import protocol as p
from flowedge.transport.link import Kind
from flowedge.transport.memory_link import MemoryNetwork
from test_node_base import TinyNode

log = logging.getLogger(__name__)


def test_a_node_obeys_the_highest_term_and_refuses_a_lower_one():
    guard = TermGuard()
    guard.obey(0)   # an older head (no term) while none is known
    guard.obey(1, "head")
    guard.obey(1, "head")   # the same term again (its heartbeats)
    guard.obey(2, "standby")
    with pytest.raises(StaleTerm, match=r"StaleTerm: head head speaks with fencing term 1, but this node obeys term 2"):
        guard.obey(1, "head")
    with pytest.raises(StaleTerm):
        guard.obey(0)
    assert (guard.highest, guard.head) == (2, "standby")
    assert next_term(0) == 1 and next_term(1) == 2 and next_term(7) == 8


def test_the_head_puts_its_term_on_every_welcome_and_heartbeat_it_sends():
    net = MemoryNetwork()
    router = net.link().listen(Kind.ROUTER, "127.0.0.1")
    dealer = net.link().connect(Kind.DEALER, router.address)
    dealer.send(p.Hello(node_id="n", role="stage", device="x", free_memory_bytes=0))
    peer = router.next_message(1.0).peer
    port = ControlPort(router, wire.WireCounter(curve=False), term=5)
    port.send(peer, p.Welcome(node_id="h", heartbeat_interval_ms=10))
    port.send(peer, p.Heartbeat(node_id="h", load=0.0, rss_bytes=0))
    port.send(peer, p.Shutdown(reason="bye"))
    got = [p.decode(dealer.next_message(1.0).frames) for _ in range(3)]
    assert [getattr(m, "term", None) for m in got] == [5, 5, None]
    assert p.decode(p.Welcome(node_id="h", heartbeat_interval_ms=10, term=5).to_frames()).term == 5


def _welcome(head: ScriptedHead, term: int, name: str) -> bytes:
    _, peer = head.next(p.Hello)
    head.router.send(p.Welcome(node_id=name, heartbeat_interval_ms=40, term=term), peer)
    return peer


def _soon(cond, timeout_s: float = 5.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if cond():
            return True
        time.sleep(0.02)
    return False


def _node(net: MemoryNetwork, heads: list[ScriptedHead], tmp_path) -> tuple[TinyNode, threading.Thread]:
    cfg = NodeConfig(role="stage", node_id="tiny", head=heads[0].addr, heads=[h.addr for h in heads], insecure=True,
                     heartbeat_ms=50, stage_timeout_s=0.3)
    node = TinyNode(cfg, NodeParts(net.link(), DropLog(log), tmp_path))
    thread = threading.Thread(target=node.run, daemon=True)
    thread.start()
    return node, thread


def test_a_deposed_head_that_comes_back_is_refused_with_stale_term(tmp_path):
    net = MemoryNetwork()
    old, new = ScriptedHead(net), ScriptedHead(net)
    node, thread = _node(net, [old, new], tmp_path)
    try:
        _welcome(old, 1, "old-head")          # the head, term 1; then it goes silent (lost)
        _welcome(new, 2, "standby")           # the node moves on to the standby, which took over under term 2
        assert _soon(lambda: node.fence.highest == 2)
        # the new head goes quiet for a moment; the node tries the old address, where the deposed head answers
        _welcome(old, 1, "old-head")
        refusal, _ = old.next(p.Refuse)
        assert refusal.reason.startswith("StaleTerm:") and "term 1" in refusal.reason and "term 2" in refusal.reason
        _welcome(new, 2, "standby")           # and it goes back to the head it obeys
        assert _soon(lambda: node.phase == "serving" and node.config.head == new.addr)
        assert (node.fence.highest, node.fence.head) == (2, "standby")
    finally:
        node.stop.set()
        thread.join(5)


def test_a_heartbeat_under_a_lower_term_on_a_followed_connection_is_refused(tmp_path):
    net = MemoryNetwork()
    head, other = ScriptedHead(net), ScriptedHead(net)
    node, thread = _node(net, [head, other], tmp_path)
    try:
        peer = _welcome(head, 3, "head")
        head.router.send(p.Heartbeat(node_id="head", load=0.0, rss_bytes=0, term=3), peer)
        head.router.send(p.Heartbeat(node_id="impostor", load=0.0, rss_bytes=0, term=2), peer)
        refusal, _ = head.next(p.Refuse)
        assert "StaleTerm" in refusal.reason and "fencing term 2" in refusal.reason
        other.next(p.Hello)   # it left that connection and looks for a head again
        assert node.fence.highest == 3 and node.fence.head == "head"
    finally:
        node.stop.set()
        thread.join(5)


class _FakeHead:
    """Just what a StandbyNode reads of the head it may become before it takes over."""

    def __init__(self) -> None:
        self.stop = threading.Event()
        self.members = self.engines = None   # the plan it serves: read once it follows a re-plan


def test_a_standby_refuses_to_follow_a_head_that_cannot_replicate():
    cfg = NodeConfig(role="standby", head="127.0.0.1:5555", listen="127.0.0.1:5557", node_id="sb")
    standby = StandbyNode(cfg, _FakeHead(), entries=None)
    with pytest.raises(HeadRefusedStandby, match=r"speaks flowedge protocol 1\.7.*needs 1\.8"):
        standby._check(p.Welcome(node_id="old", heartbeat_interval_ms=100, version=(1, 7)))
    with pytest.raises(HeadRefusedStandby, match="needs a head speaking flowedge protocol 1.8"):
        standby._refused(Exception("refused by peer: hello.role must be one of ['head', 'stage'], got 'standby'"))
    standby._check(p.Welcome(node_id="new", heartbeat_interval_ms=100, term=4))
    assert standby.fence.highest == 4

