"""`pipedec` (PipeDec / SpecPipe): a layer-wise tree of fixed width, one level fed per pipeline step,
a hit keeps the subtree under the accepted child, a miss restarts from the sampled token."""
from __future__ import annotations

import torch

from flowedge.core.tree import DraftTree
from flowedge.engine.drafter import TreeShape
from flowedge.engine.strategies.base import Strategy
from flowedge.engine.round_view import RoundView


class PipeDec(Strategy):
    name = "pipedec"

    def build_round(self, view: RoundView) -> DraftTree:
        w = view.config.pipedec_width
        # Root plus its first level; the head's tree is the drafter's tree (same ids).
        return view.drafter.build(view.context(), TreeShape(topk=w, width=w, depth=1, keep_all=False))

    def initial_segments(self, view: RoundView) -> list:
        actions = view.send_nodes(torch.tensor([0]), "level")
        actions += view.send_nodes(torch.arange(1, len(view.tree)), "level")
        return actions + self._fill(view)

    def _fill(self, view: RoundView) -> list:
        """One more level while the pipeline has room for it (one level per stage). Each level is drafted
        in its own follow-up, so it leaves as soon as its draft call is done: on a deep pipeline the first
        levels are already travelling while the next are drafted, instead of all waiting for the last."""
        return view.expand_later(True) if view.in_flight < view.n_stages else []

    def expand(self, view: RoundView, accepted: bool) -> list:
        new = view.drafter.extend(1, view.alive)
        view.grow_alive()
        sent = view.send_nodes(new, "level")
        return sent + (self._fill(view) if sent else [])

    def on_output(self, view: RoundView, live_nodes: int) -> list:
        res, cost = view.verify()
        if res is None:
            if view.in_flight == 0:
                return view.restart_round()
            return cost
        actions = cost + view.apply_walk(res, continue_round=True)
        if not view.finished and res.continues and not view.round_ended:
            actions += self._fill(view)
        return actions
