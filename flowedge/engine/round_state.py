"""What one request's run on the head holds (`Answer`), what one round of it holds (`Round`), and where a
handler's time went (`StepTimes`): plain state, changed only by `engine.head.Head`."""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from flowedge.core.sampling import SamplingParams
from flowedge.core.tree import ROOT, DraftTree
from flowedge.engine.events import Stats


@dataclass
class Answer:
    """One request's run on this head (`start` makes a fresh one)."""
    run_id: int = 0                  # the engine run's id on the wire (a replay is a new run)
    prompt: list[int] = field(default_factory=list)
    max_new: int = 0
    params: SamplingParams = field(default_factory=SamplingParams)
    gen: torch.Generator | None = None
    outputs: list[int] = field(default_factory=list)
    stats: Stats = field(default_factory=Stats)
    version: int = 0                 # prune sets broadcast so far
    round_id: int = 0
    seq: int = 0                     # segments sent so far
    prefix_len: int = 0              # committed context the stages hold
    prefix_at_version: dict[int, int] = field(default_factory=dict)   # prefix_len after each prune
    prefill_left: int = 0            # prompt chunks not back yet
    finished: bool = False


@dataclass
class Round:
    """One round's state (`_new_round` makes a fresh one)."""
    base: int                        # context length the round's root sits at
    tree: DraftTree
    alive: torch.Tensor              # [len(tree)] bool: nodes not pruned yet
    # nodes whose output came back: their final hidden state, or None where the last stage chose the token
    arrived: dict[int, torch.Tensor | None] = field(default_factory=dict)
    logits_of: dict[int, torch.Tensor] = field(default_factory=dict)
    token_of: dict[int, int] = field(default_factory=dict)   # base-model choices sent back by the last stage
    cur: int = ROOT                  # the node the next verification walks from
    in_flight: int = 0               # segments sent and not back yet
    rows_sent: int = 0               # tree rows sent this round: each stage's KV holds at most base + these
    ended: bool = False


def running(r: Round | None) -> Round:
    """The round in progress; segments, walks, prunes and strategy calls only come within one."""
    if r is None:
        raise RuntimeError("no round is running")
    return r


@dataclass
class StepTimes:
    """Where a handler's time went: model calls and initial-tree building (reported apart), lm_head rows."""
    model_s: float = 0.0
    build_s: float = 0.0
    lm_tokens: int = 0
