"""The tests' fakes stand for real seams: each subclasses the interface it plays (or, for a class of
another library, matches the methods it imitates), and its methods take the interface's parameters, so
a change to a seam breaks the fakes too instead of passing unnoticed."""
from __future__ import annotations

import ast
from pathlib import Path

import psutil
import pytest
from interface_check import signature_drift
from test_engine_fair_queue import Echo as QueueEcho
from test_engine_predraft import _IdleEngine
from test_engine_scheduler import Echo as SchedulerEcho
from test_node_base import FakeRepair
from test_node_lifecycle import ChainEngine, FakeEngine, FakePort
from test_node_live_figures import FakeProcess
from test_node_shrink import FakeMembers, FakeRequests
from test_tools_soak import FakeProcs, soak

from flowedge.engine.head import Head
from flowedge.engine.jobs import RequestEngine
from flowedge.node.head_engines import HeadEngines
from flowedge.node.head_ports import HeadOutbox
from flowedge.node.head_requests import EnginePort, HeadRequests, OutPort
from flowedge.node.membership import Membership
from flowedge.node.shard_fetch import CacheRepair

TESTS = Path(__file__).resolve().parent
SUBCLASSING = [(FakeEngine, RequestEngine), (ChainEngine, RequestEngine), (QueueEcho, RequestEngine),
               (SchedulerEcho, RequestEngine), (_IdleEngine, RequestEngine), (FakePort, EnginePort),
               (FakePort, OutPort)]
IMITATING = [(FakeRepair, CacheRepair, ("repair",)), (FakeProcess, psutil.Process, ("cpu_percent",)),
             (FakeMembers, Membership, ("cluster_ready", "admit", "assign_all")),
             (FakeRequests, HeadRequests, ("fail_waiting", "extend_deadlines")),
             (FakeProcs, soak.Processes, ("kill_restart", "stop_cont", "kill_for_good"))]
REAL = [(Head, RequestEngine), (HeadEngines, EnginePort), (HeadOutbox, OutPort)]


@pytest.mark.parametrize("fake, interface", SUBCLASSING, ids=lambda c: c.__name__)
def test_a_fake_subclasses_its_interface_and_takes_its_parameters(fake, interface):
    assert interface in fake.__mro__   # (issubclass refuses a Protocol that is not runtime_checkable)
    assert signature_drift(fake, interface) == []


@pytest.mark.parametrize("fake, real, names", IMITATING, ids=lambda c: getattr(c, "__name__", ""))
def test_a_fake_of_a_concrete_class_takes_its_parameters(fake, real, names):
    assert signature_drift(fake, real, names) == []


@pytest.mark.parametrize("real, interface", REAL, ids=lambda c: c.__name__)
def test_the_real_parts_match_the_interfaces_the_fakes_play(real, interface):
    assert signature_drift(real, interface) == []


def test_every_fake_in_the_tests_is_checked_here():
    """A class named Fake* in tests/ must appear above (add a row when adding a fake)."""
    checked = {c.__name__ for c, *_ in SUBCLASSING + IMITATING}
    fakes = {node.name for path in TESTS.glob("*.py") for node in ast.walk(ast.parse(path.read_text()))
             if isinstance(node, ast.ClassDef) and node.name.startswith("Fake")}
    # an io.StringIO; a real zmq head; the fields of a membership Peer (no methods to drift)
    assert fakes - checked <= {"FakeTTY", "FakeHead", "FakePeer"}, fakes - checked


def test_a_stale_fake_is_caught():
    class Renamed(RequestEngine):
        def start(self, request_id, prompt, max_new_tokens, params, now=None):
            return []

        def receive(self, event, now=None):
            return []

    class Missing(RequestEngine):
        def start(self, run_id, prompt_ids, max_new_tokens, params, now=None):
            return []

    class Loose(RequestEngine):
        def start(self, *args, **kwargs):
            return []

        def receive(self, event, extra=None):
            return []

    assert [d.split("(")[0] for d in signature_drift(Renamed, RequestEngine)] == ["Renamed.start"]
    assert signature_drift(Missing, RequestEngine) == [
        "Missing.receive: missing (the interface RequestEngine has it)"]
    assert len(signature_drift(Loose, RequestEngine)) == 2
