"""Prune sets against brute-force python-set references on random trees, masks and walks."""
from __future__ import annotations

import random

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from flowedge.core.prune import PruneSet, apply_alive, cache_reorder, live_in, prune_after_walk
from flowedge.core.sampling import SamplingParams
from flowedge.core.tree import DraftTree
from flowedge.core.verify import WalkResult, walk

torch.set_num_threads(1)
VOCAB = 12


def random_tree(rng: random.Random, n: int) -> DraftTree:
    tree = DraftTree.root_only(rng.randrange(VOCAB))
    if n > 1:
        parents = [rng.randrange(max(0, i - 6), i) for i in range(1, n)]  # deeper than uniform parents
        tree.append(torch.tensor([rng.randrange(VOCAB) for _ in parents]), torch.tensor(parents),
                    -torch.arange(1, n, dtype=torch.float32))
    return tree


def ids(mask_or_list) -> list[int]:
    return [int(i) for i in mask_or_list]


def is_descendant(tree: DraftTree, j: int, i: int) -> bool:
    while j >= 0:
        if j == i:
            return True
        j = int(tree.parents[j])
    return False


def random_walk(rng: random.Random, tree: DraftTree, alive: torch.Tensor) -> WalkResult:
    """Greedy walk from a random alive node; known logits favour a child token so walks go deep."""
    n = len(tree)
    known = {i for i in range(n) if rng.random() < 0.6}
    start = rng.choice([i for i in range(n) if bool(alive[i])])
    known.add(start)
    logits = {}
    for i in known:
        kids = tree.children(i).tolist()
        token = int(tree.tokens[rng.choice(kids)]) if kids and rng.random() < 0.8 else rng.randrange(VOCAB)
        logits[i] = torch.nn.functional.one_hot(torch.tensor(token), VOCAB).float()
    return walk(tree, start, logits, SamplingParams(), None, alive)


def brute_prune(tree: DraftTree, alive: torch.Tensor, result: WalkResult) -> tuple[list[int], list[int]]:
    if result.next_node is None:
        return list(result.committed), []
    keep = [j for j in range(len(tree)) if bool(alive[j]) and is_descendant(tree, j, result.next_node)]
    return list(result.committed), keep


@settings(max_examples=60, deadline=None)
@given(seed=st.integers(0, 10**6), n=st.integers(1, 50), extra=st.integers(0, 6))
def test_prune_functions_match_brute_force(seed: int, n: int, extra: int) -> None:
    rng = random.Random(seed)
    tree = random_tree(rng, n)
    alive = torch.tensor([rng.random() < 0.8 for _ in range(n)])
    alive[0] = True
    result = random_walk(rng, tree, alive)
    prune = prune_after_walk(tree, alive, result)
    commit, keep = brute_prune(tree, alive, result)
    assert ids(prune.commit) == commit and ids(prune.keep) == keep and prune.horizon == n

    # nodes appended after the set was made are not decided by it
    grown = torch.cat([alive, torch.tensor([rng.random() < 0.5 for _ in range(extra)], dtype=torch.bool)])
    new_alive = apply_alive(grown, prune)
    expect_alive = [(j in keep) if j < n else bool(grown[j]) for j in range(n + extra)]
    assert new_alive.tolist() == expect_alive
    assert grown.shape == new_alive.shape and not bool(new_alive[commit].any())

    probe = torch.tensor([rng.randrange(n + extra + 3) for _ in range(rng.randrange(20))], dtype=torch.int64)
    assert live_in(probe, prune).tolist() == [i >= n or i in keep for i in probe.tolist()]

    # a stage cache: every committed id, plus a random subset of other ids, shuffled
    others = [i for i in range(n + extra) if i not in commit and rng.random() < 0.7]
    cache = commit + others
    rng.shuffle(cache)
    cache_ids = torch.tensor(cache, dtype=torch.int64)
    commit_pos, keep_pos = cache_reorder(cache_ids, prune)
    assert ids(commit_pos) == [cache.index(c) for c in commit]
    assert ids(keep_pos) == [p for p, i in enumerate(cache) if i >= n or i in keep]


def test_prune_hand_example() -> None:
    # 0 -> 1 -> 2 -> 4 ; 1 -> 3 ; 2 -> 5 ; 0 -> 6
    tree = DraftTree.root_only(0)
    tree.append(torch.tensor([1, 2, 3, 4, 5, 6]), torch.tensor([0, 1, 1, 2, 2, 0]), -torch.arange(1.0, 7.0))
    alive = torch.tensor([True, True, True, True, True, False, True])
    result = WalkResult(committed=[0, 1], tokens=[1, 2], next_node=2)
    prune = prune_after_walk(tree, alive, result)
    assert prune.commit.tolist() == [0, 1]
    assert prune.keep.tolist() == [2, 4]  # 5 is dead already
    assert apply_alive(alive, prune).tolist() == [False, False, True, False, True, False, False]
    commit_pos, keep_pos = cache_reorder(torch.tensor([6, 1, 2, 0, 4, 3, 9]), prune)
    assert commit_pos.tolist() == [3, 1]
    assert keep_pos.tolist() == [2, 4, 6]  # 9 >= horizon stays


def test_prune_round_end_keeps_nothing() -> None:
    tree = DraftTree.root_only(0)
    tree.append(torch.tensor([1]), torch.tensor([0]), torch.tensor([-1.0]))
    prune = prune_after_walk(tree, torch.ones(2, dtype=torch.bool), WalkResult([0], [7], None))
    assert prune.keep.numel() == 0
    assert apply_alive(torch.ones(2, dtype=torch.bool), prune).tolist() == [False, False]


def test_cache_reorder_missing_commit_raises() -> None:
    prune = PruneSet(commit=torch.tensor([0, 2]), keep=torch.tensor([3]), horizon=4)
    with pytest.raises(ValueError):
        cache_reorder(torch.tensor([0, 1, 3]), prune)
    with pytest.raises(ValueError):
        cache_reorder(torch.zeros(0, dtype=torch.int64), prune)
    with pytest.raises(ValueError):
        cache_reorder(torch.tensor([0, 2, 2]), prune)


def test_cache_reorder_empty() -> None:
    prune = PruneSet(commit=torch.zeros(0, dtype=torch.int64), keep=torch.zeros(0, dtype=torch.int64), horizon=3)
    commit_pos, keep_pos = cache_reorder(torch.zeros(0, dtype=torch.int64), prune)
    assert commit_pos.numel() == 0 and keep_pos.numel() == 0


@pytest.mark.parametrize(
    "commit, keep, horizon",
    [
        ([0, 5], [1], 4),  # commit beyond horizon
        ([0], [2, 1], 4),  # keep not ascending
        ([0], [1, 1], 4),  # keep repeats
        ([0, 0], [1], 4),  # commit repeats
        ([0, 1], [1, 2], 4),  # overlap
        ([-1], [], 4),
    ],
)
def test_prune_set_validation(commit, keep, horizon) -> None:
    with pytest.raises(ValueError):
        PruneSet(commit=torch.tensor(commit, dtype=torch.int64), keep=torch.tensor(keep, dtype=torch.int64),
                 horizon=horizon)


def test_prune_set_dtype_validation() -> None:
    with pytest.raises(ValueError):
        PruneSet(commit=torch.tensor([0], dtype=torch.int32), keep=torch.zeros(0, dtype=torch.int64), horizon=2)


def test_apply_alive_short_mask_raises() -> None:
    prune = PruneSet(commit=torch.tensor([0]), keep=torch.tensor([1]), horizon=3)
    with pytest.raises(ValueError):
        apply_alive(torch.ones(2, dtype=torch.bool), prune)


def test_random_walks_exercise_deep_and_continuing_cases() -> None:
    """Guards the property test above against only ever seeing one-step walks."""
    lengths, continuing = [], 0
    for seed in range(100):
        rng = random.Random(seed)
        tree = random_tree(rng, 40)
        result = random_walk(rng, tree, torch.ones(40, dtype=torch.bool))
        lengths.append(len(result.committed))
        continuing += result.continues
    assert max(lengths) >= 3 and 10 <= continuing <= 90
