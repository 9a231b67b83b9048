"""Retain-index sets: what the head tells every stage after a walk, and how a stage applies it.

A set decides every id below its horizon (committed, kept as draft, or dead) and nothing above it,
so it stays correct for nodes appended while it travels down the pipeline.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from flowedge.core.tree import DraftTree
from flowedge.core.verify import WalkResult


@dataclass(frozen=True, slots=True)
class PruneSet:
    """What every stage must do after a walk: `commit` node ids become permanent context (in path
    order), `keep` node ids stay as drafts (ascending), every other id < horizon is dead."""

    commit: Tensor  # [c] int64
    keep: Tensor  # [k] int64, ascending
    horizon: int  # len(tree) when the set was made; ids >= horizon are not decided by this set

    def __post_init__(self) -> None:
        for name in ("commit", "keep"):
            value = getattr(self, name)
            if not isinstance(value, Tensor) or value.dim() != 1 or value.dtype != torch.int64:
                raise ValueError(f"PruneSet.{name} must be a 1-D int64 tensor")
            if value.numel() and (int(value.min()) < 0 or int(value.max()) >= self.horizon):
                raise ValueError(f"PruneSet.{name} holds ids outside [0, {self.horizon})")
        if self.keep.numel() > 1 and bool((self.keep[1:] <= self.keep[:-1]).any()):
            raise ValueError("PruneSet.keep must be strictly ascending")
        if self.commit.unique().numel() != self.commit.numel():
            raise ValueError("PruneSet.commit repeats an id")
        if bool(torch.isin(self.commit, self.keep).any()):
            raise ValueError("PruneSet.commit and keep overlap")


def prune_after_walk(tree: DraftTree, alive: Tensor, result: WalkResult) -> PruneSet:
    """Commit the walked path; keep the alive subtree under the continuing node (nothing when the walk
    ended the round)."""
    # alive: [n] bool
    if alive.shape[0] != len(tree):
        raise ValueError(f"alive mask has {alive.shape[0]} entries for a tree of {len(tree)} nodes")
    commit = torch.tensor(result.committed, dtype=torch.int64)
    if result.next_node is None:
        keep = torch.zeros(0, dtype=torch.int64)
    else:
        keep = (tree.subtree_mask(result.next_node) & alive).nonzero().reshape(-1)
    return PruneSet(commit=commit, keep=keep, horizon=len(tree))


def apply_alive(alive: Tensor, prune: PruneSet) -> Tensor:
    """New alive mask, same length: ids below the horizon alive iff kept; later ids unchanged."""
    # alive: [n] bool, n >= horizon
    if alive.shape[0] < prune.horizon:
        raise ValueError(f"alive mask has {alive.shape[0]} entries, prune set horizon is {prune.horizon}")
    out = alive.clone()
    out[: prune.horizon] = False
    out[prune.keep] = True
    return out


def live_in(ids: Tensor, prune: PruneSet) -> Tensor:
    """[m] bool: True iff the id is not decided by the set (>= horizon) or is kept as a draft."""
    # ids: [m] int64
    return (ids >= prune.horizon) | torch.isin(ids, prune.keep)


def cache_reorder(cache_ids: Tensor, prune: PruneSet) -> tuple[Tensor, Tensor]:
    """For a stage's draft KV entries (ids in cache order): positions of the committed entries in
    prune.commit order, and positions of the entries that stay drafts, in cache order."""
    # cache_ids: [m] int64 -> commit_pos: [c] int64, keep_pos: [k'] int64
    sorted_ids, order = torch.sort(cache_ids)
    if sorted_ids.numel() > 1 and bool((sorted_ids[1:] == sorted_ids[:-1]).any()):
        raise ValueError("cache ids repeat a node")
    slot = torch.searchsorted(sorted_ids, prune.commit).clamp(max=max(sorted_ids.numel() - 1, 0))
    if prune.commit.numel() and (sorted_ids.numel() == 0 or bool((sorted_ids[slot] != prune.commit).any())):
        raise ValueError("a committed node is missing from this stage's draft cache")
    commit_pos = order[slot] if prune.commit.numel() else torch.zeros(0, dtype=torch.int64)
    keep_pos = live_in(cache_ids, prune).nonzero().reshape(-1)
    return commit_pos, keep_pos
