"""Choosing which draft nodes to verify, in which order, cut into which segments, seeing what."""
from __future__ import annotations

import torch
from torch import Tensor

from flowedge.core.tree import DraftTree, path_min_scores, reindex
from flowedge.errors import ConfigError

_ORDERS = ("score", "bfs")


def rank_nodes(tree: DraftTree, candidates: Tensor | None = None) -> Tensor:
    """Ids of the candidate nodes (all when None) ranked best first: descending path-min log_score,
    ties by smaller depth, then smaller index. A parent always ranks ahead of its child."""
    # candidates: [n] bool
    ids = torch.arange(len(tree), dtype=torch.int64)
    if candidates is not None:
        ids = ids[candidates]
    key = -path_min_scores(tree)[ids]
    by_depth = torch.sort(tree.depths[ids], stable=True).indices  # ids ascend already: index tie-break
    ids, key = ids[by_depth], key[by_depth]
    return ids[torch.sort(key, stable=True).indices]


def select_top(base: DraftTree, total: int, order: str = "score") -> tuple[DraftTree, Tensor]:
    """Keep the root plus the top-(total-1) non-root nodes by log_score (connected: a parent ranks
    ahead of its child). Storage order "score" is FlowSpec's score-based segmentation (descending
    score, ties by depth then base index: topological); "bfs" (depth, then base index) is the
    'w/o SBD' ablation. Returns (tree, base_index) with base_index[i] = node i's id in `base`."""
    if order not in _ORDERS:
        raise ConfigError(f"unknown tree order {order!r}; expected one of {', '.join(_ORDERS)}")
    if total < 1:
        raise ConfigError(f"draft tree size must be at least 1 (the root), got {total}")
    ranked = rank_nodes(base)  # the root is first: it holds the top score at the smallest depth
    kept = ranked[: min(total, len(base))]
    if order == "bfs":
        kept = kept.sort().values  # base index order first, so the stable depth sort breaks ties by it
        kept = kept[torch.sort(base.depths[kept], stable=True).indices]
    return reindex(base, kept), kept


def split_segments(n: int, l_max: int, first: int = 0, n_segments: int | None = None) -> list[tuple[int, int]]:
    """Cut node range [first, n) into contiguous [start, end) segments of at most l_max nodes; with
    n_segments, into that many near-equal segments instead (sizes differ by at most 1, larger ones
    first, empty ones dropped; l_max is not applied) — naive PP's micro-batches."""
    if l_max < 1:
        raise ConfigError(f"segment length l_max must be at least 1, got {l_max}")
    if n_segments is not None and n_segments < 1:
        raise ConfigError(f"number of segments must be at least 1, got {n_segments}")
    if first < 0 or first > n:
        raise ValueError(f"segment range start {first} outside [0, {n}]")
    count = n - first
    if n_segments is None:
        return [(s, min(s + l_max, n)) for s in range(first, n, l_max)]
    size, extra = divmod(count, n_segments)
    out = []
    start = first
    for k in range(n_segments):
        end = start + size + (1 if k < extra else 0)
        if end > start:
            out.append((start, end))
        start = end
    return out


def segment_mask(tree: DraftTree, start: int, end: int, alive: Tensor | None = None) -> Tensor:
    """[end-start, end] bool: row r (node start+r) may attend to column j (node j < end) iff j is
    start+r or one of its ancestors (and alive, if given). Walks up parents: O(segment * depth)."""
    if not 0 <= start <= end <= len(tree):
        raise ValueError(f"segment [{start}, {end}) outside a tree of {len(tree)} nodes")
    rows = torch.arange(end - start, dtype=torch.int64)
    mask = torch.zeros(end - start, end, dtype=torch.bool)
    node = torch.arange(start, end, dtype=torch.int64)
    while rows.numel() > 0:
        mask[rows, node] = True
        node = tree.parents[node]
        up = node >= 0
        rows, node = rows[up], node[up]
    if alive is not None:
        mask &= alive[:end].reshape(1, end)
    return mask
