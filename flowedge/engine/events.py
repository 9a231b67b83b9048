"""Events into and actions out of the sans-IO head and stage state machines.

Drivers (the simulated cluster, the ZeroMQ daemon) own clocks and sockets; the state machines only see
these values. Node indices: 0 is the head (draft model, embedding, lm_head); 1..N are the stages.
"""
from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING

import torch

from flowedge.core.prune import PruneSet
from flowedge.core.sampling import SamplingParams

if TYPE_CHECKING:
    from flowedge.engine.draft_sync import DraftSnapshot
    from flowedge.engine.predraft import PreDraftJob


@dataclass(frozen=True, slots=True)
class Segment:
    """A run of rows travelling head -> stage 1 -> ... -> stage N -> head: draft-tree nodes, or a chunk
    of the prompt (`phase == "prefill"`).

    `hidden` is the input of the next hop ([rows, H]); positions are absolute; `prune_version` is the
    newest prune the sender had issued/applied when it was built, so a stage never runs it against an
    older tree. Tree segments name their nodes (`node_ids`, stable within a round) and each node's
    parent: `roots[i]` is True when node i hangs off the committed context, else its parent is node
    `parent_ids[i]` (read only where `roots` is False; senders put 0 there). A prompt chunk's rows are
    committed context themselves: its node_ids, parent_ids and roots are empty.

    When the last stage holds the lm_head (`lm_head_at = "last-stage"`) it returns no hidden states
    (`hidden` is None, `chosen()`) but `tokens`: the base model's choice at every node, or for a prompt
    chunk the one choice after its last row, drawn with the request's sampling params (prefill chunks
    carry them in `sampling`). No choice at all (a shape-only stage in the simulator): `tokens` is None
    too, and the head reads the base logits itself. `run_id`: the engine run's id (a replay starts a new run)."""
    run_id: int
    round_id: int
    seq: int
    prune_version: int
    node_ids: torch.Tensor      # [n] int64 (prefill: [0])
    parent_ids: torch.Tensor    # [n] int64, where not a root
    positions: torch.Tensor     # [rows] int64
    hidden: torch.Tensor | None   # [rows, H]; None: the last stage chose tokens instead
    phase: str = "draft"        # "prefill" | "init-segment" | "expansion" | "ar" | "level"
    tokens: torch.Tensor | None = None          # [n] int64 base-model choices ([1] on prefill), last stage only
    sampling: SamplingParams | None = None      # on prefill chunks: how the last stage chooses tokens
    roots: torch.Tensor | None = None           # [n] bool: parent is the committed context (None: no roots)

    @classmethod
    def prefill(cls, run_id: int, seq: int, positions: torch.Tensor, hidden: torch.Tensor,
                sampling: SamplingParams | None = None) -> "Segment":
        """A chunk of the prompt: rows of committed context, no tree ids."""
        none = torch.empty(0, dtype=torch.long)
        return cls(run_id, 0, seq, 0, none, none, positions, hidden, "prefill", None, sampling)

    def __len__(self) -> int:
        return int(self.positions.numel())

    def root_mask(self) -> torch.Tensor:
        """[n] bool: the nodes whose parent is the committed context."""
        return self.roots if self.roots is not None else torch.zeros(self.node_ids.numel(), dtype=torch.bool)

    def chosen(self, tokens: torch.Tensor | None) -> "Segment":
        """The same rows going back to the head as the last stage's token choices, without hidden states."""
        return replace(self, hidden=None, tokens=tokens)

    def select(self, keep: torch.Tensor, hidden: torch.Tensor | None = None,
               tokens: torch.Tensor | None = None) -> "Segment":
        """Same segment restricted to rows `keep` (bool mask), optionally with new hidden states or
        chosen tokens."""
        h = hidden if hidden is not None else None if self.hidden is None else self.hidden[keep]
        if tokens is None and self.tokens is not None:
            tokens = self.tokens[keep]
        if self.phase == "prefill":   # no tree ids to restrict
            return Segment(self.run_id, self.round_id, self.seq, self.prune_version, self.node_ids,
                           self.parent_ids, self.positions[keep], h, self.phase, tokens, self.sampling)
        return Segment(self.run_id, self.round_id, self.seq, self.prune_version, self.node_ids[keep],
                       self.parent_ids[keep], self.positions[keep], h, self.phase, tokens, self.sampling,
                       None if self.roots is None else self.roots[keep])


@dataclass(frozen=True, slots=True)
class Prune:
    """Broadcast by the head after every verification that changes the tree."""
    run_id: int
    round_id: int
    version: int
    prune: PruneSet
    end_round: bool            # True: every draft entry dies after the commit; next round starts


@dataclass(frozen=True, slots=True)
class Finish:
    """The run is over: stages drop its KV cache."""
    run_id: int


# ---- actions ------------------------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class Compute:
    """Work the state machine just did: the simulator charges its cost model for it, the daemon logs it."""
    what: str                  # "stage" | "draft" | "lm_head" | "embed" (lm_head also on the last stage)
    tokens: int
    context: int               # cached entries read (a batched stage forward: every request's)
    phase: str = ""
    attended: float | None = None   # entries one row attends over, on average (batched: its own request's only)


@dataclass(frozen=True, slots=True)
class Send:
    to: int                    # node index
    message: Segment | Prune | Finish


@dataclass(frozen=True, slots=True)
class Failed:
    """A stage gave up on one request (an error while running it; its KV cache is freed). Only a worker
    that contains failures (the daemon's) reports these; elsewhere the error propagates."""
    run_id: int
    error: str


@dataclass(frozen=True, slots=True)
class Emit:
    """Tokens newly accepted for the user, in order."""
    tokens: list[int]
    run_id: int | None = None


@dataclass(frozen=True, slots=True)
class Continue:
    """Run `event` on the same node right after the preceding actions went out (lets the head broadcast a
    prune set before it spends time drafting the expansion)."""
    event: object


@dataclass(frozen=True, slots=True)
class WhenIdle:
    """Run `event` on this node when it has nothing else to do (the newest one per request wins): node 0's
    pre-drafting in the gaps while its segments are in flight."""
    event: object


@dataclass(frozen=True, slots=True)
class Offload:
    """Work for the drafter device: grow `snapshot` (engine/draft_sync.DraftSnapshot) on its replica with
    `DrafterDevice.run`, and deliver `PreDrafted(job, growth)` to the request's engine when the answer is
    back (`PreDrafted(job, None)` when there is none). The simulator and the daemon's head both do."""
    job: PreDraftJob
    snapshot: DraftSnapshot
    request_bytes: int = 0     # what node 0 sends (tree + the K/V rows the replica lacks)


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
    predraft: dict = field(default_factory=dict)   # pre-drafting: jobs, lane calls, hits, misses (engine/predraft.py)


@dataclass(frozen=True, slots=True)
class Done:
    token_ids: list[int]
    stats: Stats
    key: int | None = None     # the scheduler's request key (engine/scheduler.py fills it in)
    cancelled: bool = False    # stopped by `scheduler.Cancel`, not by max tokens or a stop token
