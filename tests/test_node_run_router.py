"""The head's run router (node/run_router.py): a returned segment reaches its run's request only when
that run is running and the segment is of the round its engine is in (or a prefill chunk); what is
dropped is counted once, under the rule the head always used."""
from __future__ import annotations

import logging

import torch

from flowedge.engine.jobs import REPLAY_ID_SHIFT, State
from flowedge.node.droplog import DropLog
from flowedge.node.run_router import RunRouter
from flowedge.transport import protocol as proto
from flowedge.transport.validate import ReturnPlan
from test_node_lifecycle import FakeEngine, book, prompt

H, VOCAB = 8, 100


class RoundEngine(FakeEngine):
    """The lifecycle's engine, in round 2 with 3 nodes sent (what the router reads of a real head)."""

    round_id = 2
    alive = torch.ones(3, dtype=torch.bool)


def _router():
    b, port = book()
    port.engine_ = RoundEngine()
    drops = DropLog(logging.getLogger("test_node_run_router"))
    router = RunRouter(b, lambda: ReturnPlan(H, VOCAB), drops)
    b.tick(0.0, True)
    b.submit(b"c", prompt(max_new=4), 0.0, True, [])
    b.tick(0.1, True)
    (run_id, *_), = port.engine_.starts
    return router, b, drops, run_id, port


def _segment(run_id: int, round_id: int = 2, kind: str = "draft", node: int = 1) -> proto.Segment:
    n = 0 if kind == "prefill" else 1
    return proto.Segment(run_id=run_id, round_id=round_id, seq=1, prune_version=0, kind=kind, sent_at_step=1,
                         node_ids=torch.tensor([node])[:n], parent_ids=torch.tensor([0])[:n],
                         positions=torch.tensor([5]), hidden=torch.zeros(1, H), hidden_wire="float32")


def _queued(b) -> int:
    return sum(len(r.run.work) for r in b.running.values())


def test_a_segment_of_the_current_round_is_queued_on_its_run_s_request():
    router, b, drops, run_id, _ = _router()
    assert router.segment(_segment(run_id), 0.2) and _queued(b) == 1 and drops.counts == {}


def test_a_prefill_chunk_passes_whatever_round_the_engine_is_in():
    router, b, drops, run_id, _ = _router()
    assert router.segment(_segment(run_id, round_id=0, kind="prefill"), 0.2)
    assert _queued(b) == 1 and drops.counts == {}


def test_a_stale_round_is_dropped_quietly_and_an_unsent_one_counted_once():
    router, b, drops, run_id, _ = _router()
    assert not router.segment(_segment(run_id, round_id=1), 0.2)   # the round ended: the engine skips it
    assert drops.counts == {}
    assert not router.segment(_segment(run_id, round_id=3), 0.2)   # never sent: a peer's doing
    assert drops.counts == {"round_id": 1} and _queued(b) == 0


def test_an_unknown_or_replaced_run_id_reaches_no_request():
    router, b, drops, run_id, _ = _router()
    for other in (run_id + 1, run_id + (1 << REPLAY_ID_SHIFT)):   # another run, a replay that never began
        assert not router.segment(_segment(other), 0.2)
    assert _queued(b) == 0 and drops.counts == {}


def test_a_segment_naming_nodes_the_engine_never_sent_is_dropped_under_its_rule():
    router, b, drops, run_id, _ = _router()
    assert not router.segment(_segment(run_id, node=3), 0.2)   # 3 nodes sent: ids 0..2
    assert drops.counts == {"return_ids": 1} and _queued(b) == 0


def test_a_stage_dropping_the_current_run_fails_its_request_and_a_stale_notice_is_ignored():
    router, b, _, run_id, port = _router()
    router.dropped(run_id + 1, "stage-1: its KV cache would pass 32 entries")
    assert b.pending() == 1 and not port.errors(b"c")
    router.dropped(run_id, "stage-1: its KV cache would pass 32 entries")
    (req,) = b.scheduler.ended.values()
    assert req.state is State.FAILED and b.pending() == 0
    assert port.errors(b"c") == ["a stage gave up on it (stage-1: its KV cache would pass 32 entries)"]
