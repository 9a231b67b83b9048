"""The drafter over an EAGLE-style head (models/draft_head.py): the same trees, calls and Strategy/RoundView
machinery as the draft-model `Drafter`, with the base model's features as the head's second input.

A row of a draft call is either committed context (its position is inside the context) or a tree node.
Context row p reads the base model's own feature at p - 1, which the engine hands over as verified tokens'
final hidden states come back to node 0 (`observe`: the prompt's after prefill, the accepted path's after
each walk). A tree node reads the head's output at its parent: the row its mask lets it see last, before
itself. So a call may hold no chain of new rows (each row needs its parent's output first): prompt-lookup
guesses are off, and after an acceptance the tree is drafted afresh from the new root with the base's true
features (`advance` -> None) instead of re-rooting rows drafted from predicted ones.
"""
from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import NamedTuple

import torch

from flowedge.core.tree import DraftTree
from flowedge.engine.drafter import Drafter, TreeShape
from flowedge.errors import ModelError
from flowedge.models.draft_head import DraftHead, attach_lm_head, lm_head_rows
from flowedge.models.stage import StageModel, bool_to_float_mask

log = logging.getLogger(__name__)


class Top(NamedTuple):
    values: torch.Tensor
    indices: torch.Tensor   # base token ids


class HeadDrafter(Drafter):
    wants_features = True

    def __init__(self, head: DraftHead, base: StageModel) -> None:
        """`base`: node 0's part of the base model (its embedding and final norm); the draft calls run the
        head, over its own KV cache (`_run`)."""
        head.config.check_base(base.config)
        self.head, self.base_model = head, base
        self.features = torch.zeros(0, head.config.hidden_size)   # [positions, H] normalised base features
        self.known = torch.zeros(0, dtype=torch.bool)
        self.outs = torch.zeros(0, head.config.hidden_size)       # the head's output at each cache entry
        super().__init__(base, cache=head.new_cache())

    def reset(self) -> None:
        super().reset()
        self.features = self.features[:0]
        self.known = self.known[:0]

    # ---- the base model's features ---------------------------------------------------------------------
    @torch.inference_mode()
    def observe(self, start: int, hidden: torch.Tensor) -> None:
        n = int(hidden.shape[0])
        if n == 0:
            return
        end, norm = start + n, self.base_model.norm
        if norm is None:
            raise ModelError("the draft head reads the base model's final norm: node 0's part holds none")
        if end > self.features.shape[0]:
            grow = max(end, 2 * self.features.shape[0]) - self.features.shape[0]
            self.features = torch.cat([self.features, self.features.new_zeros(grow, self.features.shape[1])])
            self.known = torch.cat([self.known, self.known.new_zeros(grow)])
        self.features[start:end] = norm(hidden.to(self.features.dtype))
        self.known[start:end] = True

    def _context_features(self, positions: torch.Tensor) -> torch.Tensor:
        # positions [m] of context rows -> [m, H]: the base's feature one position before (zeros at 0)
        before = positions - 1
        has = before >= 0
        need = before[has]
        if need.numel() and (int(need.max()) >= self.known.numel() or not bool(self.known[need].all())):
            raise RuntimeError(f"the draft head needs the base model's features up to position {int(need.max())}")
        feats = self.features.new_zeros(positions.numel(), self.features.shape[1])
        feats[has] = self.features[need]
        return feats

    # ---- what differs from a draft model --------------------------------------------------------------
    def build(self, context: list[int], shape: TreeShape, lookup: int = 0) -> DraftTree:
        return super().build(context, shape, 0)

    def extend_chain(self, lookup: int = 0) -> torch.Tensor:
        return super().extend_chain(0)

    def advance(self, context: list[int], forwards: int, width: int, lookup: int = 0) -> DraftTree | None:
        if len(context) != len(self.context):
            return None   # new committed tokens: draft afresh from their true features (module docstring)
        return super().advance(context, forwards, width, 0)

    def _top(self, logp: torch.Tensor, k: int) -> Top:
        top = logp.topk(min(k, logp.shape[-1]), dim=-1)
        return Top(top.values, self.head.to_base_ids(top.indices))

    @torch.inference_mode()
    def _run(self, tokens: torch.Tensor, positions: torch.Tensor, allowed: torch.Tensor) -> torch.Tensor:
        """One head call: log-probs [n, draft vocabulary] (`_top` maps them to base ids)."""
        t0 = time.perf_counter()
        past, n = self.cache.length, tokens.numel()
        feats = self._row_features(positions, allowed, past)
        out = self.head.forward_cached(self.base_model.embed(tokens), feats, positions,
                                       bool_to_float_mask(allowed), self.cache)
        if past + n > self.outs.shape[0]:
            self.outs = torch.cat([self.outs, self.outs.new_zeros(max(past + n, 2 * self.outs.shape[0]), out.shape[1])])
        self.outs[past:past + n] = out
        logp = torch.log_softmax(self.head.logits(out), dim=-1)
        self.forwards += 1
        self._calls.append((n, past, time.perf_counter() - t0))
        return logp

    def _row_features(self, positions: torch.Tensor, allowed: torch.Tensor, past: int) -> torch.Tensor:
        # [n] positions, allowed [n, past + n] -> [n, H] input features
        n = positions.numel()
        in_context = positions < len(self.context)
        own = past + torch.arange(n)
        cols = torch.arange(past + n)
        before = allowed & (cols[None, :] < own[:, None])
        parent = torch.where(before, cols[None, :], torch.full_like(cols, -1)[None, :]).amax(dim=1)   # [n]
        if bool((~in_context & ((parent < 0) | (parent >= past))).any()):
            raise RuntimeError("a draft-head row's parent must have run in an earlier call")
        # a context row's parent may be a row of this very call (not in `outs` yet): it reads the base's
        # features instead, so only draft rows index `outs`
        feats = self.outs.new_zeros(n, self.outs.shape[1])
        drafted = ~in_context
        if bool(drafted.any()):
            feats[drafted] = self.outs[parent[drafted]]
        if bool(in_context.any()):
            feats[in_context] = self._context_features(positions[in_context])
        return feats


class FeatureFeed:
    """Hands a draft head the base model's final hidden states as they reach node 0: a prompt chunk's with
    its prefill, the committed nodes' after each walk (or, under the simulator's oracle verification, whose
    stages return no real hidden states, the oracle's along the same path)."""

    def __init__(self, drafter: Drafter, oracle=None) -> None:
        self.drafter, self.oracle = drafter, oracle

    def prefill(self, seg, prompt: list[int], done: bool) -> None:
        if self.oracle is None and seg.hidden is not None:
            self.drafter.observe(int(seg.positions[0]), seg.hidden)
        elif self.oracle is not None and done:
            self.drafter.observe(0, self.oracle.hidden_along(prompt))

    def walk(self, rnd, prefix: list[int], start: int, res) -> None:
        """`rnd`: the round (engine/round_state.Round); `prefix`: the context before its root; `start`: the
        position of the walk's first committed node."""
        if self.oracle is not None:
            path = prefix + rnd.tree.path_tokens(res.committed[-1])
            self.drafter.observe(start, self.oracle.hidden_along(path)[start:])
        elif all(rnd.arrived.get(n) is not None for n in res.committed):
            self.drafter.observe(start, torch.stack([rnd.arrived[n] for n in res.committed]))


def load_head_draft(head_file: Path, base_dir: Path) -> DraftHead:
    """A head file with the base checkpoint's lm_head rows for its vocabulary attached (W8A16)."""
    from flowedge.models.draft_head_io import load_head
    from flowedge.models.stage import load_config

    head = load_head(head_file)
    head.config.check_base(load_config(base_dir))
    attach_lm_head(head, lm_head_rows(base_dir, head.vocab_ids))
    log.info("draft head %s: %d-token vocabulary, MLP %d wide", head_file.name, head.config.draft_vocab,
             head.config.intermediate_size)
    return head


def draft_source(spec: str, draft_quant: str = "auto") -> Path:
    """Where a `--draft` spec's draft lives: a head file (`head:NAME` or a path to one,
    models/draft_head_io.py) or a draft model's directory (registry name, directory or GGUF)."""
    from flowedge.models.draft_head_io import is_head_spec, resolve_head
    from flowedge.models.resolve import resolve_model

    return resolve_head(spec) if is_head_spec(spec) else resolve_model(spec, quant=draft_quant)


def load_draft(spec: str | Path, base_dir: Path, draft_quant: str = "auto"):
    """Node 0's draft: a head with `base_dir`'s lm_head rows attached, or a draft model quantized as asked."""
    from flowedge.engine.drafter import load_draft_model
    from flowedge.models.draft_head_io import is_head_spec

    path = draft_source(str(spec), draft_quant)
    if is_head_spec(str(path)):
        return load_head_draft(path, base_dir)
    return load_draft_model(path, draft_quant)


def make_drafter(draft, base: StageModel, batcher=None) -> Drafter:
    """The drafter for node 0's draft: a head over `base`'s features, or a draft model (batched across
    requests through `batcher`; a head's calls are cheap and run alone)."""
    if isinstance(draft, DraftHead):
        return HeadDrafter(draft, base)
    return Drafter(draft, batcher)


def is_head(draft) -> bool:
    return isinstance(draft, DraftHead)
