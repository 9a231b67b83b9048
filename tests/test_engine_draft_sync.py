"""The drafter device's replica and grafting (engine/draft_sync.py): a replica grown from node 0's snapshot
computes exactly what node 0 would have, and its answer grafted by token path — on time or after the walk
moved on — leaves node 0's tree and K/V as if node 0 had drafted those nodes itself."""
from __future__ import annotations

import pytest
import torch

from flowedge.core.tree import DraftTree
from flowedge.engine.draft_sync import DrafterDevice, ReplicaBehind, _depths, check_growth, graft, snapshot
from flowedge.engine.drafter import Drafter, TreeShape
from flowedge.models.stage import StageModel
from draft_helpers import rooted, tree_paths

CONTEXT = list(range(3, 15))
WIDTH, LOOKUP = 4, 0


@pytest.fixture(scope="module")
def draft_model(tiny_pair):
    return StageModel.load(tiny_pair[1])


def _rooted(model, context=CONTEXT) -> Drafter:
    return rooted(model, context)


_paths = tree_paths


def _ran_paths(d: Drafter) -> set[tuple[int, ...]]:
    d._slots.grow(len(d.base))
    return {tuple(d.base.path_tokens(int(i))) for i in d._slots.ran.nonzero().reshape(-1)}


def _next_logits(d: Drafter) -> torch.Tensor:
    """The draft's log-probs for the best open node: what node 0's next call would compute."""
    d.advance(d.context, 1, 1)
    return d.base.log_scores.clone()


def test_depths_from_parents():
    assert _depths(torch.tensor([-1, 0, 0, 1, 3, 2])).tolist() == [0, 1, 1, 2, 3, 2]


@pytest.mark.parametrize("lookup", [0, 2])
def test_an_on_time_answer_equals_node0_drafting_itself(draft_model, lookup):
    context = [5, 6, 7, 8, 5, 6, 7, 8, 5, 6, 7, 8] if lookup else CONTEXT   # a repeat a lookup guess can follow
    node0, ref = _rooted(draft_model, context), _rooted(draft_model, context)
    device = DrafterDevice(draft_model)
    snap = snapshot(node0, context, keep=0, calls=2, width=WIDTH, lookup=lookup)
    growth = device.run("r1", snap)
    assert growth.ran.numel() > 0 and len(growth.calls) == 2
    check_growth(snap, growth)
    added, adopted = graft(node0, growth, snap)
    assert adopted == growth.ran.numel()
    ref.advance(context, 2, WIDTH, lookup)
    assert added == len(ref.base) - len(_rooted(draft_model, context).base)
    assert _paths(node0) == _paths(ref) and _ran_paths(node0) == _ran_paths(ref)
    # the adopted K/V rows are right: the next call on node 0 gives what the reference's gives
    assert torch.equal(_next_logits(node0), _next_logits(ref))


def test_a_late_answer_grafts_what_lies_under_the_new_root(draft_model):
    node0, ref = _rooted(draft_model), _rooted(draft_model)
    snap = snapshot(node0, CONTEXT, keep=0, calls=3, width=WIDTH, lookup=LOOKUP)
    growth = DrafterDevice(draft_model).run("r1", snap)
    ref.advance(CONTEXT, 3, WIDTH, LOOKUP)
    # while the answer travelled, the walk accepted the best child and node 0 re-rooted there
    best = int(node0.base.log_scores[1:].argmax()) + 1
    later = CONTEXT + [int(node0.base.tokens[best])]
    node0.advance(later, 0, WIDTH)
    ref.advance(later, 0, WIDTH)
    assert graft(node0, growth, snap)[0] > 0
    assert _paths(node0) == _paths(ref) and _ran_paths(node0) == _ran_paths(ref)
    assert torch.equal(_next_logits(node0), _next_logits(ref))


def test_an_answer_off_the_accepted_path_adds_nothing(draft_model):
    node0 = _rooted(draft_model)
    had = _paths(node0)
    snap = snapshot(node0, CONTEXT, 0, 1, WIDTH, LOOKUP)
    growth = DrafterDevice(draft_model).run("r1", snap)
    grown = DraftTree(growth.tokens, growth.parents, _depths(growth.parents), growth.log_scores)
    new = [tuple(grown.path_tokens(i)) for i in range(len(had), len(grown))]
    kids = [int(node0.base.tokens[k]) for k in (node0.base.parents == 0).nonzero().reshape(-1)]
    untouched = [t for t in kids if not any(p[1] == t for p in new)]
    assert new and untouched   # one call of 4 rows grew under some children, not all
    node0.advance(CONTEXT + [untouched[0]], 0, WIDTH)   # the walk took a child the drafter did not grow
    before = _paths(node0)
    assert graft(node0, growth, snap) == (0, 0) and _paths(node0) == before


def test_the_replica_takes_only_new_rows_and_says_when_it_is_behind(draft_model):
    node0 = _rooted(draft_model)
    device = DrafterDevice(draft_model)
    first = snapshot(node0, CONTEXT, 0, 1, WIDTH, LOOKUP)
    graft(node0, device.run("r1", first), first)
    later = CONTEXT + [int(node0.base.tokens[1])]
    node0.advance(later, 0, WIDTH)
    second = snapshot(node0, later, len(CONTEXT), 1, WIDTH, LOOKUP)
    assert second.rows.shape[3] < first.rows.shape[3] + 1 + 40   # committed rows shipped once
    assert second.rows.shape[3] == 1 + int(second.ran.numel())  # the one new committed row + the run nodes
    device.run("r1", second)
    with pytest.raises(ReplicaBehind):
        device.run("other request", second)   # a replica it never had: node 0 must ship everything
    device.forget("r1")
    with pytest.raises(ReplicaBehind):
        device.run("r1", second)


def test_snapshot_needs_node0_rooted_at_the_context(draft_model):
    node0 = _rooted(draft_model)
    assert snapshot(node0, CONTEXT + [1], 0, 1, WIDTH, LOOKUP) is None
    assert isinstance(snapshot(node0, CONTEXT, 0, 1, WIDTH, LOOKUP).tokens, torch.Tensor)
    assert DraftTree  # the module's tree type is the engine's


def _valid_tree(d: Drafter) -> None:
    """No two siblings share a token, and every node with children has run (its K/V row is there)."""
    t = d.base
    d._slots.grow(len(t))
    keys = (t.parents[1:] * 1_000_003 + t.tokens[1:]).tolist()
    assert len(keys) == len(set(keys)), "duplicate siblings"
    parents = set(t.parents[1:].tolist()) - {0}
    assert all(bool(d._slots.ran[p]) for p in parents), "children under a node never run"


def test_a_late_answer_after_node0_rebuilt_its_tree_keeps_it_consistent(draft_model):
    """The answer's tree holds nodes node 0 had run at the snapshot; after a rebuild node 0 has not run
    them: the graft takes their rows from the snapshot, and never hangs children under a node without one."""
    node0 = Drafter(draft_model)
    node0.build(CONTEXT, TreeShape(4, 4))         # deep enough that node 0 had run nodes below the accepted child
    node0.drain_calls()
    snap = snapshot(node0, CONTEXT, 0, 2, WIDTH, LOOKUP)
    growth = DrafterDevice(draft_model).run("r1", snap)
    best = int(node0.base.log_scores[1:].argmax()) + 1
    later = CONTEXT + [int(node0.base.tokens[best])]
    node0.build(later, TreeShape(4, 1))          # a new round: a fresh one-level tree at the accepted context
    node0.drain_calls()
    graft(node0, growth, snap)
    _valid_tree(node0)
    node0.advance(later, 2, WIDTH)                # node 0 goes on drafting from the grafted tree
    _valid_tree(node0)


def _bad(growth, **changes):
    from dataclasses import replace

    return replace(growth, **changes)


def test_a_growth_that_is_not_one_of_the_job_is_refused(draft_model):
    node0 = _rooted(draft_model)
    snap = snapshot(node0, CONTEXT, 0, 1, WIDTH, LOOKUP)
    growth = DrafterDevice(draft_model).run("r1", snap)
    n = int(snap.tokens.numel())
    nan_rows = growth.rows.clone()
    nan_rows.view(-1)[0] = float("nan")
    scores = growth.log_scores.clone()
    scores[-1] = float("-inf")
    changed = growth.log_scores.clone()
    changed[1] -= 1.0
    orphan = growth.parents.clone()
    unrun = int((~torch.isin(torch.arange(n), torch.cat([snap.ran, growth.ran, torch.tensor([0])]))).nonzero()[0])
    orphan[-1] = unrun
    for bad in (_bad(growth, rows=nan_rows), _bad(growth, log_scores=scores), _bad(growth, log_scores=changed),
                _bad(growth, parents=orphan), _bad(growth, ran=growth.ran[:-1]),
                _bad(growth, tokens=growth.tokens[: n - 1], parents=growth.parents[: n - 1],
                     log_scores=growth.log_scores[: n - 1])):
        with pytest.raises(ValueError):
            check_growth(snap, bad)
