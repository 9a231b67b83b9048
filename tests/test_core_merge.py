"""merge_by_path and score_aware_pick against a brute-force set of root-to-node token paths."""
from __future__ import annotations

import random

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from flowedge.core.merge import match_paths, merge_by_path, score_aware_pick
from flowedge.core.tree import DraftTree
from flowedge.errors import ConfigError

torch.set_num_threads(1)
VOCAB = 5  # small, so random trees share many paths


def random_tree(rng: random.Random, n: int, root_token: int, distinct: bool = True) -> DraftTree:
    """Random tree with non-increasing scores; `distinct` gives siblings distinct tokens (as top-k
    drafting does). Children stop being added to a node once its tokens run out."""
    tokens, parents, scores, used = [root_token], [-1], [0.0], {0: set()}
    for i in range(1, n):
        open_nodes = [p for p in range(max(0, i - 8), i) if not distinct or len(used[p]) < VOCAB]
        if not open_nodes:
            break
        p = rng.choice(open_nodes)
        choices = [t for t in range(VOCAB) if not distinct or t not in used[p]]
        t = rng.choice(choices)
        used[p].add(t)
        used[len(tokens)] = set()
        tokens.append(t)
        parents.append(p)
        scores.append(scores[p] - rng.choice([0.0, 0.5, rng.random() * 2]))
    tree = DraftTree.root_only(root_token)
    tree.append(torch.tensor(tokens[1:], dtype=torch.int64), torch.tensor(parents[1:], dtype=torch.int64),
                torch.tensor(scores[1:]))
    return tree


def alive_paths(tree: DraftTree, alive: torch.Tensor, root: int) -> dict[tuple[int, ...], list[int]]:
    """Token path (from root) -> node ids, over nodes reachable from root through alive nodes."""
    out: dict[tuple[int, ...], list[int]] = {(int(tree.tokens[root]),): [root]}
    path_of = {root: (int(tree.tokens[root]),)}
    for j in range(root + 1, len(tree)):
        p = int(tree.parents[j])
        if p in path_of and bool(alive[j]):
            path_of[j] = path_of[p] + (int(tree.tokens[j]),)
            out.setdefault(path_of[j], []).append(j)
    return out


def all_paths(tree: DraftTree) -> dict[tuple[int, ...], int]:
    """Token path -> first node id with it, over the whole tree (for `new` trees)."""
    out, path_of = {}, {}
    for j in range(len(tree)):
        p = int(tree.parents[j])
        path_of[j] = (path_of[p] if p >= 0 else ()) + (int(tree.tokens[j]),)
        out.setdefault(path_of[j], j)
    return out


def random_setup(rng: random.Random, n: int):
    tree = random_tree(rng, n, rng.randrange(VOCAB))
    alive = torch.tensor([rng.random() < 0.75 for _ in range(len(tree))])
    root = rng.randrange(len(tree))
    alive[root] = True
    return tree, alive, root


@settings(max_examples=60, deadline=None)
@given(seed=st.integers(0, 10**6), n=st.integers(1, 40), m=st.integers(1, 30), distinct=st.booleans())
def test_merge_by_path_matches_path_sets(seed: int, n: int, m: int, distinct: bool) -> None:
    rng = random.Random(seed)
    tree, alive, root = random_setup(rng, n)
    new = random_tree(rng, m, int(tree.tokens[root]), distinct)
    before = alive_paths(tree, alive, root)
    old_n, root_score = len(tree), float(tree.log_scores[root])
    old_fields = (tree.tokens.clone(), tree.parents.clone(), tree.log_scores.clone())

    added = merge_by_path(tree, alive, root, new)
    alive2 = torch.cat([alive, torch.ones(added.numel(), dtype=torch.bool)])
    after = alive_paths(tree, alive2, root)
    new_paths = all_paths(new)

    assert added.tolist() == list(range(old_n, len(tree)))
    assert torch.equal(tree.tokens[:old_n], old_fields[0]) and torch.equal(tree.parents[:old_n], old_fields[1])
    assert set(after) == set(before) | set(new_paths)
    assert len(added) == len(set(new_paths) - set(before))
    for path, nodes in after.items():
        if path not in before:  # appended paths are unique; old paths keep their old nodes
            assert len(nodes) == 1 and nodes[0] >= old_n
            j = new_paths[path]
            assert float(tree.log_scores[nodes[0]]) == pytest.approx(float(new.log_scores[j]) + root_score)
        else:
            assert nodes == before[path]
    # appended in new's storage order
    order_in_new = [new_paths[p] for j in added.tolist() for p, nodes in after.items() if nodes == [j]]
    assert order_in_new == sorted(order_in_new)


def test_merge_hand_example() -> None:
    # tree: 0(7) -> 1(1) -> 2(2); 0 -> 3(3, dead); merge at root 0 a new tree 7 -> {1 -> {2, 4}, 3}
    tree = DraftTree.root_only(7)
    tree.append(torch.tensor([1, 2, 3]), torch.tensor([0, 1, 0]), torch.tensor([-1.0, -2.0, -3.0]))
    alive = torch.tensor([True, True, True, False])
    new = DraftTree.root_only(7)
    new.append(torch.tensor([1, 2, 4, 3]), torch.tensor([0, 1, 1, 0]), torch.tensor([-0.1, -0.2, -0.3, -0.4]))
    added = merge_by_path(tree, alive, 0, new)
    assert added.tolist() == [4, 5]
    assert tree.tokens[4:].tolist() == [4, 3]
    assert tree.parents[4:].tolist() == [1, 0]  # 3 re-appended: the old node 3 is dead
    assert tree.depths[4:].tolist() == [2, 1]
    assert torch.allclose(tree.log_scores[4:], torch.tensor([-0.3, -0.4]))


def test_merge_at_inner_root_offsets_scores() -> None:
    tree = DraftTree.root_only(7)
    tree.append(torch.tensor([1, 2]), torch.tensor([0, 1]), torch.tensor([-1.0, -2.0]))
    alive = torch.tensor([False, True, True])
    new = DraftTree.root_only(1)
    new.append(torch.tensor([2, 5, 6]), torch.tensor([0, 1, 0]), torch.tensor([-0.5, -0.7, -0.9]))
    added = merge_by_path(tree, alive, 1, new)
    assert added.tolist() == [3, 4]
    assert tree.parents[3:].tolist() == [2, 1]
    assert torch.allclose(tree.log_scores[3:], torch.tensor([-1.7, -1.9]))


def test_merge_collapses_duplicate_siblings_in_new() -> None:
    tree = DraftTree.root_only(0)
    new = DraftTree.root_only(0)
    new.append(torch.tensor([3, 3, 4, 4]), torch.tensor([0, 0, 1, 2]), torch.tensor([-1.0, -1.0, -2.0, -2.0]))
    added = merge_by_path(tree, torch.ones(1, dtype=torch.bool), 0, new)
    assert added.tolist() == [1, 2]
    assert tree.parents.tolist() == [-1, 0, 1]


def test_merge_rejects_root_token_mismatch() -> None:
    tree = DraftTree.root_only(1)
    with pytest.raises(ValueError):
        merge_by_path(tree, torch.ones(1, dtype=torch.bool), 0, DraftTree.root_only(2))
    with pytest.raises(ValueError):
        merge_by_path(tree, torch.ones(2, dtype=torch.bool), 0, DraftTree.root_only(1))


def test_match_paths_provisional_ids() -> None:
    tree = DraftTree.root_only(0)
    tree.append(torch.tensor([1]), torch.tensor([0]), torch.tensor([-1.0]))
    new = DraftTree.root_only(0)
    new.append(torch.tensor([1, 2, 2]), torch.tensor([0, 0, 0]), torch.tensor([-1.0, -2.0, -2.0]))
    found, target = match_paths(tree, torch.ones(2, dtype=torch.bool), 0, new)
    assert found.tolist() == [True, True, False, False]
    assert target.tolist() == [0, 1, 2 + 2, 2 + 2]


@settings(max_examples=50, deadline=None)
@given(seed=st.integers(0, 10**6), n=st.integers(1, 30), m=st.integers(1, 40), total=st.integers(0, 20))
def test_score_aware_pick_matches_brute_force(seed: int, n: int, m: int, total: int) -> None:
    rng = random.Random(seed)
    tree, alive, root = random_setup(rng, n)
    base = random_tree(rng, m, int(tree.tokens[root]))
    present = set(alive_paths(tree, alive, root))
    base_paths = all_paths(base)
    path_of = {j: p for p, j in base_paths.items()}
    absent = [j for j in range(len(base)) if path_of[j] not in present]
    ranked = sorted(absent, key=lambda j: (-float(base.log_scores[j]), int(base.depths[j]), j))
    picked = set(ranked[:total])

    sub = score_aware_pick(base, tree, alive, root, total)
    sub_paths = all_paths(sub)
    expect = {path_of[j] for j in range(len(base)) if path_of[j] in present or j in picked}
    assert set(sub_paths) == expect and len(sub) == len(expect)
    order = [next(j for j, p in path_of.items() if p == q) for q in sorted(sub_paths, key=sub_paths.get)]
    assert order == sorted(order)  # base order

    old_n = len(tree)
    added = merge_by_path(tree, alive, root, sub)
    assert added.numel() == len(picked) == min(total, len(absent))
    alive2 = torch.cat([alive, torch.ones(added.numel(), dtype=torch.bool)])
    assert set(alive_paths(tree, alive2, root)) == present | expect
    for j in picked:  # appended with the base score, offset by the root's
        node = alive_paths(tree, alive2, root)[path_of[j]]
        assert node[0] >= old_n
        want = float(base.log_scores[j]) + float(tree.log_scores[root])
        assert float(tree.log_scores[node[0]]) == pytest.approx(want)


def test_score_aware_pick_errors() -> None:
    tree = DraftTree.root_only(0)
    alive = torch.ones(1, dtype=torch.bool)
    with pytest.raises(ConfigError):
        score_aware_pick(DraftTree.root_only(0), tree, alive, 0, -1)
    twins = DraftTree.root_only(0)
    twins.append(torch.tensor([3, 3]), torch.tensor([0, 0]), torch.tensor([-1.0, -1.0]))
    with pytest.raises(ValueError):
        score_aware_pick(twins, tree, alive, 0, 2)


def test_merge_large_tree_is_vectorised() -> None:
    rng = random.Random(5)
    tree = random_tree(rng, 2000, 0)
    alive = torch.ones(len(tree), dtype=torch.bool)
    new = random_tree(rng, 64, 0)
    before = len(tree)
    added = merge_by_path(tree, alive, 0, new)
    again = merge_by_path(tree, torch.ones(len(tree), dtype=torch.bool), 0, new)
    assert again.numel() == 0 and len(tree) == before + added.numel()
