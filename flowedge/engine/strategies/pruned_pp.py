"""`pruned-pp`: score-sorted segments, step-wise verification, distributed pruning, early exit."""
from __future__ import annotations

from flowedge.engine.strategies.base import ScoredTreeStrategy


class PrunedPP(ScoredTreeStrategy):
    name = "pruned-pp"
    order = "score"
    expands = False

    def on_output(self, head, live_nodes: int) -> list:
        res, cost = head.verify()
        if res is None:
            if head.in_flight == 0:   # nothing left that could extend the walk: start afresh
                return head.restart_round()
            return cost + (head.expand_later(False) if self.expands else [])
        actions = cost + head.apply_walk(res, continue_round=True)
        if self.expands and not head.finished and res.continues and not head.round_ended:
            actions += head.expand_later(True)
        return actions
