"""The re-plan around a lost board (node/shrink.py), driven by a fake clock over fake membership: when
it re-plans, onto what, and what it leaves alone."""
from __future__ import annotations

from dataclasses import dataclass, field
from types import SimpleNamespace

import pytest

from flowedge.node import shrink
from flowedge.node.node_config import NodeConfig
from flowedge.node.shrink import Shrinker
from flowedge.transport import protocol as proto

RECOVERY_S = 10.0


def _hello(name: str) -> proto.Hello:
    return proto.Hello(node_id=name, role="stage", device="no-such-board", free_memory_bytes=8 << 30,
                       capabilities={"data_addr": "tcp://127.0.0.1:1"})


@dataclass
class FakeMembers:
    config: NodeConfig
    plan: object = field(default_factory=lambda: SimpleNamespace(
        base_config=SimpleNamespace(num_hidden_layers=6), ranges=[(0, 2), (2, 4), (4, 6)], counts=[2, 2, 2]))
    slots: list = field(default_factory=lambda: [b"a", b"b", b"c"])
    peers: dict = field(default_factory=lambda: {i: SimpleNamespace(name=f"stage-{n}", stage=n, hello=_hello(f"s{n}"))
                                                  for n, i in enumerate([b"a", b"b", b"c"], 1)})
    sent_assign: dict = field(default_factory=lambda: {1: 0, 2: 0, 3: 0})
    assigned: int = 0
    full: bool = False

    def cluster_ready(self) -> bool:
        return None not in self.slots

    def admit(self, hello):
        return "the plan is full (2 stages); stop a stage or raise `stages`" if self.full else None

    def assign_all(self) -> None:
        self.assigned += 1


class FakeRequests:
    def __init__(self) -> None:
        self.failed: list[str] = []
        self.extended: list[float] = []

    def fail_waiting(self, message: str) -> None:
        self.failed.append(message)

    def extend_deadlines(self, until_s: float) -> None:
        self.extended.append(until_s)


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def _shrinker(**config):
    cfg = NodeConfig(stages=3, recovery_s=RECOVERY_S, **config)
    members, requests, clock, splits = FakeMembers(cfg), FakeRequests(), Clock(), []

    def split(plan, counts, config, home):
        splits.append((counts, config.stages))
        return SimpleNamespace(base_config=plan.base_config, ranges=[(0, 3), (3, 6)], counts=counts, split_dir="x")

    s = Shrinker(cfg, members, SimpleNamespace(config=cfg), requests, None, split=split, clock=clock)
    return s, members, requests, clock, splits


def _lose(s, members, clock, stage: int = 2) -> None:
    s.tick()   # whole once
    members.peers.pop(members.slots[stage - 1])
    members.slots[stage - 1] = None
    s.tick()


def _settle(s) -> None:
    if s.pending is not None:
        s.pending.result(5)
    s.tick()


def test_a_slot_empty_to_near_the_end_of_recovery_is_replanned_onto_the_survivors():
    s, members, requests, clock, splits = _shrinker()
    _lose(s, members, clock)
    s.pending.result(5)   # the survivors' split is written from the loss on, in the background
    clock.now += s.wait_s() - 0.1
    s.tick()
    assert s.started_s is None and members.slots[1] is None   # not applied yet: the board may still come back
    assert not requests.extended and [e.kind for e in s.events] == ["lost"]
    clock.now += 0.2
    s.tick()
    # the waiting requests outlive the split being written (it can take a while on a big model)
    assert requests.extended == [pytest.approx(clock.now + s.budget_s())] and members.slots[1] is None
    clock.now += 1.0
    _settle(s)
    assert splits == [([3, 3], 2)]
    assert requests.extended[1] == pytest.approx(clock.now + s.budget_s())   # and the survivors' reload
    assert members.slots == [b"a", b"c"] and [members.peers[i].stage for i in members.slots] == [1, 2]
    assert members.config.stages == 2 and s.engines.config.stages == 2
    assert members.assigned == 1 and not members.sent_assign   # every survivor is assigned its new range
    assert [e.kind for e in s.events] == ["lost", "replanning"]
    s.tick()   # the survivors report ready
    assert [e.kind for e in s.events] == ["lost", "replanning", "replanned"] and s.last_replan_s is not None
    assert s.wait_s() == RECOVERY_S - shrink.LEAD_S


def test_a_board_back_within_the_wait_leaves_the_plan_alone():
    s, members, requests, clock, splits = _shrinker()
    _lose(s, members, clock)
    clock.now += 1.0
    members.slots[1] = b"b2"
    members.peers[b"b2"] = SimpleNamespace(name="stage-2", stage=2, hello=_hello("s2"))
    s.tick()
    clock.now += RECOVERY_S
    s.tick()
    assert not requests.failed and members.slots == [b"a", b"b2", b"c"] and s.pending is None
    assert [e.kind for e in s.events] == ["lost"]


@pytest.mark.parametrize("config", [{"replan_on_loss": False}])
def test_the_switch_turns_it_off(config):
    s, members, requests, clock, splits = _shrinker(**config)
    _lose(s, members, clock)
    clock.now += RECOVERY_S
    s.tick()
    assert not splits and not s.events


def test_slots_empty_before_the_cluster_was_ever_whole_are_not_replanned():
    s, members, requests, clock, splits = _shrinker()
    members.slots[2] = None   # a stage that has not joined yet
    s.tick()
    clock.now += RECOVERY_S
    s.tick()
    assert not splits and not s.events


def test_survivors_too_small_fail_the_waiting_requests_at_once_and_on_every_turn(monkeypatch):
    monkeypatch.setattr(shrink, "survivor_counts", lambda *a: "does not fit: 1.25 GiB missing (2 layers unplaced)")
    s, members, requests, clock, splits = _shrinker()
    _lose(s, members, clock)
    clock.now += s.wait_s()
    s.tick()
    assert not splits and len(requests.failed) == 1
    assert "stage-2 (stage 2) was lost" in requests.failed[0] and "1.25 GiB missing" in requests.failed[0]
    assert requests.failed[0].startswith("cluster not ready: ")   # a ClusterNotReady at the client
    s.tick()   # a request that arrived meanwhile fails too, without waiting out recovery_s
    assert len(requests.failed) == 2 and s.events[-1].kind == "no_fit"


def test_a_board_back_after_the_replan_is_a_spare():
    s, members, requests, clock, splits = _shrinker()
    assert s.admit(_hello("stage-2")) is None
    _lose(s, members, clock)
    clock.now += s.wait_s()
    s.tick()
    _settle(s)
    members.full = True
    why = s.admit(_hello("stage-2"))
    assert "waits as a spare" in why and "stage-2 was lost" in why
    assert s.status()["spares"] == ["stage-2"] and s.events[-1].kind == "spare"


def test_survivor_counts_without_a_profile_split_by_layer_count():
    hellos = [_hello(n) for n in ("a", "b")]   # a board no shipped profile describes
    assert shrink.survivor_counts(NodeConfig(), SimpleNamespace(num_hidden_layers=5), hellos) in ([3, 2], [2, 3])
    assert "no stage is left" in shrink.survivor_counts(NodeConfig(), SimpleNamespace(num_hidden_layers=5), [])


def test_status_says_what_happened():
    from flowedge.launch.status_view import membership_lines

    s, members, requests, clock, splits = _shrinker()
    _lose(s, members, clock)
    clock.now += s.wait_s()
    s.tick()
    _settle(s)
    members.full = True
    s.admit(_hello("stage-2"))
    lines = membership_lines([{"membership": s.status()}])
    assert lines[0].startswith("membership: lost: stage-2 left") and "re-planning onto stage-1, stage-3" in lines[1]
    assert lines[-1] == "spares: stage-2"
    assert membership_lines([{"role": "head"}]) == []


def test_a_spare_gets_the_empty_slot_before_any_second_replan():
    s, members, requests, clock, splits = _shrinker()
    _lose(s, members, clock)
    clock.now += s.wait_s()
    s.tick()
    _settle(s)
    s.tick()
    members.full = True
    s.admit(_hello("stage-2"))   # the first board, back: a spare
    _lose(s, members, clock, stage=1)   # another board goes
    clock.now += s.wait_s()
    requests.extended.clear()
    s.tick()
    assert s.started_s is None and requests.extended   # no re-plan yet: the spare's next HELLO takes the slot
    assert requests.extended[0] == pytest.approx(s.lost_at + RECOVERY_S + shrink.SPARE_WAIT_S)
    members.slots[0] = b"spare"
    members.peers[b"spare"] = SimpleNamespace(name="stage-2", stage=1, hello=_hello("stage-2"))
    s.tick()
    assert s.events[-1].kind == "back" and not s.spares and [e.kind for e in s.events].count("replanning") == 1


def test_a_board_back_during_the_replan_keeps_the_plan():
    s, members, requests, clock, splits = _shrinker()
    _lose(s, members, clock)
    clock.now += s.wait_s()
    s.tick()   # decided; the split is applied on a later turn
    assert s.started_s is not None
    members.slots[1] = b"b2"
    members.peers[b"b2"] = SimpleNamespace(name="stage-2", stage=2, hello=_hello("s2"))
    s.tick()
    assert members.slots == [b"a", b"b2", b"c"] and members.config.stages == 3 and members.assigned == 0
    assert s.events[-1].kind == "back" and s.started_s is None and s.pending is None
    members.full = True
    assert s.admit(_hello("stage-9")).startswith("the plan is full")   # no re-plan happened: no spares


def test_with_no_stage_left_there_is_nothing_to_replan_onto():
    s, members, requests, clock, splits = _shrinker()
    s.tick()
    members.slots = [None, None, None]
    s.tick()
    clock.now += RECOVERY_S
    s.tick()
    assert not splits and not requests.failed and not s.events   # the usual recovery deadline applies
