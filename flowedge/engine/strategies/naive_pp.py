"""`naive-pp` (FlowSpec's baseline): the whole tree in near-equal micro-batches, verified once all
have returned; no pruning in flight, no early exit, no expansion."""
from __future__ import annotations

import math

from flowedge.core.select import split_segments
from flowedge.engine.strategies.base import ScoredTreeStrategy


class NaivePP(ScoredTreeStrategy):
    name = "naive-pp"
    order = "bfs"
    # It verifies the whole tree at once after every micro-batch returned: one batched lm_head call on
    # node 0 reads the weights once, where the last stage would read them once per micro-batch.
    lm_head_at = "head"

    def segment_ranges(self, head) -> list[tuple[int, int]]:
        n = len(head.tree)
        return split_segments(n, head.config.l_max, n_segments=math.ceil(n / head.config.l_max))

    def on_output(self, head, live_nodes: int) -> list:
        if head.in_flight:
            return []
        res, cost = head.verify()
        return cost + head.apply_walk(res, continue_round=False)
