"""The strategy seam: what differs between pipeline algorithms, behind one small interface."""
from __future__ import annotations

from abc import ABC, abstractmethod

import torch

from flowedge.core.select import select_top, split_segments
from flowedge.core.tree import DraftTree
from flowedge.engine.drafter import TreeShape


class Strategy(ABC):
    name: str = ""
    needs_draft: bool = True
    # Where the base model's tokens are chosen unless SpecConfig.lm_head_at says otherwise: on the last
    # stage by default (node 0 is busy drafting); naive-pp overrides it (see there).
    lm_head_at: str = "last-stage"

    @abstractmethod
    def build_round(self, head) -> DraftTree:
        """The tree for a new round, rooted at head.outputs[-1]."""

    @abstractmethod
    def initial_segments(self, head) -> list:
        """Segments sent when the round starts."""

    @abstractmethod
    def on_output(self, head, live_nodes: int) -> list:
        """A segment's final hidden states arrived (already stored on the head)."""

    def expand(self, head, accepted: bool) -> list:
        """Follow-up after a prune went out (strategies with expansion override this)."""
        return []


class ScoredTreeStrategy(Strategy):
    """Shared by the EAGLE-2-tree strategies: draft a base tree, keep the top L in some order, cut it."""
    order = "score"
    uses_lookup = False   # spend SpecConfig.lookup_tokens rows of draft calls on prompt-lookup guesses

    def build_round(self, head) -> DraftTree:
        cfg = head.config
        base = head.drafter.build(head.context(), TreeShape(topk=cfg.topk, depth=cfg.tree_depth),
                                  cfg.lookup_tokens if self.uses_lookup else 0)
        tree, _ = select_top(base, cfg.tree_nodes, self.order)
        return tree

    def segment_ranges(self, head) -> list[tuple[int, int]]:
        return split_segments(len(head.tree), head.config.l_max)

    def initial_segments(self, head) -> list:
        actions: list = []
        for a, b in self.segment_ranges(head):
            actions += head.send_nodes(torch.arange(a, b), "init-segment")
        return actions
