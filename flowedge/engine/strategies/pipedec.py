"""`pipedec` (PipeDec / SpecPipe): a layer-wise tree of fixed width, one level fed per pipeline step,
a hit keeps the subtree under the accepted child, a miss restarts from the sampled token."""
from __future__ import annotations

import torch

from flowedge.core.tree import DraftTree
from flowedge.engine.drafter import TreeShape
from flowedge.engine.strategies.base import Strategy


class PipeDec(Strategy):
    name = "pipedec"

    def build_round(self, head) -> DraftTree:
        w = head.config.pipedec_width
        # Root plus its first level; the head's tree is the drafter's tree (same ids).
        return head.drafter.build(head.context(), TreeShape(topk=w, width=w, depth=1, keep_all=False))

    def initial_segments(self, head) -> list:
        actions = head.send_nodes(torch.tensor([0]), "level")
        actions += head.send_nodes(torch.arange(1, len(head.tree)), "level")
        for _ in range(max(0, head.n_stages - 2)):   # fill the pipeline: one level per stage
            actions += self._next_level(head)
        return actions

    def _next_level(self, head) -> list:
        new = head.drafter.extend(1, head.alive)
        head.grow_alive()
        return head.send_nodes(new, "level")

    def on_output(self, head, live_nodes: int) -> list:
        res, cost = head.verify()
        if res is None:
            if head.in_flight == 0:
                return head.restart_round()
            return cost
        actions = cost + head.apply_walk(res, continue_round=True)
        if not head.finished and res.continues and not head.round_ended:
            actions += self._next_level(head)
        return actions
