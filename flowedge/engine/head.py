"""The head (node 0): embedding, lm_head, draft model, and the strategy that drives the pipeline.

Sans-IO: `start()` and `receive()` return actions; model calls happen inline and are reported as
`Compute` actions so a simulator can charge virtual time for them. Everything a strategy shares —
rounds, segments, verification, prune broadcasts, token emission — lives here; what differs between
strategies (tree shape, when to verify, how to expand) lives in `flowedge/engine/strategies/`, which
see the head only through its `RoundView` (engine/round_view.py).
"""
from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from flowedge.core.config import SpecConfig
from flowedge.core.prune import PruneSet, apply_alive, prune_after_walk
from flowedge.core.sampling import SamplingParams, choose_token, make_generator
from flowedge.core.tree import DraftTree
from flowedge.core.verify import WalkResult, walk_chosen
from flowedge.engine.drafter import Drafter
from flowedge.engine.events import (Compute, Continue, Done, Emit, Finish, Prune, Segment, Send, Stats)
from flowedge.engine.round_view import RoundView
from flowedge.models.stage import StageModel

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class Expand:
    """Internal follow-up event: run the strategy's expansion after the prune set went out."""
    round_id: int
    accepted: bool


class Head:
    def __init__(self, model: StageModel, drafter: Drafter | None, strategy, n_stages: int,
                 config: SpecConfig, stop_ids: set[int], oracle=None, lm_head_at: str = "head") -> None:
        self.model, self.drafter, self.strategy = model, drafter, strategy
        self.oracle = oracle   # sim.oracle.PathOracle: logits from the node's path, not its hidden state
        if lm_head_at not in ("head", "last-stage"):
            raise ValueError(f"lm_head_at must be 'head' or 'last-stage', got {lm_head_at!r}")
        self.lm_head_at = lm_head_at   # "last-stage": the last stage returns chosen tokens (stage_worker)
        self.n_stages, self.config, self.stop_ids = n_stages, config, stop_ids
        self.request_id = 0
        self.clock = time.monotonic   # seconds; the simulator sets its virtual clock (strategy `auto` reads it)
        # requests sharing the pipeline now, this one included: set by MultiHead or the daemon's RequestBook
        self.running_requests: Callable[[], int] = lambda: 1
        self.view = RoundView(self)   # all a strategy sees of this head

    # ---- request lifecycle ------------------------------------------------------------------------
    def start(self, request_id: int, prompt_ids: list[int], max_new_tokens: int,
              params: SamplingParams) -> list:
        self.request_id, self.prompt = request_id, list(prompt_ids)
        self.max_new, self.params, self.gen = max_new_tokens, params, make_generator(params)
        self.outputs: list[int] = []
        self.stats = Stats()
        self.version = self.round_id = self.seq = 0
        self.prefix_len = 0
        self.finished = False
        self._model_s = self._build_s = 0.0
        self.prefix_at_version: dict[int, int] = {}   # committed context length after each prune
        self.tree: DraftTree | None = None
        if self.drafter is not None:
            self.drafter.reset()
        actions: list = []
        chunk = self.config.prefill_chunk
        for a in range(0, len(prompt_ids), chunk):
            ids = torch.tensor(prompt_ids[a:a + chunk])
            n = ids.numel()
            seg = Segment.prefill(request_id, self._next_seq(), torch.arange(a, a + n), self.model.embed(ids),
                                  params if self.lm_head_at == "last-stage" else None)
            actions.append(Send(1, seg))
        self.prefill_left = len(actions)
        return actions

    def receive(self, event) -> list:
        if self.finished:
            return []
        if isinstance(event, Expand):
            if event.round_id != self.round_id:
                return []
            return self._timed(lambda: self._with_draft_costs(self.strategy.expand(self.view, event.accepted)))
        if not isinstance(event, Segment) or event.request_id != self.request_id:
            return []
        if event.phase == "prefill":
            return self._prefill_done(event)
        if event.round_id != self.round_id:
            return []   # output of a round that already ended
        self.in_flight -= 1
        live = self.alive[event.node_ids]
        for node, h in zip(event.node_ids[live].tolist(), event.hidden[live]):
            self.hidden_of[node] = h   # [0]-wide when the last stage chose tokens: marks arrival
        if event.tokens is not None:
            chosen = dict(zip(event.node_ids[live].tolist(), event.tokens[live].tolist()))
            self.token_of.update(chosen)
            self.stats.stage_chosen += len(chosen)
        self.stats.steps += 1
        if not bool(live.any()):
            self.stats.empty_segments += 1
        return self._timed(lambda: self._with_draft_costs(self.strategy.on_output(self.view, int(live.sum()))))

    def _timed(self, handler) -> list:
        """Run a handler and record its bookkeeping time: wall time minus model calls and minus building
        a round's initial tree (reported apart, in `tree_build_s`)."""
        self._model_s = self._build_s = 0.0
        t0 = time.perf_counter()
        actions = handler()
        self.stats.overhead_s.append(max(0.0, time.perf_counter() - t0 - self._model_s - self._build_s))
        return actions

    def _prefill_done(self, seg: Segment) -> list:
        self.prefill_left -= 1
        self.prefix_len += len(seg)
        if self.prefill_left:
            return []
        if seg.tokens is not None:   # the last stage chose the token after the prompt
            y = int(seg.tokens[-1])
            self.stats.stage_chosen += 1
        else:
            logits = self.oracle.logits(self.prompt) if self.oracle is not None \
                else self.model.logits(seg.hidden[-1:])[0]
            y = choose_token(logits, self.params, self.gen)
        actions: list = [Compute("lm_head", 1, 0, "prefill")] if self.lm_head_at == "head" else []
        return actions + self._accept_tokens([y]) + ([] if self.finished else self._new_round())

    # ---- rounds and segments ----------------------------------------------------------------------
    def _new_round(self) -> list:
        """Start a round rooted at the last output token (already emitted, not yet in the base KV)."""
        self.stats.rounds += 1
        self.round_base = self.prefix_len
        self.hidden_of: dict[int, torch.Tensor] = {}
        self.logits_of: dict[int, torch.Tensor] = {}
        self.token_of: dict[int, int] = {}   # base-model choices sent back by the last stage
        self.cur = 0
        self.in_flight = 0
        self.round_ended = False
        drafted_before, t0 = self._drafted_s(), time.perf_counter()
        self.tree = self.strategy.build_round(self.view)
        # Its draft calls are model time (subtracted via _with_draft_costs), the rest is tree building.
        build = time.perf_counter() - t0 - (self._drafted_s() - drafted_before)
        self._build_s += build
        self.stats.tree_build_s.append(build)
        self.alive = torch.ones(len(self.tree), dtype=torch.bool)
        return self._with_draft_costs(self.strategy.initial_segments(self.view))

    def grow_alive(self) -> None:
        """New nodes were appended to the tree: they start alive."""
        extra = len(self.tree) - self.alive.numel()
        if extra > 0:
            self.alive = torch.cat([self.alive, torch.ones(extra, dtype=torch.bool)])

    def send_nodes(self, ids: torch.Tensor, phase: str) -> list:
        """Embed alive nodes `ids` and send them to stage 1 as one segment."""
        ids = ids[self.alive[ids]]
        if ids.numel() == 0:
            return []
        tree = self.tree
        t0 = time.perf_counter()
        hidden = self.model.embed(tree.tokens[ids])
        self._model_s += time.perf_counter() - t0
        parents = tree.parents[ids]
        roots = parents < 0   # the round's root hangs off the committed context
        seg = Segment(self.request_id, self.round_id, self._next_seq(), self.version, ids,
                      parents.masked_fill(roots, 0), self.round_base + tree.depths[ids], hidden, phase,
                      roots=roots)
        self.in_flight += 1
        return [Send(1, seg)]

    def _next_seq(self) -> int:
        self.seq += 1
        return self.seq

    # ---- verification -----------------------------------------------------------------------------
    def _logits(self, node: int) -> torch.Tensor | None:
        if node in self.logits_of:
            return self.logits_of[node]
        h = self.hidden_of.get(node)
        if h is None:
            return None
        t0 = time.perf_counter()
        if self.oracle is not None:   # the round's root sits at position round_base
            path = self.context()[: self.round_base] + self.tree.path_tokens(node)
            self.logits_of[node] = self.oracle.logits(path)
        else:
            self.logits_of[node] = self.model.logits(h.unsqueeze(0))[0]
        self._model_s += time.perf_counter() - t0
        self._lm_tokens += 1
        return self.logits_of[node]

    def _chosen(self, node: int) -> int | None:
        """The base model's token at `node`: sent by the last stage, else drawn here from its logits
        (lazily, one draw per visited node); None while the node's output has not arrived."""
        token = self.token_of.get(node)
        if token is not None:
            return token
        logits = self._logits(node)
        return None if logits is None else choose_token(logits, self.params, self.gen)

    def verify(self) -> tuple[WalkResult | None, list]:
        """Walk from the current node if its output is known; returns the walk and the lm_head cost
        (none on node 0 when the last stage holds the lm_head)."""
        self._lm_tokens = 0
        if self.cur not in self.hidden_of:
            return None, []
        res = walk_chosen(self.tree, self.cur, self._chosen, self.alive)
        cost = [Compute("lm_head", self._lm_tokens, 0, "verify")] if self.lm_head_at == "head" else []
        return res, cost

    def apply_walk(self, res: WalkResult, *, continue_round: bool) -> list:
        """Emit the walk's tokens, broadcast the prune set, and either continue or end the round."""
        self.stats.accept_lens.append(len(res.tokens))
        actions = self._accept_tokens(res.tokens)
        prune = prune_after_walk(self.tree, self.alive, res)
        end = self.finished or not (continue_round and res.continues)
        self.prefix_len += len(res.committed)
        actions += self._broadcast_prune(prune, end)
        self.round_ended = end
        if self.finished:
            return actions
        if end:
            return actions + self._new_round()
        self.alive = apply_alive(self.alive, prune)
        for node in [n for n in self.hidden_of if not self.alive[n]]:
            self.hidden_of.pop(node)
            self.logits_of.pop(node, None)
            self.token_of.pop(node, None)
        self.cur = res.next_node
        return actions

    def _broadcast_prune(self, prune: PruneSet, end_round: bool) -> list:
        self.version += 1
        self.prefix_at_version[self.version] = self.prefix_len
        msg = Prune(self.request_id, self.round_id, self.version, prune, end_round)
        if end_round:
            self.round_id += 1
        return [Send(i, msg) for i in range(1, self.n_stages + 1)]

    def restart_round(self, reason: str | None = None) -> list:
        """Drop the round and start afresh: nothing in flight can extend the walk (should not happen), or
        a strategy chose to (`reason`)."""
        if reason is None:
            log.warning("round %d stalled with nothing in flight; restarting it", self.round_id)
        else:
            log.info("round %d ended early: %s", self.round_id, reason)
        empty = torch.zeros(0, dtype=torch.long)
        actions = self._broadcast_prune(PruneSet(empty, empty, len(self.tree)), True)
        self.round_ended = True
        return actions + self._new_round()

    def _accept_tokens(self, tokens: list[int]) -> list:
        room = self.max_new - len(self.outputs)
        new = tokens[:room]
        for i, t in enumerate(new):
            if t in self.stop_ids:
                new = new[: i + 1]
                break
        self.outputs += new
        actions: list = [Emit(new, self.request_id)] if new else []
        if len(self.outputs) >= self.max_new or (new and new[-1] in self.stop_ids):
            self.finished = True
            actions += [Send(i, Finish(self.request_id)) for i in range(1, self.n_stages + 1)]
            actions.append(Done(list(self.outputs), self.stats, self.request_id))
        return actions

    def context(self) -> list[int]:
        return self.prompt + self.outputs

    def _drafted_s(self) -> float:
        return self.drafter.pending_seconds() if self.drafter is not None else 0.0

    def _with_draft_costs(self, actions: list) -> list:
        """Put the draft-model work done while producing `actions` before the first segment it fed."""
        costs: list = []
        if self.drafter is not None:
            for tokens, context, seconds in self.drafter.drain_calls():
                costs.append(Compute("draft", tokens, context, "draft"))
                self._model_s += seconds
            self.stats.draft_forwards = self.drafter.forwards
        first_send = next((i for i, a in enumerate(actions) if isinstance(a, Send) and isinstance(a.message, Segment)), len(actions))
        return actions[:first_send] + costs + actions[first_send:] if costs else actions

    def expand_later(self, accepted: bool) -> list:
        return [Continue(Expand(self.round_id, accepted))]
