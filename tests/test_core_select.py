"""select_top, split_segments, segment_mask: hand-built cases plus properties on random trees."""
from __future__ import annotations

import random

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from flowedge.core.select import rank_nodes, segment_mask, select_top, split_segments
from flowedge.core.tree import DraftTree
from flowedge.errors import ConfigError

torch.set_num_threads(1)


def random_tree(rng: random.Random, n: int, vocab: int = 50) -> DraftTree:
    """Random topological tree with non-increasing scores; ties are frequent on purpose."""
    tree = DraftTree.root_only(rng.randrange(vocab))
    if n > 1:
        parents = [rng.randrange(i) for i in range(1, n)]
        scores = [0.0]
        for p in parents:
            scores.append(scores[p] - rng.choice([0.0, 0.5, 1.0, rng.random()]))
        tree.append(torch.tensor([rng.randrange(vocab) for _ in parents]), torch.tensor(parents),
                    torch.tensor(scores[1:]))
    return tree


def hand_tree() -> DraftTree:
    #        0
    #     /  |  \
    #    1   2   3          scores -0.1 -1.0 -2.0
    #   / \  |
    #  4   5 6               scores -0.5 -3.0 -1.1
    tree = DraftTree.root_only(100)
    tree.append(torch.tensor([11, 12, 13, 14, 15, 16]), torch.tensor([0, 0, 0, 1, 1, 2]),
                torch.tensor([-0.1, -1.0, -2.0, -0.5, -3.0, -1.1]))
    return tree


def brute_ancestors(tree: DraftTree, i: int) -> set[int]:
    out = {i}
    while int(tree.parents[i]) >= 0:
        i = int(tree.parents[i])
        out.add(i)
    return out


def test_select_top_score_order_hand() -> None:
    tree, base_index = select_top(hand_tree(), 5, "score")
    assert base_index.tolist() == [0, 1, 4, 2, 6]
    assert tree.tokens.tolist() == [100, 11, 14, 12, 16]
    assert tree.parents.tolist() == [-1, 0, 1, 0, 3]
    assert tree.depths.tolist() == [0, 1, 2, 1, 2]
    assert torch.allclose(tree.log_scores, torch.tensor([0.0, -0.1, -0.5, -1.0, -1.1]))


def test_select_top_bfs_order_hand() -> None:
    tree, base_index = select_top(hand_tree(), 5, "bfs")
    assert base_index.tolist() == [0, 1, 2, 4, 6]
    assert tree.parents.tolist() == [-1, 0, 0, 1, 2]


def test_select_top_ties_pick_parent_first() -> None:
    # a zero-log-prob chain: every node scores 0.0 like the root; depth breaks the tie
    tree = DraftTree.root_only(1)
    tree.append(torch.tensor([2, 3, 4, 5]), torch.tensor([0, 1, 2, 0]), torch.tensor([0.0, 0.0, 0.0, -1.0]))
    out, base_index = select_top(tree, 3, "score")
    assert base_index.tolist() == [0, 1, 2]
    assert out.parents.tolist() == [-1, 0, 1]


def test_select_top_larger_than_tree_keeps_all() -> None:
    base = hand_tree()
    tree, base_index = select_top(base, 100)
    assert sorted(base_index.tolist()) == list(range(len(base)))
    assert len(tree) == len(base)


def test_select_top_bad_args() -> None:
    with pytest.raises(ConfigError):
        select_top(hand_tree(), 0)
    with pytest.raises(ConfigError):
        select_top(hand_tree(), 3, "dfs")


@settings(max_examples=40, deadline=None)
@given(seed=st.integers(0, 10**6), n=st.integers(1, 80), total=st.integers(1, 90))
def test_select_top_properties(seed: int, n: int, total: int) -> None:
    base = random_tree(random.Random(seed), n)
    by_score, idx_score = select_top(base, total, "score")
    by_bfs, idx_bfs = select_top(base, total, "bfs")
    assert len(by_score) == min(total, n)
    assert set(idx_score.tolist()) == set(idx_bfs.tolist())
    # brute-force top set: sort (-score, depth, index)
    ranked = sorted(range(n), key=lambda i: (-float(base.log_scores[i]), int(base.depths[i]), i))
    assert set(idx_score.tolist()) == set(ranked[: min(total, n)])
    assert idx_score.tolist() == ranked[: min(total, n)]
    for tree, idx in ((by_score, idx_score), (by_bfs, idx_bfs)):
        assert idx[0] == 0
        assert bool((tree.parents[1:] < torch.arange(1, len(tree))).all())  # topological, validated too
        for i in range(1, len(tree)):  # same edges, tokens, scores as base
            assert int(idx[tree.parents[i]]) == int(base.parents[idx[i]])
            assert int(tree.tokens[i]) == int(base.tokens[idx[i]])
            assert float(tree.log_scores[i]) == float(base.log_scores[idx[i]])
    bfs_key = [(int(base.depths[i]), i) for i in idx_bfs.tolist()]
    assert bfs_key == sorted(bfs_key)


def test_rank_nodes_candidates() -> None:
    cand = torch.tensor([False, False, True, True, False, False, True])
    assert rank_nodes(hand_tree(), cand).tolist() == [2, 6, 3]


@pytest.mark.parametrize(
    "n, l_max, first, n_segments, expect",
    [
        (10, 4, 0, None, [(0, 4), (4, 8), (8, 10)]),
        (8, 4, 0, None, [(0, 4), (4, 8)]),
        (8, 4, 8, None, []),
        (9, 16, 3, None, [(3, 9)]),
        (10, 4, 0, 3, [(0, 4), (4, 7), (7, 10)]),
        (2, 4, 0, 4, [(0, 1), (1, 2)]),
        (80, 16, 0, 4, [(0, 20), (20, 40), (40, 60), (60, 80)]),
    ],
)
def test_split_segments_cases(n, l_max, first, n_segments, expect) -> None:
    assert split_segments(n, l_max, first, n_segments) == expect


def test_split_segments_errors() -> None:
    with pytest.raises(ConfigError):
        split_segments(10, 0)
    with pytest.raises(ConfigError):
        split_segments(10, 4, n_segments=0)
    with pytest.raises(ValueError):
        split_segments(10, 4, first=11)


@settings(max_examples=60, deadline=None)
@given(n=st.integers(0, 200), l_max=st.integers(1, 40), first_frac=st.floats(0, 1),
       n_segments=st.none() | st.integers(1, 12))
def test_split_segments_properties(n: int, l_max: int, first_frac: float, n_segments: int | None) -> None:
    first = int(first_frac * n)
    segs = split_segments(n, l_max, first, n_segments)
    covered = [i for s, e in segs for i in range(s, e)]
    assert covered == list(range(first, n))
    assert all(e > s for s, e in segs)
    sizes = [e - s for s, e in segs]
    if n_segments is None:
        assert all(size <= l_max for size in sizes)
        assert all(size == l_max for size in sizes[:-1])
    else:
        assert len(segs) == min(n_segments, n - first)
        assert not sizes or max(sizes) - min(sizes) <= 1


def test_segment_mask_hand() -> None:
    tree = hand_tree()
    mask = segment_mask(tree, 4, 7)
    assert mask.shape == (3, 7)
    assert mask[0].nonzero().reshape(-1).tolist() == [0, 1, 4]
    assert mask[1].nonzero().reshape(-1).tolist() == [0, 1, 5]
    assert mask[2].nonzero().reshape(-1).tolist() == [0, 2, 6]
    alive = torch.tensor([True, False, True, True, True, True, True])
    masked = segment_mask(tree, 4, 7, alive)
    assert masked[0].nonzero().reshape(-1).tolist() == [0, 4]


def test_segment_mask_empty_and_bounds() -> None:
    assert segment_mask(hand_tree(), 3, 3).shape == (0, 3)
    with pytest.raises(ValueError):
        segment_mask(hand_tree(), 2, 9)


@settings(max_examples=40, deadline=None)
@given(seed=st.integers(0, 10**6), n=st.integers(1, 60))
def test_segment_mask_matches_brute_force(seed: int, n: int) -> None:
    rng = random.Random(seed)
    tree = random_tree(rng, n)
    start = rng.randrange(n)
    end = rng.randrange(start, n + 1)
    alive = torch.tensor([rng.random() < 0.7 for _ in range(n + 3)])  # longer than the tree is fine
    mask = segment_mask(tree, start, end, alive)
    plain = segment_mask(tree, start, end)
    for r in range(end - start):
        anc = brute_ancestors(tree, start + r)
        assert set(plain[r].nonzero().reshape(-1).tolist()) == anc
        assert set(mask[r].nonzero().reshape(-1).tolist()) == {j for j in anc if bool(alive[j])}
    full = tree.ancestor_mask()[start:end, :end]
    assert torch.equal(plain, full)
