"""DraftTree: validation, appending, and structural queries against brute-force parent walks."""
from __future__ import annotations

import random

import pytest
import torch

from flowedge.core.tree import DraftTree, find_path, path_min_scores, reindex, subtree

torch.set_num_threads(1)


def random_tree(rng: random.Random, n: int, vocab: int = 50) -> DraftTree:
    """Random topological tree with non-increasing cumulative scores."""
    tree = DraftTree.root_only(rng.randrange(vocab))
    if n > 1:
        parents = [rng.randrange(i) for i in range(1, n)]
        scores = [0.0]
        for p in parents:
            scores.append(scores[p] - rng.choice([0.0, 0.25, 0.5, rng.random() * 3]))
        tree.append(
            torch.tensor([rng.randrange(vocab) for _ in parents]),
            torch.tensor(parents),
            torch.tensor(scores[1:]),
        )
    return tree


def brute_ancestors(tree: DraftTree, i: int) -> set[int]:
    out = {i}
    while int(tree.parents[i]) >= 0:
        i = int(tree.parents[i])
        out.add(i)
    return out


def test_root_only() -> None:
    tree = DraftTree.root_only(7)
    assert len(tree) == 1
    assert tree.tokens.tolist() == [7] and tree.parents.tolist() == [-1]
    assert tree.depths.tolist() == [0] and tree.log_scores.tolist() == [0.0]
    assert tree.path(0) == [0] and tree.path_tokens(0) == [7]


def test_append_derives_depths_including_in_batch_parents() -> None:
    tree = DraftTree.root_only(1)
    ids = tree.append(torch.tensor([2, 3, 4, 5]), torch.tensor([0, 1, 2, 0]), torch.tensor([-0.1, -0.2, -0.3, -0.4]))
    assert ids.tolist() == [1, 2, 3, 4]
    assert tree.depths.tolist() == [0, 1, 2, 3, 1]
    more = tree.append(torch.tensor([6]), torch.tensor([3]), torch.tensor([-1.0]))
    assert more.tolist() == [5]
    assert tree.depths[5] == 4
    assert tree.path(5) == [0, 1, 2, 3, 5]
    assert tree.path_tokens(5) == [1, 2, 3, 4, 6]
    assert tree.log_scores.dtype == torch.float32


def test_append_empty_is_noop() -> None:
    tree = DraftTree.root_only(1)
    ids = tree.append(torch.zeros(0, dtype=torch.int64), torch.zeros(0, dtype=torch.int64), torch.zeros(0))
    assert ids.numel() == 0 and len(tree) == 1


@pytest.mark.parametrize("parents", [[1], [-1], [2]])
def test_append_rejects_bad_parent(parents: list[int]) -> None:
    tree = DraftTree.root_only(1)
    with pytest.raises(ValueError):
        tree.append(torch.tensor([5]), torch.tensor(parents), torch.tensor([0.0]))
    assert len(tree) == 1


def test_append_rejects_length_mismatch() -> None:
    tree = DraftTree.root_only(1)
    with pytest.raises(ValueError):
        tree.append(torch.tensor([5, 6]), torch.tensor([0]), torch.tensor([0.0, 0.0]))


def _tree_fields(**override):
    fields = dict(
        tokens=torch.tensor([1, 2, 3]),
        parents=torch.tensor([-1, 0, 1]),
        depths=torch.tensor([0, 1, 2]),
        log_scores=torch.tensor([0.0, -1.0, -2.0]),
    )
    fields.update(override)
    return fields


@pytest.mark.parametrize(
    "override",
    [
        dict(parents=torch.tensor([-1, 0, 2])),  # self parent
        dict(parents=torch.tensor([-1, 2, 0])),  # forward parent
        dict(parents=torch.tensor([0, 0, 1])),  # root with a parent
        dict(parents=torch.tensor([-1, -1, 1])),  # second root
        dict(depths=torch.tensor([0, 1, 1])),  # inconsistent depth
        dict(tokens=torch.tensor([1, 2, 3], dtype=torch.int32)),  # dtype
        dict(log_scores=torch.tensor([0.0, -1.0, -2.0], dtype=torch.float64)),
        dict(tokens=torch.tensor([1, 2])),  # length
        dict(tokens=torch.tensor([1, -2, 3])),
        dict(log_scores=torch.tensor([0.0, float("nan"), -2.0])),
        dict(tokens=torch.zeros(0, dtype=torch.int64), parents=torch.zeros(0, dtype=torch.int64),
             depths=torch.zeros(0, dtype=torch.int64), log_scores=torch.zeros(0)),
    ],
)
def test_validation_rejects(override) -> None:
    with pytest.raises(ValueError):
        DraftTree(**_tree_fields(**override))


def test_valid_fields_accepted() -> None:
    assert len(DraftTree(**_tree_fields())) == 3


def test_children_with_and_without_alive() -> None:
    tree = DraftTree.root_only(0)
    tree.append(torch.tensor([1, 2, 3, 4]), torch.tensor([0, 0, 1, 0]), torch.tensor([-1.0, -2.0, -3.0, -4.0]))
    assert tree.children(0).tolist() == [1, 2, 4]
    alive = torch.tensor([True, True, False, True, True])
    assert tree.children(0, alive).tolist() == [1, 4]
    assert tree.children(3).tolist() == []


@pytest.mark.parametrize("seed", range(6))
def test_ancestor_and_subtree_masks_match_brute_force(seed: int) -> None:
    rng = random.Random(seed)
    tree = random_tree(rng, rng.randrange(1, 60))
    n = len(tree)
    mask = tree.ancestor_mask()
    assert mask.shape == (n, n) and mask.dtype == torch.bool
    for i in range(n):
        anc = brute_ancestors(tree, i)
        assert set(mask[i].nonzero().reshape(-1).tolist()) == anc
        assert tree.path(i) == sorted(anc)  # topological order: path ids ascend
    for i in rng.sample(range(n), min(n, 8)):
        expect = {j for j in range(n) if i in brute_ancestors(tree, j)}
        assert set(tree.subtree_mask(i).nonzero().reshape(-1).tolist()) == expect


def test_path_rejects_out_of_range() -> None:
    with pytest.raises(ValueError):
        DraftTree.root_only(0).path(3)


def test_path_min_scores_fixes_increasing_scores() -> None:
    tree = DraftTree(
        tokens=torch.tensor([0, 1, 2]),
        parents=torch.tensor([-1, 0, 1]),
        depths=torch.tensor([0, 1, 2]),
        log_scores=torch.tensor([0.0, -2.0, -1.0]),
    )
    assert path_min_scores(tree).tolist() == [0.0, -2.0, -2.0]


def test_reindex_reroots_subtree() -> None:
    tree = DraftTree.root_only(9)
    tree.append(torch.tensor([1, 2, 3, 4]), torch.tensor([0, 1, 1, 2]), torch.tensor([-1.0, -1.5, -2.0, -3.0]))
    sub = reindex(tree, torch.tensor([1, 3, 2]))
    assert sub.tokens.tolist() == [1, 3, 2]
    assert sub.parents.tolist() == [-1, 0, 0]
    assert sub.depths.tolist() == [0, 1, 1]
    assert sub.log_scores.tolist() == [0.0, -1.0, -0.5]
    with pytest.raises(ValueError):
        reindex(tree, torch.tensor([1, 4]))  # 4's parent 2 is not listed


def test_ancestor_mask_large_tree_is_fast() -> None:
    rng = random.Random(1)
    tree = random_tree(rng, 2000)
    mask = tree.ancestor_mask()
    assert mask.sum(dim=1).tolist() == (tree.depths + 1).tolist()


def test_subtree_and_find_path() -> None:
    tree = DraftTree.root_only(9)
    tree.append(torch.tensor([1, 2, 3, 4, 5]), torch.tensor([0, 1, 1, 2, 0]),
                torch.tensor([-1.0, -1.5, -2.0, -3.0, -0.5]))
    sub, ids = subtree(tree, 1)
    assert ids.tolist() == [1, 2, 3, 4]
    assert sub.tokens.tolist() == [1, 2, 3, 4] and sub.parents.tolist() == [-1, 0, 0, 1]
    assert sub.log_scores.tolist() == [0.0, -0.5, -1.0, -2.0]
    assert find_path(tree, [9, 1, 2, 4]) == 4
    assert find_path(tree, [9]) == 0
    assert find_path(tree, [9, 1, 4]) is None
    assert find_path(tree, [8]) is None and find_path(tree, []) is None
    alive = torch.ones(len(tree), dtype=torch.bool)
    alive[2] = False
    assert find_path(tree, [9, 1, 2], alive) is None


def test_levels_group_by_depth() -> None:
    rng = random.Random(3)
    tree = random_tree(rng, 40)
    levels = tree.levels()
    assert len(levels) == int(tree.depths.max()) + 1
    for d, level in enumerate(levels):
        assert level.tolist() == [i for i in range(len(tree)) if int(tree.depths[i]) == d]
