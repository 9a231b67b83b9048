"""The strategy seam: what differs between pipeline algorithms, behind one small interface.

Every call gets the round's `RoundView` (engine/round_view.py): the round's state, read only, and the
few actions a strategy may take — never the whole engine head."""
from __future__ import annotations

from abc import ABC, abstractmethod

import torch

from flowedge.core.select import select_top, split_segments
from flowedge.core.tree import DraftTree
from flowedge.engine.drafter import TreeShape
from flowedge.engine.round_view import RoundView


class Strategy(ABC):
    name: str = ""
    needs_draft: bool = True
    # Where the base model's tokens are chosen unless SpecConfig.lm_head_at says otherwise: on the last
    # stage by default (node 0 is busy drafting); naive-pp overrides it (see there).
    lm_head_at: str = "last-stage"

    @property
    def predrafts(self) -> bool:
        """Its expansions take pre-drafted trees (engine/predraft.py): worth planning them. A strategy sets
        it as a class attribute, or (`auto`) answers for the strategy it runs now."""
        return False

    @abstractmethod
    def build_round(self, view: RoundView) -> DraftTree:
        """The tree for a new round, rooted at view.last_output."""

    @abstractmethod
    def initial_segments(self, view: RoundView) -> list:
        """Segments sent when the round starts."""

    @abstractmethod
    def on_output(self, view: RoundView, live_nodes: int) -> list:
        """A segment's final hidden states (or token choices) arrived; `verify` can read them."""

    def expand(self, view: RoundView, accepted: bool) -> list:
        """Follow-up after a prune went out (strategies with expansion override this)."""
        return []


class ScoredTreeStrategy(Strategy):
    """Shared by the EAGLE-2-tree strategies: draft a base tree, keep the top L in some order, cut it."""
    order = "score"
    uses_lookup = False   # spend SpecConfig.lookup_tokens rows of draft calls on prompt-lookup guesses

    def build_round(self, view: RoundView) -> DraftTree:
        cfg = view.config
        base = view.drafter.build(view.context(), TreeShape(topk=cfg.topk, depth=cfg.tree_depth),
                                  cfg.lookup_tokens if self.uses_lookup else 0)
        tree, _ = select_top(base, cfg.tree_nodes, self.order)
        return tree

    def segment_ranges(self, view: RoundView) -> list[tuple[int, int]]:
        return split_segments(len(view.tree), view.config.l_max)

    def initial_segments(self, view: RoundView) -> list:
        actions: list = []
        for a, b in self.segment_ranges(view):
            actions += view.send_nodes(torch.arange(a, b), "init-segment")
        return actions
