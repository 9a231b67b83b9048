"""`ar-pp`: plain autoregressive decoding through the pipeline, one token in flight."""
from __future__ import annotations

import torch

from flowedge.core.tree import DraftTree
from flowedge.engine.strategies.base import Strategy


class ArPP(Strategy):
    name = "ar-pp"
    needs_draft = False

    def build_round(self, head) -> DraftTree:
        return DraftTree.root_only(head.outputs[-1])

    def initial_segments(self, head) -> list:
        return head.send_nodes(torch.tensor([0]), "ar")

    def on_output(self, head, live_nodes: int) -> list:
        res, cost = head.verify()
        return cost + head.apply_walk(res, continue_round=False)
