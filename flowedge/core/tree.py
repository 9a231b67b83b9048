"""Flat draft tree: the one data structure every speculation step reads and grows.

Within a round node indices are stable ids: the tree only grows by appending, dead nodes are tracked
by the caller's `alive` mask. Storage order is always topological (parent index < child index), which
lets every structural query run level by level instead of node by node.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

ROOT = 0   # the root's id in every tree; callers test `id == ROOT`, never the root's parent entry


@dataclass(eq=False)
class DraftTree:
    """Flat draft tree in topological storage order; node 0 is the root (last sampled token, not yet
    run through the base model)."""

    tokens: Tensor  # [n] int64
    parents: Tensor  # [n] int64, -1 for the root only
    depths: Tensor  # [n] int64, root 0
    log_scores: Tensor  # [n] float32, cumulative log-prob of the path from the root (root 0.0)

    def __post_init__(self) -> None:
        _check_vector("tokens", self.tokens, torch.int64)
        _check_vector("parents", self.parents, torch.int64)
        _check_vector("depths", self.depths, torch.int64)
        _check_vector("log_scores", self.log_scores, torch.float32)
        n = self.tokens.shape[0]
        if n < 1:
            raise ValueError("a draft tree needs at least its root")
        for name in ("parents", "depths", "log_scores"):
            if getattr(self, name).shape[0] != n:
                raise ValueError(f"{name} has {getattr(self, name).shape[0]} entries, tokens has {n}")
        if bool((self.tokens < 0).any()):
            raise ValueError("token ids must be non-negative")
        if bool(torch.isnan(self.log_scores).any()):
            raise ValueError("log_scores contain NaN")
        if int(self.parents[0]) != -1 or int(self.depths[0]) != 0:
            raise ValueError("node 0 must be the root (parent -1, depth 0)")
        rest = self.parents[1:]
        own = torch.arange(1, n, dtype=torch.int64)
        if bool(((rest < 0) | (rest >= own)).any()):
            raise ValueError("every non-root node needs a parent with a smaller index")
        if bool((self.depths[1:] != self.depths[rest] + 1).any()):
            raise ValueError("depths disagree with parents")

    @classmethod
    def root_only(cls, token: int) -> "DraftTree":
        """A tree holding just the root token: the start of every round."""
        return cls(
            tokens=torch.tensor([token], dtype=torch.int64),
            parents=torch.tensor([-1], dtype=torch.int64),
            depths=torch.zeros(1, dtype=torch.int64),
            log_scores=torch.zeros(1, dtype=torch.float32),
        )

    def __len__(self) -> int:
        return int(self.tokens.shape[0])

    def append(self, tokens: Tensor, parents: Tensor, log_scores: Tensor) -> Tensor:
        """Append k nodes in place and return their ids [k]; parents may name nodes appended earlier in
        the same batch. Depths are derived, so a caller cannot make them inconsistent."""
        # tokens, parents: [k] int64; log_scores: [k] float
        tokens = torch.as_tensor(tokens, dtype=torch.int64).reshape(-1)
        parents = torch.as_tensor(parents, dtype=torch.int64).reshape(-1)
        log_scores = torch.as_tensor(log_scores, dtype=torch.float32).reshape(-1)
        k, n = tokens.shape[0], len(self)
        if parents.shape[0] != k or log_scores.shape[0] != k:
            raise ValueError(f"append got {k} tokens, {parents.shape[0]} parents, {log_scores.shape[0]} scores")
        new_ids = torch.arange(n, n + k, dtype=torch.int64)
        if k == 0:
            return new_ids
        if bool(((parents < 0) | (parents >= new_ids)).any()):
            raise ValueError("appended nodes need an existing parent with a smaller index")
        if bool((tokens < 0).any()) or bool(torch.isnan(log_scores).any()):
            raise ValueError("appended tokens must be non-negative and scores not NaN")
        depths = torch.cat([self.depths, torch.full((k,), -1, dtype=torch.int64)])
        unresolved = torch.ones(k, dtype=torch.bool)
        while bool(unresolved.any()):  # one pass per level of in-batch chaining
            parent_depth = depths[parents]
            ready = unresolved & (parent_depth >= 0)
            depths[n:][ready] = parent_depth[ready] + 1
            unresolved &= ~ready
        self.tokens = torch.cat([self.tokens, tokens])
        self.parents = torch.cat([self.parents, parents])
        self.depths = depths
        self.log_scores = torch.cat([self.log_scores, log_scores])
        return new_ids

    def children(self, i: int, alive: Tensor | None = None) -> Tensor:
        """Ids of i's children (alive ones only when a mask is given), ascending."""
        hit = self.parents == i
        if alive is not None:
            hit &= alive[: len(self)]
        return hit.nonzero().reshape(-1)

    def path(self, i: int) -> list[int]:
        """Node ids root..i."""
        self._check_index(i)
        out = []
        node = int(i)
        while node >= 0:
            out.append(node)
            node = int(self.parents[node])
        return out[::-1]

    def path_tokens(self, i: int) -> list[int]:
        """Tokens root..i."""
        return self.tokens[self.path(i)].tolist()

    def ancestor_mask(self) -> Tensor:
        """[n, n] bool: m[i, j] = j is i or an ancestor of i; each level copies its parents' rows."""
        mask = torch.eye(len(self), dtype=torch.bool)
        for level in self.levels()[1:]:
            mask[level] |= mask[self.parents[level]]
        return mask

    def subtree_mask(self, i: int) -> Tensor:
        """[n] bool: i and all its descendants."""
        self._check_index(i)
        mask = torch.zeros(len(self), dtype=torch.bool)
        mask[i] = True
        for level in self.levels()[int(self.depths[i]) + 1:]:
            mask[level] = mask[self.parents[level]]
        return mask

    def levels(self) -> list[Tensor]:
        """Node ids grouped by depth (ascending ids within a level): one sort, then a split, so
        level-by-level passes cost O(n) in total rather than O(n) per level."""
        order = torch.sort(self.depths, stable=True).indices
        counts = torch.bincount(self.depths).tolist()
        return list(torch.split(order, counts))

    def _check_index(self, i: int) -> None:
        if not 0 <= int(i) < len(self):
            raise ValueError(f"node {i} is outside a tree of {len(self)} nodes")


def path_min_scores(tree: DraftTree) -> Tensor:
    """[n] float32: the smallest log_score on the path root..i. Equal to log_scores for a well-formed
    tree (scores never increase along a path); ranking by it keeps every parent ahead of its child even
    if a caller hands in scores that do increase."""
    out = tree.log_scores.clone()
    for level in tree.levels()[1:]:
        out[level] = torch.minimum(out[level], out[tree.parents[level]])
    return out


def reindex(tree: DraftTree, order: Tensor) -> DraftTree:
    """The tree made of the nodes `order` lists, in that order: order[0] becomes the root (its score
    shifted to 0) and every other listed node's parent must appear earlier in `order`."""
    # order: [m] int64 node ids of `tree`
    order = torch.as_tensor(order, dtype=torch.int64).reshape(-1)
    if order.shape[0] < 1:
        raise ValueError("reindex needs at least a root")
    position = torch.full((len(tree),), -1, dtype=torch.int64)
    position[order] = torch.arange(order.shape[0], dtype=torch.int64)
    parents = position[tree.parents[order].clamp(min=0)]
    parents[0] = -1
    if bool((parents[1:] < 0).any()):
        raise ValueError("reindex: a listed node's parent is not listed")
    root = order[0]
    return DraftTree(
        tokens=tree.tokens[order].clone(),
        parents=parents,
        depths=tree.depths[order] - tree.depths[root],
        log_scores=tree.log_scores[order] - tree.log_scores[root],
    )


def subtree(tree: DraftTree, i: int) -> tuple[DraftTree, Tensor]:
    """Node i and its descendants as a tree rooted at i (scores relative to i), in storage order; with
    the ids they had in `tree`. Re-roots a stored base tree at the current walk position."""
    ids = tree.subtree_mask(i).nonzero().reshape(-1)
    return reindex(tree, ids), ids


def find_path(tree: DraftTree, tokens: list[int], alive: Tensor | None = None) -> int | None:
    """The first node whose token path from the root is `tokens` (through alive nodes, if a mask is
    given), or None."""
    if not tokens or int(tree.tokens[0]) != tokens[0]:
        return None
    node = 0
    for token in tokens[1:]:
        hit = (tree.parents == node) & (tree.tokens == token)
        if alive is not None:
            hit &= alive[: len(tree)]
        found = hit.nonzero()
        if found.numel() == 0:
            return None
        node = int(found[0])
    return node


def _check_vector(name: str, value: object, dtype: torch.dtype) -> None:
    if not isinstance(value, Tensor) or value.dim() != 1 or value.dtype != dtype:
        raise ValueError(f"{name} must be a 1-D {dtype} tensor")
