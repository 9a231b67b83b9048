"""Events into and actions out of the sans-IO head and stage state machines.

Drivers (the simulated cluster, the ZeroMQ daemon) own clocks and sockets; the state machines only see
these values. Node indices: 0 is the head (draft model, embedding, lm_head); 1..N are the stages.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from flowedge.core.prune import PruneSet
from flowedge.core.sampling import SamplingParams


@dataclass(frozen=True, slots=True)
class Segment:
    """A run of draft-tree nodes travelling head -> stage 1 -> ... -> stage N -> head.

    `hidden` is the input of the next hop ([n, H]); ids are stable within a round; positions are
    absolute; `prune_version` is the newest prune the sender had issued/applied when it was built, so
    a stage never runs it against an older tree.

    When the last stage holds the lm_head (`lm_head_at = "last-stage"`) it returns no hidden states
    ([n, 0]) but `tokens`: the base model's choice at every node, drawn with the request's sampling
    params (prefill chunks carry them in `sampling`)."""
    request_id: int
    round_id: int
    seq: int
    prune_version: int
    node_ids: torch.Tensor      # [n] int64
    parent_ids: torch.Tensor    # [n] int64, -1 = parent is committed context
    positions: torch.Tensor     # [n] int64
    hidden: torch.Tensor        # [n, H]
    phase: str = "draft"        # "prefill" | "init-segment" | "expansion" | "ar" | "level"
    tokens: torch.Tensor | None = None          # [n] int64 base-model choices (-1 = none), last stage only
    sampling: SamplingParams | None = None      # on prefill chunks: how the last stage chooses tokens

    def __len__(self) -> int:
        return int(self.node_ids.numel())

    def select(self, keep: torch.Tensor, hidden: torch.Tensor | None = None,
               tokens: torch.Tensor | None = None) -> "Segment":
        """Same segment restricted to rows `keep` (bool mask), optionally with new hidden states or
        chosen tokens."""
        h = self.hidden[keep] if hidden is None else hidden
        if tokens is None and self.tokens is not None:
            tokens = self.tokens[keep]
        return Segment(self.request_id, self.round_id, self.seq, self.prune_version, self.node_ids[keep],
                       self.parent_ids[keep], self.positions[keep], h, self.phase, tokens, self.sampling)


@dataclass(frozen=True, slots=True)
class Prune:
    """Broadcast by the head after every verification that changes the tree."""
    request_id: int
    round_id: int
    version: int
    prune: PruneSet
    end_round: bool            # True: every draft entry dies after the commit; next round starts


@dataclass(frozen=True, slots=True)
class Finish:
    """The request is over: stages drop its KV cache."""
    request_id: int


# ---- actions ------------------------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class Compute:
    """Work the state machine just did: the simulator charges its cost model for it, the daemon logs it."""
    what: str                  # "stage" | "draft" | "lm_head" | "embed" (lm_head also on the last stage)
    tokens: int
    context: int
    phase: str = ""


@dataclass(frozen=True, slots=True)
class Send:
    to: int                    # node index
    message: Segment | Prune | Finish


@dataclass(frozen=True, slots=True)
class Failed:
    """A stage gave up on one request (an error while running it; its KV cache is freed). Only a worker
    that contains failures (the daemon's) reports these; elsewhere the error propagates."""
    request_id: int
    error: str


@dataclass(frozen=True, slots=True)
class Emit:
    """Tokens newly accepted for the user, in order."""
    tokens: list[int]
    request_id: int | None = None


@dataclass(frozen=True, slots=True)
class Continue:
    """Run `event` on the same node right after the preceding actions went out (lets the head broadcast a
    prune set before it spends time drafting the expansion)."""
    event: object


@dataclass
class Stats:
    accept_lens: list[int] = field(default_factory=list)
    rounds: int = 0
    steps: int = 0
    empty_segments: int = 0
    draft_forwards: int = 0
    stage_chosen: int = 0      # node tokens chosen by the last stage (lm_head_at = last-stage)
    overhead_s: list[float] = field(default_factory=list)   # head bookkeeping per step, model calls excluded
    tree_build_s: list[float] = field(default_factory=list)  # per round: building the initial tree, minus draft calls
    auto: dict = field(default_factory=dict)   # strategy `auto`: its choice, the reason, the switches


@dataclass(frozen=True, slots=True)
class Done:
    token_ids: list[int]
    stats: Stats
    request_id: int | None = None
    cancelled: bool = False    # stopped by `scheduler.Cancel`, not by max tokens or a stop token
