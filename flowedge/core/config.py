"""Speculation settings, one frozen dataclass; defaults follow FlowSpec's appendix A.1."""
from __future__ import annotations

from dataclasses import dataclass, replace

from flowedge.errors import ConfigError


LM_HEAD_PLACES = ("auto", "head", "last-stage")
PREDRAFT_MODES = ("off", "idle", "drafter")   # where pre-drafting runs (engine/predraft.py)
COMPUTE_BOUND_RATIO = 2.0   # see SpecConfig.lm_head_for
# the cluster strategies' names, here (no torch) so a config is checked before anything loads;
# engine/strategies/__init__.py's STRATEGIES must have exactly these (tested)
STRATEGY_NAMES = ("auto", "flowspec", "flowspec-nosbd", "pipespec", "pipedec", "pruned-pp", "naive-pp", "ar-pp")
DRAFT_QUANTS = ("auto", "int4", "nf4", "none")   # node 0's draft model: engine/drafter.load_draft_model
# every phase a strategy may give a segment (engine.events.Segment.phase); the wire accepts exactly
# these, so a strategy with a new phase is refused by its own engine, in the simulator too, not by a stage
SEGMENT_PHASES = ("prefill", "draft", "init-segment", "expansion", "ar", "level", "chain")
MAX_SEGMENT_NODES = 4096    # most rows one segment may carry: stages drop larger ones (transport/validate.py)


@dataclass(frozen=True, slots=True)
class SpecConfig:
    tree_nodes: int = 80        # L: nodes kept in the initial tree (root included)
    tree_depth: int = 6         # d0
    topk: int = 10              # children per expanded node, nodes expanded per level
    l_max: int = 16             # most nodes per segment
    exp_nodes: int = 64         # context-aware expansion tree size (sent as one segment)
    exp_depth: int = 6          # depth of a fresh expansion tree (when the stored one cannot be re-rooted)
    exp_forwards: int = 1       # draft calls per expansion when re-rooting the stored base tree
    exp_fresh: bool = False     # an expansion sends the best exp_nodes nodes not yet sent (deep pipelines)
    se_depth: int = 1           # score-aware expansion: levels added to the stored base tree
    se_nodes: int = 16          # ... and nodes taken from it
    draft_width: int = 0        # nodes run per best-first draft call in an expansion; 0 = topk
    lookup_tokens: int = 4      # of those, rows that run a prompt-lookup guess ahead (core/lookup.py); 0 = off
    pipedec_width: int = 16     # PipeDec: nodes per tree level
    prefill_chunk: int = 256    # chunked prefill
    lm_head_at: str = "auto"    # head | last-stage | auto (the strategy's choice): where tokens are chosen
    predraft: str = "off"       # off | idle (node 0's gaps) | drafter (a drafter device): engine/predraft.py
    predraft_calls: int = 2     # best-first draft calls per pre-draft job

    def __post_init__(self) -> None:
        for name in ("tree_nodes", "tree_depth", "topk", "l_max", "exp_nodes", "exp_depth",
                     "exp_forwards", "pipedec_width", "prefill_chunk"):
            if getattr(self, name) < 1:
                raise ConfigError(f"{name.replace('_', '-')} must be >= 1 (got {getattr(self, name)})")
        for name in ("tree_nodes", "l_max", "exp_nodes", "pipedec_width", "prefill_chunk"):
            if getattr(self, name) > MAX_SEGMENT_NODES:
                raise ConfigError(f"{name.replace('_', '-')} must be <= {MAX_SEGMENT_NODES}, the most nodes a "
                                  f"segment may carry (got {getattr(self, name)})")
        if self.predraft not in PREDRAFT_MODES:
            raise ConfigError(f"predraft must be one of {', '.join(PREDRAFT_MODES)} (got {self.predraft!r})")
        if self.predraft_calls < 1:
            raise ConfigError("predraft-calls must be >= 1")
        if self.lm_head_at not in LM_HEAD_PLACES:
            raise ConfigError(f"lm-head-at must be one of {', '.join(LM_HEAD_PLACES)} (got {self.lm_head_at!r})")
        if self.se_depth < 0 or self.se_nodes < 0 or self.draft_width < 0 or self.lookup_tokens < 0:
            raise ConfigError("score-aware expansion sizes, draft-width and lookup-tokens must be >= 0")

    @property
    def expansion_width(self) -> int:
        return self.draft_width or self.topk

    def lm_head_for(self, strategy, segment_cost_ratio: float | None = None) -> str:
        """Where `strategy` chooses tokens: the configured place, or for "auto" the strategy's own,
        unless the last stage's device makes an lm_head over a whole segment cost `COMPUTE_BOUND_RATIO`
        times a 1-token one or more (`segment_cost_ratio`, from its profile: CPUs). There node 0's lazy
        lm_head over the visited nodes only is cheaper (measured over ZeroMQ on a 2-core x86: flowspec
        1.16 tok/s with the lm_head on node 0, 1.05 on the last stage)."""
        if self.lm_head_at != "auto":
            return self.lm_head_at
        if segment_cost_ratio is not None and segment_cost_ratio >= COMPUTE_BOUND_RATIO:
            return "head"
        return strategy.lm_head_at

    def with_(self, **changes) -> "SpecConfig":
        return replace(self, **{k: v for k, v in changes.items() if v is not None})
