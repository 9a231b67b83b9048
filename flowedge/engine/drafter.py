"""Grow EAGLE-2-style draft trees with a small draft LM, reusing its KV cache across levels and rounds.

The draft cache holds the committed context (prompt + output tokens, root included) followed by the
entries of the current base tree's expanded nodes. A new build crops back to the committed part, so
accepted tokens are never re-run and tree entries never leak into the next tree.
"""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass

import torch

from flowedge.core.config import DRAFT_QUANTS
from flowedge.core.lookup import lookup_continuation
from flowedge.core.tree import ROOT, DraftTree, find_path, subtree
from flowedge.engine.draft_slots import CacheSlots
from flowedge.errors import ConfigError
from flowedge.models.kv_cache import KVCache
from flowedge.models.stage import StageModel, bool_to_float_mask, causal_mask, is_packed

log = logging.getLogger(__name__)


def resolve_draft_quant(quant: str, device: str = "cpu") -> str:
    """`auto` -> the draft backend that runs here (int4 first); anything else as given."""
    if quant not in DRAFT_QUANTS:
        raise ConfigError(f"draft quant must be one of {list(DRAFT_QUANTS)}, got {quant!r}")
    if quant != "auto":
        return quant
    from flowedge.models.quant import draft_backend

    return draft_backend(device)


def load_draft_model(model_dir, quant: str = "auto") -> StageModel:
    """The draft model, 4-bit throughout (lm_head included) unless `quant` is "none".

    The draft only proposes; the base model decides every token, so quantizing it can lower acceptance
    but never changes the output. Measured on the default pair (docs/bench/README.md): int4 halves a
    draft call on a CPU and keeps its top-1 agreement with the base; on a GPU the 136M-parameter lm_head
    is 15% of a 0.5B draft call in fp16 and 4% in int4."""
    quant = resolve_draft_quant(quant)
    if quant in ("none", "nf4") and is_packed(model_dir):
        # A W4A16 checkpoint holds only the int4 draft; the draft never decides a token, so this changes
        # proposals (and speed), not outputs. Resolve the draft with the same quant for a 16-bit one.
        log.warning("the draft at %s is stored W4A16: running it int4, not %s", model_dir, quant)
        quant = "int4"
    # a 4-bit lm_head: the draft call sets node 0's rate, and the draft's precision moves acceptance only
    return StageModel.load(model_dir, quant=quant, quant_lm_head=True, wide_lm_head=False)


@dataclass(frozen=True, slots=True)
class TreeShape:
    """How a draft tree grows: `topk` children per expanded node, `width` nodes expanded per level
    (EAGLE-2 uses width = topk), `depth` levels below the root; `keep_all` keeps every candidate
    (EAGLE-2's base tree, reranked later) instead of only the expanded ones (PipeDec's levels)."""
    topk: int = 10
    depth: int = 6
    width: int | None = None
    keep_all: bool = True

    def __post_init__(self) -> None:
        if self.topk < 1 or self.depth < 1 or (self.width is not None and self.width < 1):
            raise ConfigError(f"tree topk, width and depth must be >= 1 (got {self.topk}, {self.width}, {self.depth})")

    @property
    def level_width(self) -> int:
        return self.width or self.topk


class Drafter:
    wants_features = False   # a draft model reads tokens only (a draft head also reads the base's features)

    def __init__(self, model: StageModel, batcher=None, cache: KVCache | None = None) -> None:
        """`cache`: the KV cache the draft calls fill (None: a new one of `model`'s; a draft head brings its own)."""
        self.model = model
        self.batcher = batcher   # engine/draft_batch.DraftBatcher: calls shared with other requests' drafters
        self.cache = model.new_cache() if cache is None else cache
        self.forwards = 0
        self._calls: list[tuple[int, int, float]] = []
        self.reset()

    def reset(self) -> None:
        self.cache.truncate(0)
        self.committed = 0                 # cache entries that are committed context
        self.context: list[int] = []       # tokens behind those entries
        self.base: DraftTree | None = None
        self._slots = CacheSlots.none_run()   # base node -> draft cache entry, for the nodes run
        self.frontier = torch.empty(0, dtype=torch.long)
        self.shape = TreeShape()

    @property
    def tree(self) -> DraftTree:
        """The tree being grown, once `build` (or a snapshot's load) made one."""
        if self.base is None:
            raise RuntimeError("the drafter has no tree yet")
        return self.base

    # ---- building ---------------------------------------------------------------------------------
    def build(self, context: list[int], shape: TreeShape, lookup: int = 0) -> DraftTree:
        """Base tree rooted at context[-1]; `context` = prompt + every output token so far. With
        `lookup` > 0 the first call also runs a prompt-lookup guess after the root (see `advance`)."""
        keep = self._sync(context)
        new = torch.tensor(context[keep:], dtype=torch.long)
        guess = lookup_continuation(torch.tensor(context, dtype=torch.long), lookup) if lookup else new[:0]
        tokens = torch.cat([new, guess])
        logp_all = self._run(tokens, torch.arange(keep, keep + tokens.numel()), causal_mask(tokens.numel(), keep))
        logp = logp_all[new.numel() - 1]
        self.committed = keep + new.numel()
        self.shape = shape
        tree = DraftTree.root_only(context[-1])
        top = self._top(logp, shape.level_width if not shape.keep_all else shape.topk)
        kids = tree.append(top.indices, torch.zeros_like(top.indices), top.values.float())
        self.base = tree
        self._slots = CacheSlots.none_run(len(tree))
        if guess.numel():   # the guess rows sit right after the committed context, where tree entries go
            self._adopt_chain(kids, guess, logp_all[new.numel():], self.committed)
        self.frontier = kids[: shape.level_width]
        self.extend(shape.depth - 1)
        return tree

    def extend(self, levels: int, alive: torch.Tensor | None = None) -> torch.Tensor:
        """Grow the stored base tree by up to `levels` levels from its frontier (score-aware expansion,
        PipeDec's next level). Frontier nodes dead under `alive` are skipped. Returns the new node ids."""
        if self.base is None:
            raise RuntimeError("extend() before build()")
        added = []
        for _ in range(levels):
            self._grow_slots()
            f = self.frontier
            keep = ~self._slots.ran[f]          # nodes a guessed chain already ran are not run twice
            if alive is not None:
                keep &= alive[f]
            self.frontier = f[keep]
            if self.frontier.numel() == 0:
                break
            added.append(self._expand_frontier())
        return torch.cat(added) if added else torch.empty(0, dtype=torch.long)

    def extend_chain(self, lookup: int = 0) -> torch.Tensor:
        """PipeSpec's drafting on a chain (a `topk` = 1 tree, its last node the tip): one draft call at the
        tip, plus `lookup` rows of a prompt-lookup guess after it that the draft checks in the same call
        (the hierarchy's first level). Returns the new node ids: the tip's child, then the guessed tokens
        the draft agreed with."""
        if self.base is None:
            raise RuntimeError("extend_chain() before build()")
        self._grow_slots()
        tip = len(self.base) - 1
        self.frontier = torch.tensor([tip])
        return self._expand_frontier(best_first=True, guess=self._guess(tip, lookup))

    def advance(self, context: list[int], forwards: int, width: int, lookup: int = 0) -> DraftTree | None:
        """Re-root the stored base tree at context[-1] and grow it best-first by `forwards` draft calls
        of `width` nodes each.

        A standalone draft LM's logits for a node depend only on the node's token path, so the subtree
        under the accepted path already holds exactly what a fresh tree from the new root would compute:
        re-rooting keeps it and spends draft calls only on new depth (FlowSpec's context-aware expansion
        at a fraction of the cost). With `lookup` > 0, up to that many of a call's rows run a
        prompt-lookup guess of how the best open node's path goes on (`core/lookup.py`); each guessed
        token the draft itself then proposes becomes a node already run, so one call can deepen the
        likeliest path by several levels. Returns None when the context left the stored tree."""
        if self.base is None or len(context) < len(self.context) or context[: len(self.context)] != self.context:
            return None
        if len(context) > len(self.context):
            node = find_path(self.base, context[len(self.context) - 1:])
            if node is None:
                return None
            self._reroot(node, context)
        for _ in range(forwards):
            self._grow_slots()
            open_nodes = self._slots.not_run()
            open_nodes = open_nodes[open_nodes > 0]
            if open_nodes.numel() == 0:
                break
            best = self.tree.log_scores[open_nodes].topk(min(width, open_nodes.numel())).indices
            guess = self._guess(int(open_nodes[best[0]]), min(lookup, width - 1))
            self.frontier = open_nodes[best[: width - guess.numel()]]   # [0]: the node the guess follows
            self._expand_frontier(best_first=True, guess=guess)
        return self.tree

    def _guess(self, node: int, max_tokens: int) -> torch.Tensor:
        """Prompt-lookup guess of the tokens after `node`, from the committed context and its path."""
        if max_tokens < 1:
            return torch.empty(0, dtype=torch.long)
        path = self.tree.tokens[self.tree.path(node)[1:]]
        return lookup_continuation(torch.cat([torch.tensor(self.context, dtype=torch.long), path]), max_tokens)

    def _reroot(self, node: int, context: list[int]) -> None:
        """Make `node` the root: its ancestors' cache entries join the committed context, entries
        outside its subtree are dropped, and the node itself is run if it never was."""
        self._grow_slots()
        path = self.tree.path(node)[1:]                      # below the old root, ending at `node`
        on_path = torch.tensor(path)
        slots = self._slots.slot[on_path]
        anc = slots[:-1]                                     # every ancestor ran: it has children
        sub_tree, ids = subtree(self.tree, node)
        sub_ran = self._slots.ran[ids[1:]]
        inner = self._slots.slot[ids[1:]][sub_ran]
        head = torch.arange(self.committed)
        own = slots[-1:] if bool(self._slots.ran[on_path[-1]]) else slots[:0]
        self.cache.keep(torch.cat([head, anc, own, inner]))
        new_slots = CacheSlots.none_run(len(sub_tree))
        base_len = self.committed + anc.numel() + own.numel()
        new_slots.put(torch.arange(1, len(sub_tree))[sub_ran], torch.arange(base_len, base_len + inner.numel()))
        self.committed = self.committed + anc.numel() + own.numel()
        self.context = list(context)
        self.base, self._slots = sub_tree, new_slots
        if own.numel() == 0:   # the new root was never run: run it now, as committed context
            self._run_new_root()

    def _run_new_root(self) -> None:
        """Append the root's entry to the committed context and give it its top-k children."""
        past = self.cache.length
        allowed = torch.zeros(1, past + 1, dtype=torch.bool)
        allowed[:, : self.committed] = True
        allowed[0, past] = True
        # The root entry lands after the tree entries; committed context must stay a prefix, so the
        # root's entry is moved in front of them right after the call.
        logp = self._run(self.tree.tokens[:1], torch.tensor([len(self.context) - 1]), allowed)[0]
        order = torch.cat([torch.arange(self.committed), torch.tensor([past]),
                           torch.arange(self.committed, past)])
        self.cache.keep(order)
        self._slots.shift(1)
        self.committed += 1
        top = self._top(logp, self.shape.topk)
        self.tree.append(top.indices, torch.zeros_like(top.indices), top.values.float())
        self._grow_slots()

    def _expand_frontier(self, best_first: bool = False, guess: torch.Tensor | None = None) -> torch.Tensor:
        """One draft call over the frontier (plus, best-first, a guessed chain after frontier[0])."""
        tree, frontier, shape = self.tree, self.frontier, self.shape
        k, past = frontier.numel(), self.cache.length
        m = 0 if guess is None else guess.numel()
        allowed = self._tree_rows(frontier, past, chain=m)
        positions = self.committed - 1 + tree.depths[frontier]
        tokens_in = tree.tokens[frontier]
        if m and guess is not None:
            positions = torch.cat([positions, positions[0] + torch.arange(1, m + 1)])
            tokens_in = torch.cat([tokens_in, guess])
        logp = self._run(tokens_in, positions, allowed)
        self._grow_slots()
        self._slots.put(frontier, torch.arange(past, past + k))
        top = self._top(logp[:k], shape.topk)                                  # [k, topk]
        scores = (tree.log_scores[frontier].unsqueeze(1) + top.values).flatten()
        tokens = top.indices.flatten()
        parents = frontier.unsqueeze(1).expand(k, shape.topk).flatten()
        best = scores.topk(min(shape.level_width, scores.numel())).indices
        if best_first:
            new = tree.append(tokens, parents, scores.float())
            if m and guess is not None:
                new = torch.cat([new, self._adopt_chain(new[: shape.topk], guess, logp[k:], past + k)])
            return new
        if shape.keep_all:
            new = tree.append(tokens, parents, scores.float())
            self.frontier = new[best]
        else:
            new = tree.append(tokens[best], parents[best], scores[best].float())
            self.frontier = new
        self._grow_slots()
        return new

    def _adopt_chain(self, children: torch.Tensor, guess: torch.Tensor, logp: torch.Tensor,
                     first_slot: int) -> torch.Tensor:
        """Walk the guessed chain down the draft's own proposals: while guess[i] is one of the current
        node's top-k children, that child was already run (cache slot first_slot + i): give it its own
        children and go on. Entries of guesses the draft did not propose stay unreferenced in the cache
        (never attended; the next re-root drops them). Returns the node ids appended."""
        tree, topk = self.tree, self.shape.topk
        added = []
        for i in range(guess.numel()):
            hit = (tree.tokens[children] == guess[i]).nonzero()
            if hit.numel() == 0:
                break
            node = children[int(hit[0])]
            self._grow_slots()
            self._slots.put(node, first_slot + i)
            top = self._top(logp[i], topk)
            children = tree.append(top.indices, node.expand(topk), tree.log_scores[node] + top.values.float())
            added.append(children)
        self._grow_slots()
        return torch.cat(added) if added else torch.empty(0, dtype=torch.long)

    def _grow_slots(self) -> None:
        self._slots.grow(len(self.tree))

    def _tree_rows(self, nodes: torch.Tensor, past: int, chain: int = 0) -> torch.Tensor:
        # nodes: [k] -> allowed [k + chain, past + k + chain]: committed context, each node's expanded
        # ancestors, itself; then `chain` rows continuing nodes[0]'s path (what nodes[0] sees, plus
        # nodes[0] and the chain rows up to their own)
        tree, k = self.tree, nodes.numel()
        allowed = torch.zeros(k + chain, past + k + chain, dtype=torch.bool)
        allowed[:, : self.committed] = True
        rows = torch.arange(k)
        cur, climbing = nodes.clone(), torch.ones(k, dtype=torch.bool)
        for _ in range(int(tree.depths[nodes].max())):
            climbing &= cur != ROOT                              # the root is committed context
            cur = torch.where(climbing, tree.parents[cur], cur)
            ok = climbing & self._slots.ran[cur]
            allowed[rows[ok], self._slots.slot[cur[ok]]] = True
        allowed[rows, past + rows] = True
        if chain:
            allowed[k:, : past + 1] = allowed[0, : past + 1]
            allowed[k:, past + k:] = torch.ones(chain, chain, dtype=torch.bool).tril()
        return allowed

    def _top(self, logp: torch.Tensor, k: int):
        """The k best proposals of each row of `logp` [..., V]: (values, token ids)."""
        return logp.topk(k, dim=-1)

    def observe(self, start: int, hidden: torch.Tensor) -> None:
        """The base model's final hidden states [n, H] at context positions start.. (a draft model needs
        none: engine/head_drafter.py's head does)."""

    def _run(self, tokens: torch.Tensor, positions: torch.Tensor, allowed: torch.Tensor) -> torch.Tensor:
        """One draft forward; returns log-probs [n, V] and records (tokens, context, seconds)."""
        if self.batcher is not None:
            logp, charge = self.batcher.forward(self.cache, tokens, positions, allowed)
            self.forwards += 1
            if charge is not None:
                self._calls.append(charge)
            return logp
        t0 = time.perf_counter()
        past = self.cache.length
        h = self.model.embed(tokens)
        h = self.model.forward_layers(h, positions, bool_to_float_mask(allowed, h.dtype), self.cache)
        logp = torch.log_softmax(self.model.logits(h), dim=-1)
        self.forwards += 1
        self._calls.append((int(tokens.numel()), past, time.perf_counter() - t0))
        return logp

    def pending_seconds(self) -> float:
        """Wall time of the draft forwards not yet drained."""
        return sum(seconds for _, _, seconds in self._calls)

    def drain_calls(self) -> list[tuple[int, int, float]]:
        """Draft forwards since the last call, as (tokens, context, seconds): the simulator charges them."""
        calls, self._calls = self._calls, []
        return calls

    def _sync(self, context: list[int]) -> int:
        """Crop the cache to the longest committed prefix still valid for `context`; the root (last
        token) is always re-run so its logits are fresh. Returns the kept length."""
        keep = 0
        limit = min(self.committed, len(context) - 1)
        if self.context[:limit] == context[:limit]:
            keep = limit
        else:
            while keep < limit and self.context[keep] == context[keep]:
                keep += 1
        self.cache.truncate(keep)
        self.committed = keep
        self.context = list(context)
        return keep
