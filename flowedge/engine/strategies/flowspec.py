"""`flowspec`: pruned-pp plus tree expansion — context-aware (a fresh tree from the new root merged by
path) after an acceptance, score-aware (the stored base tree grown deeper) after an empty segment.
`flowspec-nosbd` is the same without score-sorted segmentation (BFS order), FlowSpec's ablation."""
from __future__ import annotations

from flowedge.core.merge import merge_by_path, score_aware_pick
from flowedge.core.select import select_top
from flowedge.engine.drafter import TreeShape
from flowedge.engine.strategies.pruned_pp import PrunedPP


class FlowSpec(PrunedPP):
    name = "flowspec"
    order = "score"
    expands = True

    def expand(self, head, accepted: bool) -> list:
        cfg = head.config
        if accepted:
            base = head.drafter.build(head.context(), TreeShape(topk=cfg.topk, depth=cfg.exp_depth))
            new, _ = select_top(base, cfg.exp_nodes, self.order)
        else:
            if cfg.se_nodes == 0 or cfg.se_depth == 0 or head.drafter.base is None:
                return []
            if int(head.drafter.base.tokens[0]) != int(head.tree.tokens[head.cur]):
                return []   # the stored base tree belongs to an older root
            head.drafter.extend(cfg.se_depth)
            new = score_aware_pick(head.drafter.base, head.tree, head.alive, head.cur, cfg.se_nodes)
        appended = merge_by_path(head.tree, head.alive, head.cur, new)
        head.grow_alive()
        return head.send_nodes(appended, "expansion")


class FlowSpecNoSBD(FlowSpec):
    name = "flowspec-nosbd"
    order = "bfs"
