"""`ar-pp`: plain autoregressive decoding through the pipeline, one token in flight."""
from __future__ import annotations

import torch

from flowedge.core.tree import DraftTree
from flowedge.engine.strategies.base import Strategy
from flowedge.engine.round_view import RoundView


class ArPP(Strategy):
    name = "ar-pp"
    needs_draft = False

    def build_round(self, view: RoundView) -> DraftTree:
        return DraftTree.root_only(view.last_output)

    def initial_segments(self, view: RoundView) -> list:
        return view.send_nodes(torch.tensor([0]), "ar")

    def on_output(self, view: RoundView, live_nodes: int) -> list:
        res, cost = view.verify()
        if res is None:   # cannot happen: its one node is back, the root's output with it
            raise RuntimeError(f"{self.name}: the round's root has no output to verify")
        return cost + view.apply_walk(res, continue_round=False)
