"""A real stage worker (tiny model) behind the StageInbox: bogus messages are dropped and counted,
a failing request is reset, nothing escapes and nothing hangs — including under fuzzing."""
from __future__ import annotations

import logging
import random

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from flowedge.engine.stage_worker import StageWorker, tree_rows
from flowedge.models.stage import StageModel, StageParts
from flowedge.node import stage_inbox, wire
from flowedge.node.droplog import DropLog
from flowedge.node.stage_inbox import StageInbox, plan_for
from flowedge.transport import protocol as p

from stage_fuzz_helpers import Hung, decode_valid, random_message, time_bound

H = 64                       # the tiny model's hidden width
MESSAGE_BOUND_S = 5.0        # per message: a hang shows up as Hung, not as a stuck test run


@pytest.fixture(scope="module")
def stage_model(tiny_pair):
    return StageModel.load(tiny_pair[0], StageParts(0, 2))


def _inbox(model, log_name="inbox-test") -> StageInbox:
    worker = StageWorker(1, model, 2)
    return StageInbox(worker, plan_for(worker, "float16"), DropLog(logging.getLogger(log_name), burst=3))


def _prefill(run_id=1, n=3) -> p.Segment:
    none = torch.empty(0, dtype=torch.long)
    return p.Segment(run_id=run_id, round_id=0, seq=1, prune_version=0, kind="prefill", sent_at_step=0,
                     node_ids=none, parent_ids=none, positions=torch.arange(n), hidden=torch.randn(n, H).half())


def _draft(node_ids, parent_ids, width=H, prune_version=0, roots=None) -> p.Segment:
    """Tree nodes (ids as the engine's, no shift); `roots`: rows hanging off the committed context."""
    n = len(node_ids)
    return p.Segment(run_id=1, round_id=0, seq=2, prune_version=prune_version, kind="draft", sent_at_step=0,
                     node_ids=torch.tensor(node_ids), parent_ids=torch.tensor(parent_ids),
                     root_rows=None if roots is None else torch.tensor(roots),
                     positions=torch.arange(3, 3 + n), hidden=torch.randn(n, width).half())


def _prune(commit, keep, horizon=8, version=1) -> p.Prune:
    return p.Prune(run_id=1, round_id=0, version=version, horizon=horizon,
                   commit_ids=torch.tensor(commit, dtype=torch.long), keep_ids=torch.tensor(keep, dtype=torch.long))


# ---- regression tests: the defects found from outside ------------------------------------------------
def test_overlapping_prune_sets_are_dropped_and_counted(stage_model):
    inbox = _inbox(stage_model)
    assert len(inbox.handle(_prefill()).sends) == 1
    assert inbox.handle(_prune([0], [0, 1])).sends == []
    assert inbox.drops.counts == {"prune_overlap": 1}


def test_a_self_parent_segment_returns_at_once(stage_model):
    inbox = _inbox(stage_model)
    inbox.handle(_prefill())
    with time_bound(MESSAGE_BOUND_S):
        assert inbox.handle(_draft([2], [2])).sends == []
    assert inbox.drops.counts == {"segment_parents": 1}


def test_the_ancestor_walk_ends_even_on_a_cycle():
    parent_of = torch.tensor([1, 0, 2, 0])          # 0 <-> 1 a cycle, 2 its own parent, 3 a root
    is_root = torch.tensor([False, False, False, True])
    with time_bound(MESSAGE_BOUND_S):
        rows = tree_rows(parent_of, is_root, torch.tensor([0, 2, 3]), torch.tensor([0, 1, 2, 3]))
    assert rows.tolist() == [[True, True, False, False], [False, False, True, False],
                             [False, False, False, True]]


def test_hidden_states_of_the_wrong_width_are_dropped(stage_model):
    inbox = _inbox(stage_model)
    inbox.handle(_prefill())
    assert inbox.handle(_draft([0], [0], width=H + 1, roots=[0])).sends == []
    assert inbox.drops.counts == {"segment_width": 1}
    assert len(inbox.handle(_draft([0], [0], roots=[0])).sends) == 1      # the stage still serves the request


def test_an_error_inside_the_worker_fails_only_that_request(stage_model):
    inbox = _inbox(stage_model)
    inbox.handle(_prefill())
    assert inbox.handle(_prune([5], [])).sends == []   # node 5 was never sent: the worker raises
    assert inbox.drops.counts == {"request_failed": 1}
    assert inbox.worker.slots == {}                        # its KV cache is freed
    out = inbox.handle(_prefill(run_id=2)).sends     # the next request runs normally
    assert len(out) == 1 and out[0].run_id == 2


def test_a_request_past_its_kv_bound_is_reset_and_reported(stage_model, monkeypatch):
    monkeypatch.setattr(stage_inbox, "KV_ROOM_CONTEXTS", 1)   # the bound at one context, as small as the test's
    inbox = _inbox(stage_model)
    inbox.handle(_prefill())
    inbox.plan = type(inbox.plan)(hidden_size=H, hidden_wire="float16", max_positions=6)
    assert len(inbox.handle(_draft([0, 1], [0, 0], roots=[0])).sends) == 1    # 3 + 2 entries fit
    assert inbox.handle(_draft([2, 3], [1, 2])).sends == []          # 5 + 2 do not
    assert inbox.drops.counts == {"context_full": 1}
    assert inbox.worker.slots == {}
    assert [rid for rid, _ in inbox.take_freed()] == [1] and inbox.take_freed() == []   # the head is told once


# ---- the outside report's setup: 1,000 decode-valid random messages into a real StageWorker ---------
def _feed(handle, messages) -> tuple[int, int]:
    raised = hung = 0
    for msg in messages:
        try:
            with time_bound(MESSAGE_BOUND_S):
                handle(msg)
        except Hung:
            hung += 1
        except Exception:  # noqa: BLE001 - counting what escapes is the point
            raised += 1
    return raised, hung


def _report_messages(seed=14, count=1000) -> list[p.Message]:
    rng = random.Random(seed)
    out: list[p.Message] = []
    while len(out) < count:
        msg = random_message(rng, H)
        if msg is not None:
            out.append(decode_valid(msg))
    return out


def test_1000_random_messages_raise_nothing_and_hang_nothing(stage_model):
    messages = _report_messages()
    bare = StageWorker(1, stage_model, 2)
    raw_raised, _ = _feed(lambda m: bare.receive(wire.from_wire(m, stage_model.dtype)), messages)
    assert raw_raised > 0          # the same messages straight into the worker do fail: the test can fail
    inbox = _inbox(stage_model)
    assert _feed(inbox.handle, messages) == (0, 0)
    assert sum(inbox.drops.counts.values()) > 0


# ---- property-based fuzzing: random sequences into a fresh worker ------------------------------------
@settings(max_examples=1500, deadline=None, suppress_health_check=list(HealthCheck))
@given(seed=st.integers(0, 2**32 - 1), length=st.integers(1, 6), start_with_prefill=st.booleans())
def test_fuzz_stage_message_handling(stage_model, seed, length, start_with_prefill):
    rng = random.Random(seed)
    messages = [_prefill(run_id=rng.randrange(3), n=rng.randrange(1, 5))] if start_with_prefill else []
    while len(messages) < length:
        msg = random_message(rng, H)
        if msg is not None:
            messages.append(decode_valid(msg))
    inbox = _inbox(stage_model, "fuzz")
    assert _feed(inbox.handle, messages) == (0, 0)


class _Poisoned:
    """The tiny stage model, except that a forward containing a row whose first value is POISON raises
    (a kernel error that one request's input sets off, whether batched or alone)."""
    POISON = 1234.0

    def __init__(self, model) -> None:
        self._model = model

    def __getattr__(self, name):
        return getattr(self._model, name)

    def _check(self, hidden) -> None:
        if bool((hidden[:, 0] == self.POISON).any()):
            raise RuntimeError("poisoned row")

    def forward_layers(self, hidden, *args, **kwargs):
        self._check(hidden)
        return self._model.forward_layers(hidden, *args, **kwargs)

    def forward_packed(self, hidden, *args, **kwargs):
        self._check(hidden)
        return self._model.forward_packed(hidden, *args, **kwargs)


def _draft_of(run_id, hidden) -> p.Segment:
    return p.Segment(run_id=run_id, round_id=0, seq=2, prune_version=0, kind="draft", sent_at_step=0,
                     node_ids=torch.tensor([0, 1]), parent_ids=torch.tensor([0, 0]), root_rows=torch.tensor([0]),
                     positions=torch.arange(3, 5), hidden=hidden)


def test_one_request_failing_inside_a_batched_forward_fails_only_that_request(stage_model):
    """Three requests' segments packed into one forward; request 2's rows make it raise. Requests 1 and 3
    get exactly the hidden states they get running alone, and keep serving; only 2 is failed."""
    torch.manual_seed(14)
    prefills = {rid: _prefill(run_id=rid) for rid in (1, 2, 3)}
    drafts = {rid: _draft_of(rid, torch.randn(2, H).half()) for rid in (1, 2, 3)}
    drafts[2] = _draft_of(2, torch.full((2, H), _Poisoned.POISON).half())
    inbox = _inbox(stage_model)
    inbox.worker.model = _Poisoned(stage_model)
    for rid in (1, 2, 3):
        inbox.handle(prefills[rid])
    out = inbox.run([inbox.admit(drafts[rid]) for rid in (1, 2, 3)])   # one wave: a batch of three
    assert inbox.worker.batch_sizes[-1] == 2            # the batch raised; 1 and 3 then ran alone
    assert sorted(s.run_id for s in out.sends) == [1, 3]
    assert inbox.drops.counts == {"request_failed": 1} and sorted(inbox.worker.slots) == [1, 3]
    for rid in (1, 3):   # the reference: the same request on a fresh stage, alone
        alone = _inbox(stage_model, log_name="alone")
        alone.handle(prefills[rid])
        ref = alone.handle(drafts[rid]).sends[0]
        got = next(s for s in out.sends if s.run_id == rid)
        assert torch.equal(got.hidden, ref.hidden)
        assert inbox.worker.cache_lengths()[rid] == alone.worker.cache_lengths()[rid] == 5
    commits = [p.Prune(run_id=rid, round_id=0, version=1, horizon=2, commit_ids=torch.tensor([0, 1]),
                       keep_ids=torch.tensor([], dtype=torch.long)) for rid in (1, 3)]
    assert inbox.run([inbox.admit(c) for c in commits]).sends == []   # both go on: commit both drafts
    assert inbox.worker.slots[1].prefix_len == inbox.worker.slots[3].prefix_len == 5
    batch = inbox.run([inbox.admit(p.Segment(
        run_id=rid, round_id=0, seq=3, prune_version=1, kind="draft", sent_at_step=0,
        node_ids=torch.tensor([2]), parent_ids=torch.tensor([1]), positions=torch.tensor([5]),
        hidden=torch.randn(1, H).half())) for rid in (1, 3)])
    assert sorted(s.run_id for s in batch.sends) == [1, 3] and inbox.worker.batch_sizes[-1] == 2
