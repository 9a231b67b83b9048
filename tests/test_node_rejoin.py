"""The pieces of a deposed head's rejoin (node/rejoin.py) that need no cluster: the standby config it runs
with, the address it announces, and what its deposition says and does. The whole rejoin on real processes:
tests/test_node_deposed.py."""
from __future__ import annotations

from flowedge.node.deposition import Deposed, Deposition
from flowedge.node.node_config import NodeConfig
from flowedge.node.rejoin import standby_config
from flowedge.node.standby import announced
from flowedge.transport import protocol as proto


def test_a_deposed_head_becomes_a_standby_following_the_new_head_at_its_own_address():
    head = NodeConfig(role="head", head="10.0.0.1:5555", node_id="a", stages=3, heartbeat_ms=100,
                      stage_timeout_s=1.0, failover_s=2.5)
    cfg = standby_config(head, Deposed("b", "10.0.0.2:5555", 2))
    assert (cfg.role, cfg.head, cfg.listen) == ("standby", "10.0.0.2:5555", "10.0.0.1:5555")
    assert (cfg.name, cfg.stages, cfg.heartbeat_ms, cfg.failover_s) == ("a", 3, 100, 2.5)   # the head's own


def test_a_standby_announces_a_reachable_address_for_a_wildcard_listen():
    assert announced("10.0.0.1:5555", "10.0.0.2:5555") == "10.0.0.1:5555"
    assert announced("0.0.0.0:5557", "127.0.0.1:5555") == "127.0.0.1:5557"   # the interface toward the head
    assert announced("*:5557", "127.0.0.1:5555") == "127.0.0.1:5557"


class _Requests:
    def __init__(self) -> None:
        self.failed: list[str] = []

    def fail_waiting(self, reason: str) -> None:
        self.failed.append(reason)


def _deposed(rejoins: bool) -> tuple[Deposition, _Requests]:
    requests = _Requests()
    deposition = Deposition(link=None, term=lambda: 1, members=None, requests=requests, name="a", rejoins=rejoins)
    deposition._depose(proto.Welcome(node_id="b", heartbeat_interval_ms=100, term=2), "10.0.0.2:5555")
    return deposition, requests


def test_a_deposed_head_that_rejoins_leaves_its_loop_and_says_so():
    deposition, requests = _deposed(rejoins=True)
    assert deposition.leaving and deposition.deposed == Deposed("b", "10.0.0.2:5555", 2)
    assert requests.failed == [deposition.reason]
    assert deposition.reason.endswith("under fencing term 2 (this head's term is 1); it rejoins as that head's standby")
    assert deposition.admit(lambda hello: None)(None) == deposition.reason   # refusing until its loop ends


def test_a_deposed_head_without_the_rejoin_stands_down_as_before():
    deposition, _ = _deposed(rejoins=False)
    assert not deposition.leaving and deposition.deposed is not None
    assert deposition.reason.endswith("restart this board as a standby")
