"""What a strategy sees of the round it drives: the round's state, read only, and the few actions a
strategy may take. The engine `Head` makes one view per head and passes it to every strategy call
(`engine/strategies/`), so a strategy cannot reach the rest of the head — its hidden-state and logit
caches, prune versions, sampling state, request bookkeeping — and what strategies depend on is listed
here, in one place.

The draft tree itself is shared, not copied: the expansion helpers (`core.merge.merge_by_path`,
`Drafter.extend`) append nodes to it in place, after which the strategy calls `grow_alive()`.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from flowedge.engine.round_state import running
from flowedge.errors import ConfigError

if TYPE_CHECKING:
    from flowedge.core.tree import DraftTree
    from flowedge.core.verify import WalkResult
    from flowedge.core.config import SpecConfig
    from flowedge.engine.drafter import Drafter
    from flowedge.engine.events import Stats
    from flowedge.engine.head import Head
    from flowedge.engine.round_state import Round


class RoundView:
    """One head's round, as its strategy sees it."""

    __slots__ = ("_head",)

    def __init__(self, head: Head) -> None:
        self._head = head

    # ---- the request and the pipeline (read only) ---------------------------------------------------
    @property
    def config(self) -> SpecConfig:
        return self._head.config

    @property
    def drafter(self) -> Drafter:
        """Node 0's draft model; ConfigError on a head that has none (strategies that draft ask for it)."""
        if self._head.drafter is None:
            raise ConfigError("this strategy drafts, and the head has no draft model")
        return self._head.drafter

    @property
    def n_stages(self) -> int:
        return self._head.n_stages

    @property
    def last_output(self) -> int:
        """The newest committed token: the root of a new round."""
        return self._head.outputs[-1]

    @property
    def emitted(self) -> int:
        """Tokens answered so far in this request."""
        return len(self._head.outputs)

    @property
    def tokens_left(self) -> int:
        """Tokens the answer may still have (it may stop sooner)."""
        return self._head.answer.max_new - len(self._head.outputs)

    def context(self) -> list[int]:
        """Prompt + answered tokens (a fresh list)."""
        return self._head.context()

    def clock(self) -> float:
        """Seconds on the driver's clock (the simulator's virtual one under simulation)."""
        return self._head.clock()

    def running_requests(self) -> int:
        """Requests sharing the pipeline now, this one included (1 alone; strategy `auto` weighs it)."""
        return self._head.running_requests()

    @property
    def stats(self) -> Stats:
        """The answer's statistics (strategy `auto` files its choice and switches under `auto`)."""
        return self._head.stats

    # ---- the round (read only) ----------------------------------------------------------------------
    @property
    def _round(self) -> Round:
        """The round running: a strategy is only called within one."""
        return running(self._head.round)

    @property
    def tree(self) -> DraftTree:
        return self._round.tree

    @property
    def alive(self) -> torch.Tensor:
        """[len(tree)] bool: nodes not pruned yet."""
        return self._round.alive

    @property
    def cur(self) -> int:
        """The node the next verification walks from."""
        return self._round.cur

    @property
    def in_flight(self) -> int:
        """Segments of this round sent and not back yet."""
        return self._round.in_flight

    @property
    def finished(self) -> bool:
        return self._head.finished

    @property
    def round_ended(self) -> bool:
        return self._round.ended

    # ---- actions ------------------------------------------------------------------------------------
    def send_nodes(self, ids: torch.Tensor, phase: str) -> list:
        """Embed the alive nodes among `ids` and send them to stage 1 as one segment."""
        return self._head.send_nodes(ids, phase)

    def grow_alive(self) -> None:
        """Nodes were appended to the tree: they start alive."""
        self._head.grow_alive()

    def verify(self) -> tuple[WalkResult | None, list]:
        """Walk from `cur` if its output is known: the walk (None if not) and its lm_head cost."""
        return self._head.verify()

    def apply_walk(self, res: WalkResult, *, continue_round: bool) -> list:
        """Emit the walk's tokens, broadcast its prune set, continue the round or start the next."""
        return self._head.apply_walk(res, continue_round=continue_round)

    def restart_round(self, reason: str | None = None) -> list:
        """End this round now (an end-of-round prune) and start a new one."""
        return self._head.restart_round(reason)

    def predrafted_base(self) -> DraftTree | None:
        """The stored draft tree re-rooted at the committed context when pre-drafting (engine/predraft.py)
        left it enough unsent nodes: expand from it without a draft call. None: draft as usual."""
        return self._head.predrafted_base()

    def expand_later(self, accepted: bool) -> list:
        """Run the strategy's `expand` right after the actions so far went out."""
        return self._head.expand_later(accepted)
