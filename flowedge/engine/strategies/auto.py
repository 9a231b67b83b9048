"""`auto` (the default): flowspec, pipedec or ar-pp, chosen from the device profiles and switched online.

The choice is made per round: a round is one strategy's from start to end, so switching is lossless by
construction (every round starts from the committed context, whichever strategy ran the last one). A
flowspec round that measures slower than ar-pp is ended early (`Head.restart_round`: an end-of-round
prune drops its tokens from every stage) and ar-pp takes over; `engine/auto_policy.py` decides when,
and when to try flowspec again. The choice, the reason and every switch land in the answer's stats
(`Stats.auto`).
"""
from __future__ import annotations

from flowedge.core.tree import DraftTree
from flowedge.engine.auto_policy import AR_PP, FLOWSPEC, PIPEDEC, AutoPolicy, Chooser, Prediction
from flowedge.engine.events import Stats
from flowedge.engine.round_view import RoundView
from flowedge.engine.strategies.ar_pp import ArPP
from flowedge.engine.strategies.base import Strategy
from flowedge.engine.strategies.flowspec import FlowSpec
from flowedge.engine.strategies.pipedec import PipeDec


class Auto(Strategy):
    name = "auto"
    sizes_from_costs = True   # flowspec's rounds use the profile-sized tree, like flowspec itself
    lm_head_at = "last-stage"

    def __init__(self, prediction: Prediction | None = None, policy: AutoPolicy = AutoPolicy()) -> None:
        self.prediction, self.policy = prediction, policy
        self.inner: dict[str, Strategy] = {FLOWSPEC: FlowSpec(), PIPEDEC: PipeDec(), AR_PP: ArPP()}
        if any(s.lm_head_at != self.lm_head_at for s in self.inner.values()):
            raise AssertionError("auto's strategies must choose tokens in the same place")
        self.active: Strategy = self.inner[FLOWSPEC]
        self.chooser: Chooser | None = None
        self._stats: Stats | None = None   # the request being measured (Head.start makes a new Stats per request)
        self._last = (0.0, 0)

    @property
    def predrafts(self) -> bool:   # only while a strategy that takes pre-drafts runs
        return self.active.predrafts

    # ---- measurement ------------------------------------------------------------------------------
    def _tick(self, view: RoundView) -> Chooser:
        """Charge the tokens and time since the last tick to the strategy that ran them: the answer's chooser."""
        now, emitted = view.clock(), view.emitted
        if self.chooser is None or self._stats is not view.stats:
            self._stats = view.stats   # a new answer: fresh measurements (prompts differ)
            self.chooser = Chooser(self.prediction, self.policy, load=view.running_requests)
            view.stats.auto = self.chooser.report()
        else:
            self.chooser.observe(emitted - self._last[1], now - self._last[0])
        self._last = (now, emitted)
        return self.chooser

    # ---- the strategy interface -------------------------------------------------------------------
    def build_round(self, view: RoundView) -> DraftTree:
        chooser = self._tick(view)
        self.active = self.inner[chooser.decide(view.tokens_left)]
        view.stats.auto = chooser.report()
        return self.active.build_round(view)

    def initial_segments(self, view: RoundView) -> list:
        return self.active.initial_segments(view)

    def on_output(self, view: RoundView, live_nodes: int) -> list:
        actions = self.active.on_output(view, live_nodes)
        chooser = self._tick(view)
        speculating = not (view.finished or view.round_ended or self.active is self.inner[AR_PP])
        if speculating and chooser.decide(view.tokens_left) != self.active.name:
            actions += view.restart_round(reason=chooser.reason)   # measured slower than ar-pp: end it now
        view.stats.auto = chooser.report()   # the answer's stats count every token, the last ones included
        return actions

    def expand(self, view: RoundView, accepted: bool) -> list:
        return self.active.expand(view, accepted)
