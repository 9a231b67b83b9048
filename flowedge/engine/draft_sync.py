"""A drafter device's replica of node 0's draft state, and the grafting of its answers back into node 0's tree.

Node 0 sends a `DraftSnapshot`: its stored draft tree at the committed context, which of the tree's nodes
the draft model has run, and the K/V rows the replica lacks (the committed rows past what the replica
already holds, and every run node's row). The replica (`DrafterDevice`, one `Drafter` per request) loads
it, grows the tree best-first by the job's calls exactly as node 0 would, and answers with a `DraftGrowth`:
the grown tree and the K/V rows of the nodes it ran.

Node 0 grafts the growth *by token path*: a draft model's output for a node depends only on the node's
token path (K/V rows carry absolute positions), so every node the replica ran under node 0's current root
is valid there, however far the walk moved while the answer travelled. Nodes off the accepted path are
simply not found and dropped. Nothing here touches verification: the base model checks every token.
"""
from __future__ import annotations

import logging
from collections import OrderedDict
from dataclasses import dataclass

import torch

from flowedge.core.merge import match_paths, merge_by_path
from flowedge.core.tree import ROOT, DraftTree, find_path, reindex, subtree
from flowedge.engine.draft_slots import CacheSlots
from flowedge.engine.drafter import Drafter, TreeShape
from flowedge.errors import ReplicaBehind

log = logging.getLogger(__name__)

# An answer's scores: cumulative log-probabilities, so at most 0 (plus rounding). -inf is refused although
# it is a log-probability: a node scored -inf that becomes the walk's root is re-rooted by subtracting its
# score (core/tree.reindex), and -inf - -inf is NaN. The floor is far below any real path (a hundred
# tokens at -100 each is -1e4) and far from where node 0's sums of scores overflow float32 to -inf.
MIN_LOG_SCORE = -1e6
MAX_LOG_SCORE = 1e-3

__all__ = ["DraftGrowth", "DraftSnapshot", "DrafterDevice", "ReplicaBehind", "check_growth", "graft", "snapshot"]


@dataclass(frozen=True, slots=True)
class DraftSnapshot:
    """Node 0 -> drafter: continue node 0's draft tree at `context` (its root = context[-1], run)."""
    context: tuple[int, ...]
    keep: int                  # committed rows the replica already holds (a prefix of `context`)
    tokens: torch.Tensor       # [n] int64: node 0's stored tree
    parents: torch.Tensor      # [n] int64
    log_scores: torch.Tensor   # [n] float32
    ran: torch.Tensor          # [r] int64: tree nodes run (root excluded: it is committed context)
    rows: torch.Tensor         # [layers, 2, kv_heads, len(context) - keep + r, head_dim]: K/V, committed then ran
    topk: int
    calls: int                 # best-first draft calls to run
    width: int                 # rows a call
    lookup: int                # of those, prompt-lookup guess rows

    def nbytes(self) -> int:
        return self.rows.nbytes + 20 * int(self.tokens.numel()) + 8 * int(self.ran.numel()) + 8 * len(self.context)


@dataclass(frozen=True, slots=True)
class DraftGrowth:
    """Drafter -> node 0: the tree grown from a snapshot, and the K/V rows of the nodes the drafter ran."""
    context: tuple[int, ...]
    tokens: torch.Tensor       # [m] int64, the snapshot's nodes first (same ids)
    parents: torch.Tensor
    log_scores: torch.Tensor
    ran: torch.Tensor          # [r] int64: nodes the drafter ran for this job
    rows: torch.Tensor         # [layers, 2, kv_heads, r, head_dim]
    calls: list                # the draft forwards run, as (tokens, context, seconds)

    def nbytes(self) -> int:
        return self.rows.nbytes + 20 * int(self.tokens.numel()) + 8 * int(self.ran.numel())


# ---- K/V rows ---------------------------------------------------------------------------------------
def take_rows(cache, idx: torch.Tensor) -> torch.Tensor:
    """Entries `idx` of every layer as one tensor [layers, 2, kv_heads, len(idx), head_dim] (a copy)."""
    idx = idx.to(torch.long)
    k = [cache._k[i][0].index_select(1, idx) for i in cache.layer_ids]
    v = [cache._v[i][0].index_select(1, idx) for i in cache.layer_ids]
    return torch.stack([torch.stack(k), torch.stack(v)], dim=1)


@torch.inference_mode()
def append_rows(cache, rows: torch.Tensor) -> None:
    """Append rows [layers, 2, kv_heads, n, head_dim] after the cache's entries."""
    for j, i in enumerate(cache.layer_ids):
        cache.update(rows[j, 0].unsqueeze(0), rows[j, 1].unsqueeze(0), i)


# ---- node 0's side ----------------------------------------------------------------------------------
def roots_free(drafter: Drafter, context: list[int]) -> bool:
    """Whether re-rooting node 0's stored tree at `context` runs no draft call (the new root already ran)."""
    ctx = drafter.context
    if drafter.base is None or len(context) < len(ctx) or context[: len(ctx)] != ctx:
        return False
    if len(context) == len(ctx):
        return True
    node = find_path(drafter.base, list(context[len(ctx) - 1:]))
    drafter._slots.grow(len(drafter.base))
    return node is not None and bool(drafter._slots.ran[node])


def snapshot(drafter: Drafter, context: list[int], keep: int, calls: int, width: int,
             lookup: int) -> DraftSnapshot | None:
    """Node 0's tree at `context` for a drafter whose replica holds the first `keep` committed rows. The
    drafter must already be rooted at `context` (`Drafter.advance(context, 0, ...)`); None if it is not."""
    if drafter.base is None or drafter.context != list(context) or drafter.committed != len(context):
        return None
    keep = min(keep, drafter.committed)
    slots = drafter._slots
    slots.grow(len(drafter.base))
    ran = slots.ran.nonzero().reshape(-1)
    ran = ran[ran > 0]
    idx = torch.cat([torch.arange(keep, drafter.committed), slots.slot[ran]])
    tree = drafter.base
    return DraftSnapshot(tuple(context), keep, tree.tokens.clone(), tree.parents.clone(), tree.log_scores.clone(),
                         ran, take_rows(drafter.cache, idx), drafter.shape.topk, calls, width, lookup)


def check_growth(snap: DraftSnapshot, growth: DraftGrowth) -> None:
    """Refuse (ValueError) an answer that is not a growth of `snap`: the job's nodes first with their
    scores, finite K/V rows, log-probability scores in [MIN_LOG_SCORE, 0], new nodes only under run
    nodes, and no more of them than the job's calls can make. A drafter is a peer: what it sends is
    checked, not trusted (the rows' magnitude is checked on the wire, node/draft_wire.py)."""
    n, m = int(snap.tokens.numel()), int(growth.tokens.numel())
    if m < n or not torch.equal(growth.tokens[:n], snap.tokens) or not torch.equal(growth.parents[:n], snap.parents) \
            or not torch.equal(growth.log_scores[:n], snap.log_scores):
        raise ValueError(f"the answer does not keep the job's {n} nodes first, as they were")
    if m - n > snap.calls * snap.width * snap.topk:
        raise ValueError(f"the answer adds {m - n} nodes; {snap.calls} calls of {snap.width} rows make "
                         f"at most {snap.calls * snap.width * snap.topk}")
    scores = growth.log_scores
    if not bool(((scores >= MIN_LOG_SCORE) & (scores <= MAX_LOG_SCORE)).all()):   # NaN fails both
        raise ValueError(f"the answer's scores are not log-probabilities in [{MIN_LOG_SCORE:g}, 0]")
    if not bool(torch.isfinite(growth.rows).all()):
        raise ValueError("the answer's K/V rows are not finite")
    ran = torch.zeros(m, dtype=torch.bool)
    ran[0] = True
    ran[snap.ran] = True
    if bool(ran[growth.ran].any()) or growth.rows.shape[3] != growth.ran.numel():
        raise ValueError("the answer's run nodes repeat the job's, or do not match its rows")
    ran[growth.ran] = True
    if not bool(ran[growth.parents[n:]].all()):
        raise ValueError("the answer puts nodes under nodes nobody ran")


def graft(drafter: Drafter, growth: DraftGrowth, snap: DraftSnapshot) -> tuple[int, int]:
    """Put the growth's nodes under node 0's current root into its stored tree (by token path), with the
    K/V rows of run nodes node 0 lacks now: the drafter's, and the snapshot's own (node 0 may have rebuilt
    its tree since). Nodes under a node no row exists for are left out, so node 0 never holds children of
    a node it cannot run from. Returns (nodes added, rows adopted); (0, 0): nothing new under the root
    (the walk left the job's tree, or node 0 drafted it meanwhile)."""
    ctx = drafter.context
    if drafter.base is None or len(ctx) < len(growth.context) or tuple(ctx[: len(growth.context)]) != growth.context:
        return 0, 0
    grown = DraftTree(growth.tokens, growth.parents, _depths(growth.parents), growth.log_scores)
    at = find_path(grown, list(ctx[len(growth.context) - 1:]))
    if at is None:
        return 0, 0
    n_ctx = len(snap.context) - snap.keep
    rows = torch.cat([snap.rows[:, :, :, n_ctx:], growth.rows], dim=3)
    row_of = torch.full((len(grown),), -1, dtype=torch.long)
    row_of[torch.cat([snap.ran, growth.ran])] = torch.arange(rows.shape[3])
    sub, ids = subtree(grown, at)
    keep = _under_run_nodes(sub, row_of[ids] >= 0)
    kept = keep.nonzero().reshape(-1)
    return _merge(drafter, reindex(sub, kept), row_of[ids][kept], rows)


def _under_run_nodes(tree: DraftTree, run: torch.Tensor) -> torch.Tensor:
    """Nodes whose every ancestor below the root (committed context) has a K/V row: [n] bool."""
    keep = torch.ones(len(tree), dtype=torch.bool)
    run = run.clone()
    run[0] = True
    for level in tree.levels()[1:]:
        parents = tree.parents[level]
        keep[level] = keep[parents] & run[parents]
    return keep


def _merge(drafter: Drafter, sub: DraftTree, row_of: torch.Tensor, rows: torch.Tensor) -> tuple[int, int]:
    """Append the nodes of `sub` (rooted at node 0's root) that node 0's tree lacks, by token path, and
    adopt the K/V rows of nodes the drafter ran and node 0 never did."""
    base, slots = _tree_of(drafter), drafter._slots
    added = merge_by_path(base, torch.ones(len(base), dtype=torch.bool), ROOT, sub)
    slots.grow(len(base))
    _, target = match_paths(base, torch.ones(len(base), dtype=torch.bool), ROOT, sub)
    adopt = (row_of >= 0) & ~slots.ran[target]
    adopt[0] = False
    nodes = target[adopt]
    if nodes.numel():
        first = drafter.cache.length
        append_rows(drafter.cache, rows.index_select(3, row_of[adopt]))
        slots.put(nodes, torch.arange(first, first + nodes.numel()))
    return int(added.numel()), int(nodes.numel())


def _tree_of(drafter: Drafter) -> DraftTree:
    """The drafter's tree, which a snapshot loaded or a round built before any merge or growth."""
    if drafter.base is None:
        raise ReplicaBehind("the drafter holds no draft tree")
    return drafter.base


def _depths(parents: torch.Tensor) -> torch.Tensor:
    """Depths from parents (storage order is topological): one pass per level, not per node."""
    depths = torch.zeros_like(parents)
    todo = torch.ones_like(parents, dtype=torch.bool)
    todo[0] = False
    while bool(todo.any()):
        ready = todo & ~todo[parents.clamp(min=0)]
        depths[ready] = depths[parents[ready]] + 1
        todo &= ~ready
    return depths


# ---- the drafter device's side ----------------------------------------------------------------------
class DrafterDevice:
    """The drafter role's engine: a replica `Drafter` per request (the newest `max_requests` kept), each
    loaded from node 0's snapshots and grown by the job's calls. The simulator and the daemon's drafter
    process run this same class."""

    def __init__(self, model, max_requests: int = 8) -> None:
        self.model, self.max_requests = model, max_requests
        self.replicas: OrderedDict[object, Drafter] = OrderedDict()

    def forget(self, key: object) -> None:
        self.replicas.pop(key, None)

    def run(self, key: object, snap: DraftSnapshot) -> DraftGrowth:
        """Grow node 0's tree from `snap`. Raises ReplicaBehind when the replica lacks `snap.keep` rows."""
        d = self._replica(key, snap)
        load(d, snap)
        before = d._slots.ran.clone()
        d.advance(list(snap.context), snap.calls, snap.width, snap.lookup)
        tree = _tree_of(d)
        d._slots.grow(len(tree))
        now = d._slots.ran.clone()
        now[: before.numel()] &= ~before
        ran = now.nonzero().reshape(-1)
        ran = ran[ran > 0]
        rows = take_rows(d.cache, d._slots.slot[ran])
        return DraftGrowth(snap.context, tree.tokens.clone(), tree.parents.clone(), tree.log_scores.clone(),
                           ran, rows, d.drain_calls())

    def _replica(self, key: object, snap: DraftSnapshot) -> Drafter:
        d = self.replicas.get(key)
        if d is None:
            if snap.keep:
                raise ReplicaBehind(f"no replica for request {key!r}; node 0 assumed {snap.keep} rows")
            d = self.replicas[key] = Drafter(self.model)
            while len(self.replicas) > self.max_requests:
                self.replicas.popitem(last=False)
        self.replicas.move_to_end(key)
        return d


def load(d: Drafter, snap: DraftSnapshot) -> None:
    """Make replica `d` hold node 0's state of `snap`: its committed rows up to `keep` (checked), the
    shipped rows after them, then the tree's run nodes."""
    ctx = list(snap.context)
    if snap.keep and (d.committed < snap.keep or d.context[: snap.keep] != ctx[: snap.keep]):
        raise ReplicaBehind(f"replica holds {d.committed} matching rows, node 0 assumed {snap.keep}")
    n_ctx = len(ctx) - snap.keep
    d.cache.truncate(snap.keep)
    append_rows(d.cache, snap.rows)
    d.committed, d.context = len(ctx), ctx
    tree = DraftTree(snap.tokens.clone(), snap.parents.clone(), _depths(snap.parents), snap.log_scores.clone())
    d.base, d.shape = tree, TreeShape(topk=snap.topk)
    d._slots = CacheSlots.none_run(len(tree))
    d._slots.put(snap.ran, torch.arange(len(ctx), len(ctx) + snap.ran.numel()))
    d.frontier = torch.empty(0, dtype=torch.long)
    assert d.cache.length == len(ctx) + snap.ran.numel() == snap.keep + n_ctx + snap.ran.numel()
