"""The stage worker: one layer range, its KV cache, and the rules that keep it in step with the head.

Cache layout: [committed context (prefix_len entries)][draft entries, ids in `draft_ids`]. A segment is
run only after every prune it was built against has been applied (`prune_version`); tokens that a newer
prune already killed are dropped on arrival, so in-flight hidden states are pruned too. Every stage
applies the same prunes in version order, hence identical caches across stages.

The last stage may also hold the base model's final norm and lm_head (`can_choose`). For a request
whose prefill carries sampling params (the head's `lm_head_at = "last-stage"`) it then returns the base
model's token choice per node instead of hidden states, which takes the lm_head off node 0 (the busy
device: it also runs the draft model) and shrinks the return hop from H 16-bit values to one int per node.
"""
from __future__ import annotations

import logging

import torch

from flowedge.core.prune import PruneSet, cache_reorder, live_in
from flowedge.core.sampling import SamplingParams, make_generator, warp_probs
from flowedge.engine.events import Compute, Finish, Prune, Segment, Send
from flowedge.models.stage import StageModel, bool_to_float_mask

log = logging.getLogger(__name__)


def tree_rows(parent_of: torch.Tensor, seg_ids: torch.Tensor, columns: torch.Tensor) -> torch.Tensor:
    """[n, m] bool: column id is the segment node itself or one of its ancestors.

    parent_of: [ids] parent id per node id (-1 = committed context); walks all rows one level per
    iteration, so the loop runs tree-depth times, not once per token."""
    anc = [seg_ids]
    cur = seg_ids
    while True:
        cur = torch.where(cur >= 0, parent_of[cur.clamp(min=0)], cur)
        if bool((cur < 0).all()):
            break
        anc.append(cur)
    anc_ids = torch.stack(anc, dim=1)                                   # [n, depth]
    return (columns.view(1, -1, 1) == anc_ids.unsqueeze(1)).any(-1)      # [n, m]


class StageWorker:
    def __init__(self, index: int, model: StageModel, n_stages: int, can_choose: bool = False) -> None:
        self.index = index                  # 1..N
        self.model = model
        self.can_choose = can_choose        # holds the lm_head (or stands in for one: shape-only stages)
        self.next_node = 0 if index == n_stages else index + 1
        self.request_id: int | None = None
        self.cache = model.new_cache()
        self._reset_request(None)
        self.history: list[tuple[int, int]] = []   # (prune version, prefix_len after it): for tests

    def _reset_request(self, request_id: int | None) -> None:
        self.request_id = request_id
        self.cache.truncate(0)
        self.prefix_len = 0
        self.round_id = 0
        self.version = 0
        self.last_prune: PruneSet | None = None
        self.draft_ids = torch.empty(0, dtype=torch.long)
        self.parent_of = torch.full((64,), -1, dtype=torch.long)
        self.waiting: list[Segment] = []
        self.pending_prunes: dict[int, Prune] = {}
        self.chooses_tokens = False         # this request: return chosen tokens, not hidden states
        self.params = SamplingParams()
        self.generator: torch.Generator | None = None

    # ---- events ---------------------------------------------------------------------------------
    def receive(self, message: Segment | Prune | Finish) -> list:
        if isinstance(message, Finish):
            if message.request_id == self.request_id:
                self._reset_request(None)
            return []
        if message.request_id != self.request_id:
            if isinstance(message, Segment) and message.phase == "prefill":
                self._reset_request(message.request_id)
            else:
                return []   # a finished or unknown request: nothing to do
        if isinstance(message, Prune):
            self.pending_prunes[message.version] = message
        else:
            self.waiting.append(message)
        return self._drain()

    def _drain(self) -> list:
        actions: list = []
        progressed = True
        while progressed:
            progressed = False
            nxt = self.pending_prunes.pop(self.version + 1, None)
            if nxt is not None:
                self._apply(nxt)
                progressed = True
            ready = [s for s in self.waiting if s.prune_version <= self.version]
            if ready:
                self.waiting = [s for s in self.waiting if s.prune_version > self.version]
                for seg in ready:
                    actions += self._run(seg)
                progressed = True
        return actions

    def _apply(self, p: Prune) -> None:
        self.version = p.version
        commit_pos, keep_pos = cache_reorder(self.draft_ids, p.prune)
        if p.end_round:
            keep_pos = keep_pos[:0]
        base = torch.arange(self.prefix_len)
        self.cache.keep(torch.cat([base, self.prefix_len + commit_pos, self.prefix_len + keep_pos]))
        self.prefix_len += int(commit_pos.numel())
        self.draft_ids = self.draft_ids[keep_pos]
        if p.end_round:
            self.round_id = p.round_id + 1
            self.last_prune = None
            self.parent_of.fill_(-1)
        else:
            self.last_prune = p.prune
        self.history.append((p.version, self.prefix_len))

    def _run(self, seg: Segment) -> list:
        if seg.phase == "prefill":
            return self._prefill(seg)
        if seg.round_id != self.round_id:
            return []   # built for a round that has ended: dead on arrival
        live = live_in(seg.node_ids, self.last_prune) if self.last_prune is not None \
            else torch.ones(len(seg), dtype=torch.bool)
        seg = seg.select(live) if not bool(live.all()) else seg
        n = len(seg)
        if n:
            self._record_parents(seg)
        past = self.cache.length
        allowed = torch.zeros(n, past + n, dtype=torch.bool)
        allowed[:, : self.prefix_len] = True
        allowed[:, self.prefix_len:] = tree_rows(self.parent_of, seg.node_ids,
                                                 torch.cat([self.draft_ids, seg.node_ids]))
        hidden = self.model.forward_layers(seg.hidden, seg.positions,
                                           bool_to_float_mask(allowed, seg.hidden.dtype), self.cache)
        self.draft_ids = torch.cat([self.draft_ids, seg.node_ids])
        actions: list = [Compute("stage", n, past, seg.phase)]
        if self.chooses_tokens:
            if n:
                actions.append(Compute("lm_head", n, 0, seg.phase))
            out = seg.select(torch.ones(n, dtype=torch.bool), hidden[:, :0], self._choose(hidden))
        else:
            out = seg.select(torch.ones(n, dtype=torch.bool), hidden)
        return actions + [Send(self.next_node, out)]

    def _choose(self, hidden: torch.Tensor) -> torch.Tensor:
        """[n, H] final hidden states -> [n] tokens drawn from the base distribution (one independent
        draw per row, vectorised); -1 rows when the model is shape-only (the simulator's oracle mode,
        where the head reads the base logits itself but this stage is charged for the lm_head)."""
        if not hasattr(self.model, "logits") or hidden.shape[0] == 0:
            return torch.full((hidden.shape[0],), -1, dtype=torch.long)
        logits = self.model.logits(hidden)               # [n, V] float32
        if self.params.greedy:
            return logits.argmax(dim=-1)                 # first maximum, as choose_token
        return torch.multinomial(warp_probs(logits, self.params), 1, generator=self.generator).squeeze(1)

    def _prefill(self, seg: Segment) -> list:
        """A prompt chunk: plain causal attention, committed at once (chunked prefill)."""
        n, past = len(seg), self.cache.length
        allowed = torch.ones(n, past + n, dtype=torch.bool)
        allowed[:, past:] = torch.ones(n, n, dtype=torch.bool).tril()
        hidden = self.model.forward_layers(seg.hidden, seg.positions,
                                           bool_to_float_mask(allowed, seg.hidden.dtype), self.cache)
        self.prefix_len += n
        everything = torch.ones(n, dtype=torch.bool)
        if int(seg.positions[0]) == 0:   # first chunk: does the head want this stage's token choices?
            self.chooses_tokens = self.can_choose and seg.sampling is not None
            if self.chooses_tokens:
                self.params, self.generator = seg.sampling, make_generator(seg.sampling)
        if not self.chooses_tokens:
            return [Compute("stage", n, past, "prefill"), Send(self.next_node, seg.select(everything, hidden))]
        tokens = torch.full((n,), -1, dtype=torch.long)
        tokens[-1:] = self._choose(hidden[-1:])         # only the prompt's last row is ever read
        return [Compute("stage", n, past, "prefill"), Compute("lm_head", 1, 0, "prefill"),
                Send(self.next_node, seg.select(everything, hidden[:, :0], tokens))]

    def _record_parents(self, seg: Segment) -> None:
        top = int(seg.node_ids.max()) + 1
        if top > self.parent_of.numel():
            grown = torch.full((max(top, 2 * self.parent_of.numel()),), -1, dtype=torch.long)
            grown[: self.parent_of.numel()] = self.parent_of
            self.parent_of = grown
        self.parent_of[seg.node_ids] = seg.parent_ids
