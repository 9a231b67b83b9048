"""`pipespec` (PipeSpec, seed 001): hierarchical asynchronous drafting on a chain.

The hierarchy, smallest first: prompt lookup guesses how the text goes on; the 0.5B draft on node 0
checks each guess in the same call that extends its own chain (guessed tokens it agrees with join the
chain at no extra call: `Drafter.extend_chain`); the pipelined base verifies the chain as its pieces
come back. Node 0 keeps drafting while fewer than one piece per stage is in flight, so the base never
waits for a whole tree. A base token that leaves the chain ends the round: the end-of-round prune rolls
back every stage's buffered chain tokens and their KV entries, and the draft restarts from the base's
token (its cache is cropped to the committed context). Each piece is a few tokens, where flowspec sends
16- to 64-node segments: on compute-bound stages (CPUs) that is the difference that pays.
Lossless at T=0 and when sampling: the base's own choice is drawn at every node and a chain token is
kept only when it equals that choice.
"""
from __future__ import annotations

import torch

from flowedge.core.tree import DraftTree
from flowedge.engine.drafter import TreeShape
from flowedge.engine.strategies.base import Strategy
from flowedge.engine.round_view import RoundView

CHAIN = TreeShape(topk=1, depth=1, keep_all=False)


class PipeSpec(Strategy):
    name = "pipespec"

    def build_round(self, view: RoundView) -> DraftTree:
        # The head's tree is the drafter's chain (same ids), grown in place by extend_chain.
        return view.drafter.build(view.context(), CHAIN, view.config.lookup_tokens)

    def initial_segments(self, view: RoundView) -> list:
        return view.send_nodes(torch.arange(len(view.tree)), "chain") + self._fill(view)

    def _fill(self, view: RoundView) -> list:
        return view.expand_later(True) if view.in_flight < view.n_stages else []

    def expand(self, view: RoundView, accepted: bool) -> list:
        new = view.drafter.extend_chain(view.config.lookup_tokens)
        view.grow_alive()
        return view.send_nodes(new, "chain") + self._fill(view)

    def on_output(self, view: RoundView, live_nodes: int) -> list:
        res, cost = view.verify()
        if res is None:
            if view.in_flight == 0:
                return view.restart_round()
            return cost + self._fill(view)
        actions = cost + view.apply_walk(res, continue_round=True)
        if not view.finished and res.continues and not view.round_ended:
            actions += self._fill(view)
        return actions
