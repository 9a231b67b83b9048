"""The drafter's incremental tree growth must give every node exactly the draft's own log-probs, however
the node got run: in a level, best-first after a re-root, or ahead of time as part of a guessed chain."""
from __future__ import annotations

import pytest
import torch

from flowedge.engine.drafter import Drafter, TreeShape
from flowedge.models.stage import StageModel, bool_to_float_mask, causal_mask

CONTEXT = [5, 6, 7, 8, 5, 6, 9, 10, 11, 5, 6]


@pytest.fixture(scope="module")
def draft_model(tiny_pair):
    return StageModel.load(tiny_pair[1])


def fresh_logp(model: StageModel, tokens: list[int]) -> torch.Tensor:
    """Draft log-probs after `tokens`, from one uncached forward."""
    ids = torch.tensor(tokens)
    h = model.forward_layers(model.embed(ids), torch.arange(len(tokens)),
                             bool_to_float_mask(causal_mask(len(tokens), 0)), model.new_cache())
    return torch.log_softmax(model.logits(h), dim=-1)[-1]


def greedy_chain(model: StageModel, tokens: list[int], n: int) -> list[int]:
    out = []
    for _ in range(n):
        out.append(int(fresh_logp(model, tokens + out).argmax()))
    return out


def check_children_scores(drafter: Drafter, model: StageModel) -> int:
    """Every run node's children carry its score + the draft's log-prob of their token; returns how
    many run nodes were checked."""
    tree, checked = drafter.base, 0
    run = drafter._slots.ran[: len(tree)].nonzero().reshape(-1).tolist()
    for node in run:
        kids = tree.children(node)
        if kids.numel() == 0:
            continue
        path = tree.path_tokens(node)[1:]
        logp = fresh_logp(model, drafter.context + path)
        expected = tree.log_scores[node] + logp[tree.tokens[kids]]
        assert torch.allclose(tree.log_scores[kids], expected, atol=1e-4), node
        checked += 1
    return checked


def test_a_guessed_chain_the_draft_agrees_with_deepens_the_tree_in_one_call(draft_model, monkeypatch):
    drafter = Drafter(draft_model)
    drafter.build(CONTEXT, TreeShape(topk=3, depth=1))
    lead = int(drafter.base.log_scores[1:].argmax()) + 1          # the best open node after the build
    lead_path = drafter.base.path_tokens(lead)[1:]
    chain = greedy_chain(draft_model, CONTEXT + lead_path, 3)     # what the draft itself would propose
    monkeypatch.setattr(drafter, "_guess", lambda node, m: torch.tensor(chain[:m]))
    depth_before = int(drafter.base.depths.max())
    drafter.advance(CONTEXT, forwards=1, width=5, lookup=3)
    assert drafter.forwards == 2                                   # the build's call and one more
    assert int(drafter.base.depths.max()) == depth_before + 4      # lead's children + 3 chain levels
    assert check_children_scores(drafter, draft_model) == 2 + 3   # 2 open nodes and the 3-node chain


def test_a_wrong_guess_wastes_its_rows_and_nothing_else(draft_model, monkeypatch):
    plain, guessed = Drafter(draft_model), Drafter(draft_model)
    for d in (plain, guessed):
        d.build(CONTEXT, TreeShape(topk=3, depth=1))
    lead = int(guessed.base.log_scores[1:].argmax()) + 1
    proposals = set(guessed.base.tokens.tolist())
    wrong = next(t for t in range(1, 300) if t not in fresh_logp(
        draft_model, CONTEXT + guessed.base.path_tokens(lead)[1:]).topk(3).indices.tolist() and t not in proposals)
    monkeypatch.setattr(guessed, "_guess", lambda node, m: torch.tensor([wrong]))
    plain.advance(CONTEXT, forwards=2, width=2)
    guessed.advance(CONTEXT, forwards=2, width=3, lookup=1)       # same open nodes, one wasted row
    assert torch.equal(plain.base.tokens, guessed.base.tokens)
    assert torch.allclose(plain.base.log_scores, guessed.base.log_scores, atol=1e-5)
    assert check_children_scores(guessed, draft_model) > 0
    # the re-root after an acceptance drops the wasted entries with everything outside the subtree
    guessed.advance(CONTEXT + guessed.base.path_tokens(lead)[1:], forwards=1, width=3, lookup=0)
    assert check_children_scores(guessed, draft_model) > 0


def test_real_lookup_on_a_repetitive_context_keeps_scores_exact(draft_model):
    drafter = Drafter(draft_model)
    drafter.build(CONTEXT, TreeShape(topk=4, depth=2))
    drafter.advance(CONTEXT, forwards=3, width=6, lookup=3)
    assert check_children_scores(drafter, draft_model) > 0


def test_a_new_tree_runs_the_guess_after_its_root_in_the_same_call(draft_model, monkeypatch):
    import flowedge.engine.drafter as drafter_module

    chain = greedy_chain(draft_model, CONTEXT, 2)
    monkeypatch.setattr(drafter_module, "lookup_continuation", lambda tokens, m: torch.tensor(chain[:m]))
    drafter = Drafter(draft_model)
    drafter.build(CONTEXT, TreeShape(topk=3, depth=2), lookup=2)
    assert drafter.forwards == 2                                   # root + guess, then one level
    assert int(drafter.base.depths.max()) == 3                     # the chain's two levels + one more
    run = drafter._slots.ran[: len(drafter.base)]
    assert int(run.sum()) == 2 + 3 - 1                             # 2 adopted + the level's 3 minus the one already run
    assert check_children_scores(drafter, draft_model) == 4
    assert drafter.committed == len(CONTEXT)
