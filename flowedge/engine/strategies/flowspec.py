"""`flowspec`: pruned-pp plus tree expansion — context-aware (a fresh tree from the new root merged by
path) after an acceptance, score-aware (the stored base tree grown deeper) after an empty segment.
`flowspec-nosbd` is the same without score-sorted segmentation (BFS order), FlowSpec's ablation."""
from __future__ import annotations

from flowedge.core.merge import merge_by_path, score_aware_pick
from flowedge.core.select import select_top
from flowedge.engine.drafter import TreeShape
from flowedge.engine.strategies.pruned_pp import PrunedPP
from flowedge.engine.round_view import RoundView


class FlowSpec(PrunedPP):
    name = "flowspec"
    order = "score"
    expands = True
    sizes_from_costs = True   # the simulator may size its initial tree from the profile (costs/sizing.py)
    uses_lookup = True        # flowedge's addition: draft calls carry prompt-lookup guesses (core/lookup.py)
    predrafts = True          # expansions after an acceptance take pre-drafted trees (engine/predraft.py)

    def initial_segments(self, view: RoundView) -> list:
        return super().initial_segments(view) + self._fill(view)

    def _fill(self, view: RoundView) -> list:
        """Keep one segment per stage in flight: while the pipeline has room, node 0 grows the tree
        instead of idling (a shallow initial tree then starts the pipeline sooner)."""
        return view.expand_later(True) if view.in_flight < view.n_stages else []

    def expand(self, view: RoundView, accepted: bool) -> list:
        cfg = view.config
        base = view.predrafted_base()   # grown while the segments were in flight: no draft call if enough
        if base is None:
            base = view.drafter.advance(view.context(), cfg.exp_forwards, cfg.expansion_width, cfg.lookup_tokens)
        if base is None:   # the accepted path left the stored tree: grow a fresh one
            base = view.drafter.build(view.context(), TreeShape(topk=cfg.topk, depth=cfg.exp_depth),
                                      cfg.lookup_tokens)
        if accepted and cfg.exp_fresh:   # segments capped at a stage's flat cost: only nodes not yet sent
            new = score_aware_pick(base, view.tree, view.alive, view.cur, cfg.exp_nodes)
        elif accepted:
            new, _ = select_top(base, cfg.exp_nodes, self.order)
        elif cfg.se_nodes:
            new = score_aware_pick(base, view.tree, view.alive, view.cur, cfg.se_nodes)
        else:
            return []
        appended = merge_by_path(view.tree, view.alive, view.cur, new)
        view.grow_alive()
        sent = view.send_nodes(appended, "expansion")
        return sent + (self._fill(view) if sent else [])


class FlowSpecNoSBD(FlowSpec):
    name = "flowspec-nosbd"
    order = "bfs"
