"""The head (node 0): embedding, lm_head, draft model, and the strategy that drives the pipeline.

Sans-IO: `start()` and `receive()` return actions; model calls happen inline and are reported as `Compute` actions
so a simulator can charge virtual time for them. A request's state lives in an `Answer`, a round's in a `Round`
(fresh ones per request and per round). Everything a strategy shares — rounds, segments, verification, prune
broadcasts, token emission — lives here; what differs between strategies (tree shape, when to verify, how to expand)
lives in `flowedge/engine/strategies/`, which see the head only through its `RoundView` (engine/round_view.py).
"""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass

import torch

from flowedge.core.config import SEGMENT_PHASES, SpecConfig
from flowedge.core.prune import PruneSet, apply_alive, prune_after_walk
from flowedge.core.sampling import SamplingParams, choose_token, make_generator
from flowedge.core.tree import ROOT, DraftTree
from flowedge.core.verify import WalkResult, walk_chosen
from flowedge.engine.drafter import Drafter
from flowedge.engine.engine_context import EngineContext
from flowedge.engine.head_drafter import FeatureFeed
from flowedge.engine.events import (Compute, Continue, Done, Emit, Finish, Prune, Segment, Send, Stats)
from flowedge.engine.predraft import PreDrafted, PreDrafting, PreDraftStep
from flowedge.engine.round_state import Answer, Round, StepTimes, running
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
                 config: SpecConfig, stop_ids: set[int], oracle=None, lm_head_at: str = "head",
                 predraft_call_s: float | None = None, context: EngineContext = EngineContext()) -> None:
        self.model, self.drafter, self.strategy = model, drafter, strategy
        # pre-drafting (config.predraft): the tree grown in node 0's gaps or on a drafter device
        self.predraft = PreDrafting(drafter, config, predraft_call_s, context.drafters_present) \
            if drafter is not None and config.predraft != "off" else None
        self.oracle = oracle   # sim.oracle.PathOracle: logits from the node's path, not its hidden state
        # a draft head's input: the base's final hidden states of verified tokens (engine/head_drafter.py)
        self.features = FeatureFeed(drafter, oracle) if drafter is not None and drafter.wants_features else None
        if lm_head_at not in ("head", "last-stage"):
            raise ValueError(f"lm_head_at must be 'head' or 'last-stage', got {lm_head_at!r}")
        self.lm_head_at = lm_head_at   # "last-stage": the last stage returns chosen tokens (stage_worker)
        self.n_stages, self.config, self.stop_ids = n_stages, config, stop_ids
        # a stage's KV cache holds at most this many positions per request (the model's context)
        self.max_positions = int(getattr(model.config, "max_position_embeddings", 1 << 30))
        # the driver's load (engine/engine_context.py) and its time at the current call (None: wall time);
        # strategy `auto` measures its rates on that time (virtual under simulation)
        self.running_requests = context.running_requests
        self.now: float | None = None
        self.view = RoundView(self)   # all a strategy sees of this head
        self.answer = Answer()
        self.round: Round | None = None   # None before the first round of a request
        self.times = StepTimes()

    # ---- what drivers and tests read --------------------------------------------------------------
    @property
    def run_id(self) -> int:
        return self.answer.run_id

    @property
    def outputs(self) -> list[int]:
        return self.answer.outputs

    @property
    def stats(self) -> Stats:
        return self.answer.stats

    @property
    def finished(self) -> bool:
        return self.answer.finished

    @property
    def round_id(self) -> int:
        return self.answer.round_id

    @property
    def prefix_at_version(self) -> dict[int, int]:
        return self.answer.prefix_at_version

    @property
    def alive(self) -> torch.Tensor:
        """The current round's live-node mask (empty before the first round: no node ids yet)."""
        return self.round.alive if self.round is not None else torch.zeros(0, dtype=torch.bool)

    # ---- request lifecycle ------------------------------------------------------------------------
    def clock(self) -> float:
        """Seconds on the driver's time, as passed in with the current call (wall time when none was)."""
        return time.monotonic() if self.now is None else self.now

    def start(self, run_id: int, prompt_ids: list[int], max_new_tokens: int,
              params: SamplingParams, now: float | None = None) -> list:
        self.now = now
        self.answer = Answer(run_id, list(prompt_ids), max_new_tokens, params, make_generator(params))
        self.round = None
        self.times = StepTimes()
        if self.drafter is not None:
            self.drafter.reset()
        if self.predraft is not None:
            self.predraft.reset()
        actions: list = []
        chunk = self.config.prefill_chunk
        for a in range(0, len(prompt_ids), chunk):
            ids = torch.tensor(prompt_ids[a:a + chunk])
            n = ids.numel()
            seg = Segment.prefill(run_id, self._next_seq(), torch.arange(a, a + n), self.model.embed(ids),
                                  params if self.lm_head_at == "last-stage" else None)
            actions.append(Send(1, seg))
        self.answer.prefill_left = len(actions)
        return actions

    def receive(self, event, now: float | None = None) -> list:
        self.now = now
        a = self.answer
        if a.finished:
            return []
        if isinstance(event, Expand):
            if event.round_id != a.round_id:
                return []
            return self._timed(lambda: self._with_draft_costs(self.strategy.expand(self.view, event.accepted)))
        if isinstance(event, (PreDraftStep, PreDrafted)):
            return self._predraft_event(event)
        if not isinstance(event, Segment) or event.run_id != a.run_id:
            return []
        if event.phase == "prefill":
            actions = self._prefill_done(event)
            return actions + self._plan_predraft()
        if event.round_id != a.round_id:   # an ended round's ids must not index this one's tree: not a wire
            return []                       # check (node/run_router.py), segments queued behind a round's end
        r = running(self.round)
        r.in_flight -= 1
        if self.predraft is not None:
            self.predraft.gaps.on_return(event.seq, self.clock())
        live = r.alive[event.node_ids]
        nodes = event.node_ids[live].tolist()
        hidden = [None] * len(nodes) if event.hidden is None else list(event.hidden[live])
        r.arrived.update(zip(nodes, hidden))
        if event.tokens is not None:
            chosen = dict(zip(nodes, event.tokens[live].tolist()))
            r.token_of.update(chosen)
            a.stats.stage_chosen += len(chosen)
        a.stats.steps += 1
        if not bool(live.any()):
            a.stats.empty_segments += 1
        return self._timed(lambda: self._with_draft_costs(self.strategy.on_output(self.view, int(live.sum()))))

    def _timed(self, handler) -> list:
        """Run a handler and record its bookkeeping time: wall time minus model calls and minus building
        a round's initial tree (reported apart, in `tree_build_s`). Pre-drafting is planned after it."""
        self.times = StepTimes()
        t0 = time.perf_counter()
        actions = handler()
        actions += self._plan_predraft()
        self.stats.overhead_s.append(max(0.0, time.perf_counter() - t0 - self.times.model_s - self.times.build_s))
        return actions

    def _prefill_done(self, seg: Segment) -> list:
        a = self.answer
        a.prefill_left -= 1
        a.prefix_len += len(seg)
        if self.features is not None:
            self.features.prefill(seg, a.prompt, done=not a.prefill_left)
        if a.prefill_left:
            return []
        if seg.tokens is not None:   # the last stage chose the token after the prompt
            y = int(seg.tokens[-1])
            a.stats.stage_chosen += 1
        elif self.oracle is not None:
            y = choose_token(self.oracle.logits(a.prompt), a.params, a.gen)
        else:
            if seg.hidden is None:
                raise RuntimeError("the prompt came back without hidden states or a token choice")
            y = choose_token(self.model.logits(seg.hidden[-1:])[0], a.params, a.gen)
        actions: list = [Compute("lm_head", 1, 0, "prefill")] if self.lm_head_at == "head" else []
        return actions + self._accept_tokens([y]) + ([] if a.finished else self._new_round())

    # ---- rounds and segments ----------------------------------------------------------------------
    def _new_round(self) -> list:
        """Start a round rooted at the last output token (already emitted, not yet in the base KV)."""
        self.stats.rounds += 1
        drafted_before, t0 = self._drafted_s(), time.perf_counter()
        tree = self.strategy.build_round(self.view)
        # Its draft calls are model time (subtracted via _with_draft_costs), the rest is tree building.
        build = time.perf_counter() - t0 - (self._drafted_s() - drafted_before)
        self.times.build_s += build
        self.stats.tree_build_s.append(build)
        self.round = Round(self.answer.prefix_len, tree, torch.ones(len(tree), dtype=torch.bool))
        if self.predraft is not None:   # the last round's segments in flight are void
            self.predraft.new_round()
        return self._with_draft_costs(self.strategy.initial_segments(self.view))

    def grow_alive(self) -> None:
        """New nodes were appended to the tree: they start alive."""
        r = running(self.round)
        extra = len(r.tree) - r.alive.numel()
        if extra > 0:
            r.alive = torch.cat([r.alive, torch.ones(extra, dtype=torch.bool)])

    def send_nodes(self, ids: torch.Tensor, phase: str) -> list:
        """Embed alive nodes `ids` and send them to stage 1 as one segment."""
        if phase not in SEGMENT_PHASES:   # the wire would refuse it: say so where the bug is
            raise ValueError(f"segment phase {phase!r} is not one of {SEGMENT_PHASES} (core/config.py)")
        r = running(self.round)
        ids = self._within_room(ids[r.alive[ids]])
        if ids.numel() == 0:
            return []
        r.rows_sent += ids.numel()
        t0 = time.perf_counter()
        hidden = self.model.embed(r.tree.tokens[ids])
        self.times.model_s += time.perf_counter() - t0
        roots = ids == ROOT   # the round's root hangs off the committed context: no parent id to send
        parents = r.tree.parents[ids].masked_fill(roots, 0)
        seg = Segment(self.run_id, self.round_id, self._next_seq(), self.answer.version, ids, parents,
                      r.base + r.tree.depths[ids], hidden, phase, roots=roots)
        r.in_flight += 1
        if self.predraft is not None:   # when it is due back: pre-drafting fills the gap until then
            self.predraft.gaps.on_send(seg.seq, self.clock())
        return [Send(1, seg)]

    def _within_room(self, ids: torch.Tensor) -> torch.Tensor:
        """The nodes of `ids` that fit in the stages' KV room left this round (the model's context less the
        committed prefix less the rows already sent); the rest are pruned here, before they are sent, so a
        tree never overflows a stage near the context's edge. Node ids are topological (a parent's id is
        smaller than its children's), so the smallest ids kept include every kept node's parent."""
        r, room = running(self.round), self.room()
        if ids.numel() <= room:
            return ids
        order = ids.sort().values
        r.alive[order[max(room, 0):]] = False   # never sent: the walk stops before them, like pruned nodes
        return ids[r.alive[ids]]

    def _next_seq(self) -> int:
        self.answer.seq += 1
        return self.answer.seq

    # ---- verification -----------------------------------------------------------------------------
    def _logits(self, node: int) -> torch.Tensor | None:
        r = running(self.round)
        if node in r.logits_of:
            return r.logits_of[node]
        if node not in r.arrived:
            return None
        t0 = time.perf_counter()
        if self.oracle is not None:   # the round's root sits at position r.base
            r.logits_of[node] = self.oracle.logits(self.context()[: r.base] + r.tree.path_tokens(node))
        else:
            h = r.arrived[node]
            if h is None:
                raise RuntimeError(f"node {node} came back without hidden states or a token choice")
            r.logits_of[node] = self.model.logits(h.unsqueeze(0))[0]
        self.times.model_s += time.perf_counter() - t0
        self.times.lm_tokens += 1
        return r.logits_of[node]

    def _chosen(self, node: int) -> int | None:
        """The base model's token at `node`: sent by the last stage, else drawn here from its logits
        (lazily, one draw per visited node); None while the node's output has not arrived."""
        token = running(self.round).token_of.get(node)
        if token is not None:
            return token
        logits = self._logits(node)
        return None if logits is None else choose_token(logits, self.answer.params, self.answer.gen)

    def verify(self) -> tuple[WalkResult | None, list]:
        """Walk from the current node if its output is known; returns the walk and the lm_head cost
        (none on node 0 when the last stage holds the lm_head)."""
        r = running(self.round)
        self.times.lm_tokens = 0
        if r.cur not in r.arrived:
            return None, []
        res = walk_chosen(r.tree, r.cur, self._chosen, r.alive)
        cost = [Compute("lm_head", self.times.lm_tokens, 0, "verify")] if self.lm_head_at == "head" else []
        return res, cost

    def apply_walk(self, res: WalkResult, *, continue_round: bool) -> list:
        """Emit the walk's tokens, broadcast the prune set, and either continue or end the round."""
        r = running(self.round)
        self.stats.accept_lens.append(len(res.tokens))
        if self.features is not None:
            self.features.walk(r, self.context()[: r.base], self.answer.prefix_len, res)
        actions = self._accept_tokens(res.tokens)
        prune = prune_after_walk(r.tree, r.alive, res)
        end = self.finished or not (continue_round and res.continues)
        self.answer.prefix_len += len(res.committed)
        actions += self._broadcast_prune(prune, end)
        r.ended = end
        if self.finished:
            return actions
        if end or res.next_node is None:   # (not end: the walk goes on at next_node)
            return actions + self._new_round()
        r.alive = apply_alive(r.alive, prune)
        for node in [n for n in r.arrived if not r.alive[n]]:
            r.arrived.pop(node)
            r.logits_of.pop(node, None)
            r.token_of.pop(node, None)
        r.cur = res.next_node
        return actions

    def _broadcast_prune(self, prune: PruneSet, end_round: bool) -> list:
        a = self.answer
        a.version += 1
        a.prefix_at_version[a.version] = a.prefix_len
        msg = Prune(a.run_id, a.round_id, a.version, prune, end_round)
        if end_round:
            a.round_id += 1
        return [Send(i, msg) for i in range(1, self.n_stages + 1)]

    def restart_round(self, reason: str | None = None) -> list:
        """Drop the round and start afresh: nothing in flight can extend the walk (should not happen), or
        a strategy chose to (`reason`)."""
        if reason is None:
            log.warning("round %d stalled with nothing in flight; restarting it", self.round_id)
        else:
            log.info("round %d ended early: %s", self.round_id, reason)
        r, empty = running(self.round), torch.zeros(0, dtype=torch.long)
        actions = self._broadcast_prune(PruneSet(empty, empty, len(r.tree)), True)
        r.ended = True
        return actions + self._new_round()

    def _accept_tokens(self, tokens: list[int]) -> list:
        a = self.answer
        new = tokens[: a.max_new - len(a.outputs)]
        for i, t in enumerate(new):
            if t in self.stop_ids:
                new = new[: i + 1]
                break
        a.outputs += new
        actions: list = [Emit(new, self.run_id)] if new else []
        if len(a.outputs) >= a.max_new or (new and new[-1] in self.stop_ids):
            a.finished = True
            actions += [Send(i, Finish(self.run_id)) for i in range(1, self.n_stages + 1)]
            actions.append(Done(list(self.outputs), self.stats))
        return actions

    def context(self) -> list[int]:
        return self.answer.prompt + self.answer.outputs

    def _drafted_s(self) -> float:
        return self.drafter.pending_seconds() if self.drafter is not None else 0.0

    def _with_draft_costs(self, actions: list) -> list:
        """Put the draft-model work done while producing `actions` before the first segment it fed."""
        costs: list = []
        if self.drafter is not None:
            for tokens, context, seconds in self.drafter.drain_calls():
                costs.append(Compute("draft", tokens, context, "draft"))
                self.times.model_s += seconds
            self.stats.draft_forwards = self.drafter.forwards
            if self.predraft is not None:   # (the answer's stats are refreshed after every handler)
                self.predraft.stats.critical_calls += len(costs)
        sends = (i for i, a in enumerate(actions) if isinstance(a, Send) and isinstance(a.message, Segment))
        first_send = next(sends, len(actions))
        return actions[:first_send] + costs + actions[first_send:] if costs else actions

    def room(self) -> int:
        """Tree rows the stages can still take this round (their KV room before the model's context)."""
        r = running(self.round)
        return self.max_positions - r.base - r.rows_sent

    def expand_later(self, accepted: bool) -> list:
        """An expansion after the prune set went out; none when no row it drafts could be sent."""
        return [Continue(Expand(self.round_id, accepted))] if self.room() > 0 else []

    # ---- pre-drafting (engine/predraft.py) --------------------------------------------------------
    def _plan_predraft(self) -> list:
        r = self.round
        if self.predraft is not None:
            self.stats.predraft = self.predraft.stats.as_dict()
        if self.predraft is None or r is None or r.ended or self.finished or not self.strategy.predrafts:
            return []
        return self.predraft.plan(self.context(), r.in_flight > 0)

    def _predraft_event(self, event) -> list:
        """A pre-draft call in node 0's gap, or the drafter's answer merged; then the next job."""
        if self.predraft is None:
            return []
        if self.round is None or self.round.ended or self.finished or not self.strategy.predrafts:
            self.predraft.new_round()   # e.g. auto on pipedec, whose round tree is the draft tree
            return []
        actions, more = self.predraft.on_event(event, self.context(), self.clock())
        actions += self._plan_predraft() if more else []
        self.stats.predraft = self.predraft.stats.as_dict()
        return actions

    def predrafted_base(self) -> DraftTree | None:
        if self.predraft is None:
            return None
        r = running(self.round)
        return self.predraft.base_for(self.context(), r.tree, r.alive, r.cur)
