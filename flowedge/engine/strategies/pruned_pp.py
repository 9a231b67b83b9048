"""`pruned-pp`: score-sorted segments, step-wise verification, distributed pruning, early exit."""
from __future__ import annotations

from flowedge.engine.strategies.base import ScoredTreeStrategy
from flowedge.engine.round_view import RoundView


class PrunedPP(ScoredTreeStrategy):
    name = "pruned-pp"
    order = "score"
    expands = False

    def on_output(self, view: RoundView, live_nodes: int) -> list:
        res, cost = view.verify()
        if res is None:
            if view.in_flight == 0:   # nothing left that could extend the walk: start afresh
                return view.restart_round()
            return cost + (view.expand_later(False) if self.expands else [])
        actions = cost + view.apply_walk(res, continue_round=True)
        if self.expands and not view.finished and res.continues and not view.round_ended:
            actions += view.expand_later(True)
        return actions
