"""Growing a live tree without duplicating paths: context-aware merge and score-aware picking.

Both rest on one query, `match_paths`: which nodes of another tree already exist, by token path from a
given node, among the live tree's alive nodes. It runs level by level with sorted (parent, token) keys,
so its cost is a few sorts per level, not a Python loop per node.
"""
from __future__ import annotations

import torch
from torch import Tensor

from flowedge.core.select import rank_nodes
from flowedge.core.tree import DraftTree, reindex
from flowedge.errors import ConfigError


def match_paths(tree: DraftTree, alive: Tensor, root: int, new: DraftTree) -> tuple[Tensor, Tensor]:
    """Map `new` onto `tree` by token path from `root` through alive nodes.

    Returns (found, target), both [len(new)]: found[i] says whether node i's path exists in `tree`;
    target[i] is that tree id when found, else a provisional id len(tree) + j, where j is the first
    node of `new` with the same path (so duplicate sibling paths inside `new` collapse onto one)."""
    if alive.shape[0] != len(tree):
        raise ValueError(f"alive mask has {alive.shape[0]} entries for a tree of {len(tree)} nodes")
    if not 0 <= root < len(tree):
        raise ValueError(f"merge root {root} is outside a tree of {len(tree)} nodes")
    if int(new.tokens[0]) != int(tree.tokens[root]):
        raise ValueError(f"new tree's root token {int(new.tokens[0])} differs from node {root}'s "
                         f"{int(tree.tokens[root])}")
    n, m = len(tree), len(new)
    width = int(max(int(tree.tokens.max()), int(new.tokens.max()))) + 1  # key = parent * width + token
    member = alive.clone()
    member[0] = False  # the tree root has no parent to key on
    tree_ids = member.nonzero().reshape(-1)
    tree_keys, by_key = torch.sort(tree.parents[tree_ids] * width + tree.tokens[tree_ids], stable=True)
    tree_ids = tree_ids[by_key]  # equal keys keep ascending ids: a search finds the smallest
    target = torch.empty(m, dtype=torch.int64)
    found = torch.zeros(m, dtype=torch.bool)
    target[0], found[0] = root, True
    for level in new.levels()[1:]:
        keys = target[new.parents[level]] * width + new.tokens[level]
        slot = torch.searchsorted(tree_keys, keys).clamp(max=max(tree_keys.numel() - 1, 0))
        hit = (tree_keys[slot] == keys) if tree_keys.numel() else torch.zeros_like(keys, dtype=torch.bool)
        found[level] = hit
        target[level[hit]] = tree_ids[slot[hit]]
        miss, miss_keys = level[~hit], keys[~hit]
        uniq, inverse = torch.unique(miss_keys, return_inverse=True)
        first = torch.full((uniq.numel(),), m, dtype=torch.int64).scatter_reduce(0, inverse, miss, "amin")
        target[miss] = n + first[inverse]
    return found, target


def merge_by_path(tree: DraftTree, alive: Tensor, root: int, new: DraftTree) -> Tensor:
    """Context-aware expansion: append the nodes of `new` (rooted at tree node `root`'s token) whose
    path from `root` is not already alive in `tree`, in `new`'s storage order, scores offset by
    tree.log_scores[root]. Mutates `tree`; returns the appended ids (ascending). The caller extends
    `alive` with True for them."""
    # alive: [len(tree)] bool
    found, target = match_paths(tree, alive, root, new)
    n = len(tree)
    own = torch.arange(len(new), dtype=torch.int64)
    fresh = (~found) & (target == n + own)  # not present, and not a duplicate of an earlier new node
    picked = fresh.nonzero().reshape(-1)
    final = torch.full((len(new),), -1, dtype=torch.int64)
    final[picked] = n + torch.arange(picked.numel(), dtype=torch.int64)
    resolved = torch.where(found, target, final[(target - n).clamp(min=0)])
    parents = resolved[new.parents[picked]]
    scores = new.log_scores[picked] + tree.log_scores[root]
    return tree.append(new.tokens[picked], parents, scores)


def score_aware_pick(base: DraftTree, tree: DraftTree, alive: Tensor, root: int, total: int) -> DraftTree:
    """Score-aware expansion's selection: among `base` nodes (base rooted at node `root`'s token)
    whose path is not already alive under `root`, take the top `total` by log_score (ties: depth,
    index); return the base subtree of present ∪ picked nodes, in base order, re-rooted, so that
    merge_by_path appends exactly the picked nodes."""
    if total < 0:
        raise ConfigError(f"score-aware expansion size must be >= 0, got {total}")
    found, target = match_paths(tree, alive, root, base)
    own = torch.arange(len(base), dtype=torch.int64)
    if bool(((~found) & (target != len(tree) + own)).any()):
        raise ValueError("base tree holds two sibling nodes with the same token")
    picked = rank_nodes(base, ~found)[:total]
    chosen = found.clone()
    chosen[picked] = True
    return reindex(base, chosen.nonzero().reshape(-1))
