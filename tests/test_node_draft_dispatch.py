"""The head's side of the drafter role: membership keeps drafters out of the stage slots and judges
their liveness like a stage's; the dispatch (node/draft_dispatch.py) gives every pre-draft job exactly
one outcome, never later than its timeout: the drafter's growth, or None (no drafter, declined, a bad
answer, the drafter lost or silent). Fuzzed answers never raise and never deliver twice."""
from __future__ import annotations

import logging
from dataclasses import dataclass, replace

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from draft_helpers import draft_answer
from flowedge.engine.draft_sync import snapshot
from flowedge.engine.drafter import Drafter, TreeShape
from flowedge.errors import ProtocolError
from flowedge.models.stage import StageModel
from flowedge.node import draft_wire
from flowedge.node.draft_dispatch import DRAFT_TIMEOUT_S, LATE_KEEP_S, NO_DRAFTER_HOLD_S, DraftDispatch
from flowedge.node.droplog import DropLog
from flowedge.node.membership import DrafterLost, Membership
from flowedge.node.node_config import NodeConfig
from flowedge.transport import protocol as proto

CONTEXT = list(range(3, 15))


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


@dataclass(frozen=True)
class Job:
    seq: int
    context: tuple


@dataclass(frozen=True)
class Offload:
    job: Job
    snapshot: object


@pytest.fixture(scope="module")
def draft_model(tiny_pair):
    return StageModel.load(tiny_pair[1])


@pytest.fixture(scope="module")
def snap(draft_model):
    d = Drafter(draft_model)
    d.build(CONTEXT, TreeShape(4, 2))
    d.drain_calls()
    return snapshot(d, CONTEXT, 0, 2, 4, 0)


def drafter_hello(node_id: str = "d1") -> proto.Hello:
    return proto.Hello(node_id=node_id, role="drafter", device="x86-cpu", free_memory_bytes=1,
                       capabilities={"role": "drafter"})


def setup(draft_model=None, ready: int = 1):
    clock, sent, got = Clock(), [], []
    m = Membership(NodeConfig(stages=2, heartbeat_ms=500, stage_timeout_s=2.0), lambda i, msg: sent.append((i, msg)),
                   clock)
    for k in range(ready):
        m.register(b"d%d" % k, drafter_hello(f"d{k}"))
        m.on_draft_ready(m.peers[b"d%d" % k], proto.DraftReady(model="m"))
    d = DraftDispatch(m, lambda i, msg: sent.append((i, msg)), lambda: draft_model,
                      DropLog(logging.getLogger("test")), lambda key, ev: got.append((key, ev)), clock=clock,
                      event=lambda job, growth: ("predrafted", job.seq, growth))
    return m, d, clock, sent, got


# ---- membership ----------------------------------------------------------------------------------
def test_a_drafter_takes_no_stage_slot_and_is_sent_the_draft_model():
    m, _, _, sent, _ = setup(ready=0)
    assert m.admit(drafter_hello()) is None
    m.register(b"d", drafter_hello())
    assert m.slots == [None, None] and m.peers[b"d"].drafter and not m.peers[b"d"].stage
    assert [(i, type(msg).__name__) for i, msg in sent] == [(b"d", "DraftSetup")]
    assert sent[0][1].model == "qwen2.5-coder-0.5b" and m.drafters() == []
    m.on_draft_ready(m.peers[b"d"], proto.DraftReady(model="m", error="out of memory"))
    assert m.drafters() == [] and m.status_rows()[-1]["error"] == "out of memory"
    m.on_draft_ready(m.peers[b"d"], proto.DraftReady(model="m"))
    assert m.drafters() == [m.peers[b"d"]]
    row = m.status_rows()[-1]
    assert row["role"] == "drafter" and row["ready"] and row["node_id"] == "d1"


def test_a_live_drafter_s_node_id_is_refused_until_it_is_silent():
    m, _, clock, _, _ = setup()
    assert "already joined" in m.admit(drafter_hello("d0"))
    clock.now += 2.5
    assert m.admit(drafter_hello("d0")) is None


def test_a_silent_drafter_is_dropped_like_a_stage_and_heartbeated_meanwhile():
    m, _, clock, sent, _ = setup()
    clock.now += 1.0
    m.ping(set())
    assert any(i == b"d0" and isinstance(msg, proto.Heartbeat) for i, msg in sent)
    assert m.judge(set()) == []
    clock.now += 1.5
    assert m.judge(set()) == [DrafterLost(b"d0", "d0", "silent for 2.5 s (missed heartbeats)")]
    assert m.drafters() == [] and m.slots == [None, None]


# ---- dispatch ------------------------------------------------------------------------------------
def test_a_job_goes_to_the_drafter_and_its_answer_to_the_engine(draft_model, snap):
    m, d, _, sent, got = setup(draft_model)
    d.offload(5, Offload(Job(1, tuple(CONTEXT)), snap))
    (ident, job), = [(i, msg) for i, msg in sent if isinstance(msg, proto.DraftJob)]
    assert ident == b"d0" and (job.request_id, job.seq) == (5, 1)
    from flowedge.node.draft_serve import DraftServer
    answer = DraftServer(draft_model, DropLog(logging.getLogger("t"))).run(proto.decode(job.to_frames()))
    d.on_answer(m.peers[b"d0"], proto.decode(answer.to_frames()))
    assert len(got) == 1 and got[0][0] == 5 and got[0][1][2] is not None
    assert got[0][1][2].context == tuple(CONTEXT) and d.out == {}
    d.on_answer(m.peers[b"d0"], answer)   # a duplicate: nothing more
    assert len(got) == 1 and d.counts["late"] == 1


def test_with_no_drafter_the_job_settles_empty_after_a_short_hold(snap):
    _, d, clock, sent, got = setup(ready=0)
    d.offload(5, Offload(Job(1, tuple(CONTEXT)), snap))
    d.expire()
    assert got == [] and sent == []
    clock.now += NO_DRAFTER_HOLD_S
    d.expire()
    assert got == [(5, ("predrafted", 1, None))] and d.counts["no_drafter"] == 1


@pytest.mark.parametrize("how", ["declined", "behind", "timeout", "lost", "bad-answer"])
def test_every_other_outcome_is_none_at_once(draft_model, snap, how):
    m, d, clock, _, got = setup(draft_model)
    d.offload(5, Offload(Job(1, tuple(CONTEXT)), snap))
    peer = m.peers[b"d0"]
    if how in ("declined", "behind"):
        d.on_answer(peer, proto.DraftDeclined(request_id=5, seq=1, why="error" if how == "declined" else "behind"))
    elif how == "timeout":
        clock.now += DRAFT_TIMEOUT_S - 0.01
        d.expire()
        assert got == []
        clock.now += 0.02
        d.expire()
    elif how == "lost":
        d.drafter_lost(b"d0")
    else:
        d.on_answer(peer, draft_answer(request_id=5, seq=1))   # a tree that is not the job's
    assert got == [(5, ("predrafted", 1, None))] and d.out == {}


def _answer_to(draft_model, sent) -> proto.DraftAnswer:
    from flowedge.node.draft_serve import DraftServer

    job = next(msg for _, msg in reversed(sent) if isinstance(msg, proto.DraftJob))
    return DraftServer(draft_model, DropLog(logging.getLogger("t"))).run(proto.decode(job.to_frames()))


def test_an_answer_after_the_timeout_is_still_grafted_once(draft_model, snap):
    """The job's outcome (None) came at the timeout; the growth that comes later still holds nodes valid
    under node 0's root (grafted by token path), so it goes to the engine too, once."""
    m, d, clock, sent, got = setup(draft_model)
    d.offload(5, Offload(Job(1, tuple(CONTEXT)), snap))
    answer = _answer_to(draft_model, sent)
    clock.now += DRAFT_TIMEOUT_S
    d.expire()
    assert got == [(5, ("predrafted", 1, None))]
    d.on_answer(m.peers[b"d0"], answer)
    assert len(got) == 2 and got[1][1][2] is not None and d.counts["late_grafted"] == 1
    d.on_answer(m.peers[b"d0"], answer)
    assert len(got) == 2
    # a refusal after the timeout, or an answer past LATE_KEEP_S, adds nothing
    d.offload(5, Offload(Job(2, tuple(CONTEXT)), snap))
    d.offload(6, Offload(Job(1, tuple(CONTEXT)), snap))
    late = _answer_to(draft_model, sent)
    clock.now += DRAFT_TIMEOUT_S
    d.expire()
    d.on_answer(m.peers[b"d0"], proto.DraftDeclined(request_id=5, seq=2, why="behind"))
    clock.now += LATE_KEEP_S
    d.expire()
    d.on_answer(m.peers[b"d0"], late)
    assert len(got) == 4 and got[2][1][2] is None and got[3][1][2] is None and d.expired == {}


def test_an_answer_from_another_drafter_is_not_taken(draft_model, snap):
    m, d, _, _, got = setup(draft_model, ready=2)
    d.offload(5, Offload(Job(1, tuple(CONTEXT)), snap))
    other = next(p for p in m.drafters() if p.identity != d.out[(5, 1)].identity)
    d.on_answer(other, proto.DraftDeclined(request_id=5, seq=1, why="behind"))
    assert got == [] and d.counts["late"] == 1


def test_a_request_stays_with_the_drafter_holding_its_replica_and_others_spread(snap):
    m, d, _, sent, _ = setup(ready=2)
    d.offload(5, Offload(Job(1, tuple(CONTEXT)), snap))
    d.offload(6, Offload(Job(1, tuple(CONTEXT)), snap))
    d.drafter_lost(b"d9")
    d.out.clear()
    d.offload(5, Offload(Job(2, tuple(CONTEXT)), snap))
    to = [(i, msg.request_id) for i, msg in sent if isinstance(msg, proto.DraftJob)]
    assert to[0][0] != to[1][0] and to[2] == (to[0][0], 5)


def _hostile(answer: proto.DraftAnswer, n: int, how: str) -> proto.DraftAnswer:
    """`answer` with well-formed frames but values no honest drafter sends (`n`: the job's nodes)."""
    if how.startswith("rows"):
        value = {"rows-huge": 3e38, "rows-past-half": 7e4, "rows-inf": float("inf")}[how]
        rows = torch.full_like(answer.rows, value)
        rows[..., ::2] = -value
        return replace(answer, rows=rows)
    scores = answer.log_scores.clone()
    scores[n:] = {"scores-huge": -3e38, "scores-minus-inf": float("-inf"), "scores-positive": 0.5}[how]
    return replace(answer, log_scores=scores)


@pytest.mark.parametrize("how", ["rows-huge", "rows-past-half", "rows-inf", "scores-huge", "scores-minus-inf",
                                 "scores-positive"])
def test_an_answer_with_values_out_of_range_is_refused_counted_and_settled_empty(draft_model, snap, how):
    """Finite but huge K/V rows (+-3e38) passed the shape checks and overflowed node 0's attention to NaN
    scores, failing every request while the drafter stayed; rows must be finite and within float16's
    range, scores log-probabilities in [-1e6, 0]. The job settles empty at once (node 0 drafts alone)."""
    m, d, _, sent, got = setup(draft_model)
    d.offload(5, Offload(Job(1, tuple(CONTEXT)), snap))
    answer = _answer_to(draft_model, sent)
    n = int(snap.tokens.numel())
    assert answer.tokens.numel() > n and answer.rows.shape[3] > 0   # the drafter did grow the tree
    d.on_answer(m.peers[b"d0"], proto.decode(_hostile(answer, n, how).to_frames()))
    assert got == [(5, ("predrafted", 1, None))] and d.out == {}
    assert d.counts["rejected"] == 1 and d.counts["answered"] == 0
    assert d.drops.snapshot() == {"draft_answer": 1}


def test_an_honest_answer_s_values_pass(draft_model, snap):
    m, d, _, sent, got = setup(draft_model)
    d.offload(5, Offload(Job(1, tuple(CONTEXT)), snap))
    answer = _answer_to(draft_model, sent)
    rows = answer.rows.clone()
    rows.view(-1)[0] = draft_wire.MAX_KV_ABS   # the bound itself is in range
    d.on_answer(m.peers[b"d0"], replace(answer, rows=rows))
    assert got[0][1][2] is not None and d.counts["answered"] == 1 and d.drops.snapshot() == {}


def test_growth_of_checks_the_answer_against_the_job(draft_model, snap):
    job = draft_wire.job_message(5, 1, snap)
    with pytest.raises(ProtocolError, match="job's"):
        draft_wire.growth_of(draft_answer(), snap, draft_model)
    n = int(snap.tokens.numel())
    bad = proto.DraftAnswer(request_id=5, seq=1, tokens=torch.cat([snap.tokens, torch.tensor([10 ** 5])]),
                            parents=torch.cat([job.parents, torch.tensor([0])]),
                            log_scores=torch.cat([snap.log_scores, torch.tensor([-1.0])]),
                            ran=torch.tensor([n]), rows=torch.zeros(*snap.rows.shape[:3], 1, snap.rows.shape[4]))
    with pytest.raises(ProtocolError, match="vocabulary"):
        draft_wire.growth_of(bad, snap, draft_model)


@settings(deadline=None, max_examples=200, suppress_health_check=list(HealthCheck))
@given(data=st.data())
def test_fuzz_answers_never_raise_and_settle_each_job_once(draft_model, snap, data):
    m, d, clock, _, got = setup(draft_model)
    for seq in (1, 2):
        d.offload(seq, Offload(Job(seq, tuple(CONTEXT)), snap))
    peer = m.peers[b"d0"]
    for _ in range(data.draw(st.integers(1, 4))):
        n = data.draw(st.integers(1, 40))
        r = data.draw(st.integers(0, n - 1))
        layers = data.draw(st.sampled_from([snap.rows.shape[0], 1]))
        msg = proto.DraftAnswer(
            request_id=data.draw(st.sampled_from([1, 2, 3])), seq=data.draw(st.sampled_from([1, 2])),
            tokens=torch.tensor(data.draw(st.lists(st.integers(0, 400), min_size=n, max_size=n))),
            parents=torch.tensor([data.draw(st.integers(0, i)) for i in range(n - 1)], dtype=torch.long),
            log_scores=torch.tensor(data.draw(st.lists(st.floats(-50, 0), min_size=n, max_size=n)),
                                    dtype=torch.float32),
            ran=torch.arange(1, r + 1), rows=torch.zeros(layers, 2, snap.rows.shape[2], r, snap.rows.shape[4]))
        d.on_answer(peer, msg)
    clock.now += DRAFT_TIMEOUT_S
    d.expire()
    assert sorted(k for k, _ in got) == [1, 2] and d.out == {}


def test_status_shows_the_drafter_row_and_its_jobs(snap):
    from flowedge.launch.status_view import render

    m, d, clock, _, _ = setup()
    d.offload(5, Offload(Job(1, tuple(CONTEXT)), snap))
    d.drafter_lost(b"d0")
    head = {"node_id": "head", "role": "head", "layers": "embed+head", "drafter_jobs": d.status()}
    text = render([head] + m.status_rows())
    assert "d0" in text and "drafter" in text and " draft " in text
    assert "drafter jobs: 1 sent to 1 drafter(s), 0 answered, 0 behind, 0 timed out (0 of them grafted late), " \
           "1 lost with a drafter" in text


def test_the_head_serves_a_drafter_the_draft_model_s_files_only(tmp_path):
    from types import SimpleNamespace

    from flowedge.node import draft_members
    from flowedge.node.shard_fetch import ShardFile

    (tmp_path / "layers").write_bytes(b"L" * 100)
    (tmp_path / "head").write_bytes(b"H" * 50)
    files = (ShardFile(tmp_path / "layers", "1" * 64, 100, {"config.json": "{}"}),
             ShardFile(tmp_path / "head", "2" * 64, 50, {}))
    m, _, _, sent, _ = setup(ready=0)
    m.plan = SimpleNamespace(draft_files=files)
    m.register(b"d", drafter_hello())
    got = sent[-1][1]
    assert (got.shard_sha256, got.shard_bytes, got.head_sha256, got.head_bytes) == ("1" * 64, 100, "2" * 64, 50)
    peer = m.peers[b"d"]
    m.on_shard_request(peer, proto.ShardRequest(offset=40, length=20, sha256="2" * 64))
    assert sent[-1] == (b"d", proto.ShardChunk.of(40, b"H" * 10, 50))
    n = len(sent)
    m.on_shard_request(peer, proto.ShardRequest(offset=0, sha256="3" * 64))   # not the draft's: nothing
    m.on_shard_request(peer, proto.ShardRequest(offset=0))
    assert len(sent) == n
    assert draft_members.draft_setup(m.config, SimpleNamespace(draft_files=None)).shard_sha256 == ""
