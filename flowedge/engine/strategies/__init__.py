"""Strategies by name: one class per pipeline algorithm, one interface (`base.Strategy`)."""
from __future__ import annotations

from flowedge.engine.auto_policy import Prediction
from flowedge.engine.strategies.ar_pp import ArPP
from flowedge.engine.strategies.auto import Auto
from flowedge.engine.strategies.base import Strategy
from flowedge.engine.strategies.flowspec import FlowSpec, FlowSpecNoSBD
from flowedge.engine.strategies.naive_pp import NaivePP
from flowedge.engine.strategies.pipedec import PipeDec
from flowedge.engine.strategies.pipespec import PipeSpec
from flowedge.engine.strategies.pruned_pp import PrunedPP
from flowedge.errors import ConfigError

STRATEGIES: dict[str, type[Strategy]] = {
    cls.name: cls for cls in (ArPP, NaivePP, PrunedPP, FlowSpecNoSBD, FlowSpec, PipeDec, PipeSpec, Auto)
}


def make_strategy(name: str, prediction: Prediction | None = None) -> Strategy:
    """A fresh strategy; `prediction`: where `auto` starts its choice from (given only to `auto`)."""
    try:
        cls = STRATEGIES[name]
    except KeyError:
        raise ConfigError(f"unknown strategy '{name}'; known: {', '.join(STRATEGIES)}, "
                          "or ar / tree for one process") from None
    return Auto(prediction) if cls is Auto else cls()
