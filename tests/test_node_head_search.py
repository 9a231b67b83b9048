"""Which announced head a node dials (node/head_search.py): the heads of the one cluster are candidates,
a head that leaves HELLOs unanswered is given up for another one announced (one not given up before
first), nothing announced keeps the address, and a node given its head's address never dials another
(a node on the in-memory link, HELLOing into silence)."""
from __future__ import annotations

import logging
import threading
import time
from pathlib import Path

import pytest

from cluster_helpers import ScriptedHead
from flowedge.errors import ConfigError
from flowedge.node import node_base
from flowedge.node.droplog import DropLog
from flowedge.node.head_search import FoundHead, HeadSearch, candidates
from flowedge.node.node_base import NodeBase, NodeParts
from flowedge.node.node_config import NodeConfig
from flowedge.transport.memory_link import MemoryNetwork

log = logging.getLogger(__name__)

LAB, PROD = FoundHead("lab", "10.0.0.1", 5555), FoundHead("prod", "10.0.0.2", 6000)
IMPOSTOR, REAL, OTHER = FoundHead("lab", "10.0.0.9", 5555), FoundHead("lab", "10.0.0.1", 5555), \
    FoundHead("lab", "10.0.0.3", 5555)


class Announced:
    """A fake `browse`: what the LAN announces now, and how often it was asked."""

    def __init__(self, *heads: FoundHead) -> None:
        self.heads, self.asked = list(heads), 0

    def __call__(self, timeout_s: float) -> list[FoundHead]:
        self.asked += 1
        return list(self.heads)


def test_the_heads_of_the_only_or_the_named_cluster_are_candidates():
    assert candidates([LAB, PROD], "prod", 1) == [PROD]
    with pytest.raises(ConfigError, match=r"several flowedge heads.*lab at 10.0.0.1:5555.*--cluster NAME"):
        candidates([LAB, PROD], None, 1)
    with pytest.raises(ConfigError, match=r"no flowedge head named 'nosuch'.*flowedge join HOST:PORT"):
        candidates([LAB, PROD], "nosuch", 1)
    assert candidates([LAB], None, 1) == [LAB]
    # two heads of one name (an impostor, or a second cluster at the default name): both tried, no error
    assert candidates([IMPOSTOR, REAL, PROD], "lab", 1) == [IMPOSTOR, REAL]
    assert candidates([IMPOSTOR, REAL], None, 1) == [IMPOSTOR, REAL]


def test_a_head_that_does_not_answer_is_given_up_for_another_announced():
    lan = Announced(IMPOSTOR)
    search = HeadSearch(lan, forget_after=2)
    assert search.start(1) == IMPOSTOR and search.cluster == "lab" and lan.asked == 1
    assert search.missed() is None and lan.asked == 1            # one miss: not yet
    assert search.missed() is None and lan.asked == 2            # given up, but nothing else is announced
    lan.heads = [PROD, IMPOSTOR, REAL]                           # the real head comes up beside the impostor
    assert search.missed() is None
    assert search.missed() == REAL and search.head == REAL       # the one not given up, of the cluster joined
    search.answered()
    assert search.missed() is None and search.misses == 1
    search.answered()
    assert search.misses == 0
    lan.heads = [REAL, IMPOSTOR, OTHER]                          # the head went silent: the one never tried first
    search.missed()
    assert search.missed() == OTHER
    search.missed()
    assert search.missed() == IMPOSTOR                           # then the one given up longest ago
    lan.heads = []                                               # the impostor left: nothing else to try
    search.missed()
    assert search.missed() is None and search.head == IMPOSTOR


class QuietNode(NodeBase):
    """A node that only joins: `joined` once a head WELCOMEd it."""
    ROLE = "stage"
    FETCHING = "nothing"

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.joined = threading.Event()

    def _join(self) -> None:
        if self._hello(dict) is not None:
            self.joined.set()

    def _poll(self, wait_s: float) -> None:
        self.stop.wait(wait_s)

    def _stats(self) -> dict:
        return {}


def _joining(net: MemoryNetwork, head: str, tmp_path: Path, search: HeadSearch | None) -> QuietNode:
    cfg = NodeConfig(role="stage", node_id="quiet", head=head, insecure=True, heartbeat_ms=50, stage_timeout_s=10.0)
    node = QuietNode(cfg, NodeParts(net.link(), DropLog(log), tmp_path, search=search))
    threading.Thread(target=node.run, daemon=True).start()
    return node


def test_a_node_that_found_a_silent_head_joins_the_one_announced_next(monkeypatch, tmp_path):
    monkeypatch.setattr(node_base, "HELLO_TIMEOUT_S", 0.1)
    net = MemoryNetwork()
    head = ScriptedHead(net)
    silent = FoundHead("lab", "127.0.0.1", 1)                    # nothing listens there
    lan = Announced(silent)
    search = HeadSearch(lan, "lab", forget_after=2)
    node = _joining(net, search.start(1).addr, tmp_path, search)
    try:
        time.sleep(0.3)
        lan.heads = [silent, FoundHead("lab", "127.0.0.1", int(head.addr.rsplit(":", 1)[1]))]
        hello, _ = head.welcome()
        assert hello.node_id == "quiet" and node.joined.wait(5)
        assert node.config.head == head.addr and node.head_port == int(head.addr.rsplit(":", 1)[1])
    finally:
        node.stop.set()


def test_a_node_given_its_heads_address_never_dials_another(monkeypatch, tmp_path):
    monkeypatch.setattr(node_base, "HELLO_TIMEOUT_S", 0.05)
    node = _joining(MemoryNetwork(), "127.0.0.1:1", tmp_path, None)
    try:
        time.sleep(0.5)                                          # about 10 HELLOs into silence
        assert node.config.head == "127.0.0.1:1" and (node.head_host, node.head_port) == ("127.0.0.1", 1)
        assert not node.joined.is_set()
    finally:
        node.stop.set()
