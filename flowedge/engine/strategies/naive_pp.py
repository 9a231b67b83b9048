"""`naive-pp` (FlowSpec's baseline): the whole tree in near-equal micro-batches, verified once all
have returned; no pruning in flight, no early exit, no expansion."""
from __future__ import annotations

import math

from flowedge.core.select import split_segments
from flowedge.engine.strategies.base import ScoredTreeStrategy
from flowedge.engine.round_view import RoundView


class NaivePP(ScoredTreeStrategy):
    name = "naive-pp"
    order = "bfs"
    # It verifies the whole tree at once after every micro-batch returned: one batched lm_head call on
    # node 0 reads the weights once, where the last stage would read them once per micro-batch.
    lm_head_at = "head"

    def segment_ranges(self, view: RoundView) -> list[tuple[int, int]]:
        n = len(view.tree)
        return split_segments(n, view.config.l_max, n_segments=math.ceil(n / view.config.l_max))

    def on_output(self, view: RoundView, live_nodes: int) -> list:
        if view.in_flight:
            return []
        res, cost = view.verify()
        if res is None:   # cannot happen: the whole tree is back, the root's output with it
            raise RuntimeError(f"{self.name}: the round's root has no output to verify")
        return cost + view.apply_walk(res, continue_round=False)
