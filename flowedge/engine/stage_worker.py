"""The stage worker: one layer range, a KV cache per request, and the rules that keep it in step with the head.

Several requests share a stage (SpecPipe-DB's dynamic batching): each has its own `RequestSlot` (KV cache,
committed length, draft ids, prune version), created by its first prefill chunk and freed by `Finish`.
Whatever segments of different requests are ready when the stage takes its messages run as one batched
forward (`receive_all`): packed rows through the Linear layers, per-request positions, and each request's
attention over its own KV with its own mask (see `StageModel.forward_packed`). One request alone runs
exactly as before.

Failures (`contain_failures`, set by the daemon's inbox): an exception while handling one request's
message, prune or rows frees that request alone and comes out as a `Failed` action. A batched forward
that raises is rolled back (each cache truncated to where it was) and its requests run one at a time,
so only a request that fails on its own is failed; the others go on exactly as if they ran alone.
Without it (the simulator, tests) every error propagates.

Cache layout per request: [committed context (prefix_len entries)][draft entries, ids in `draft_ids`]. A segment is
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
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Generic, Protocol, TypeVar

import torch

from flowedge.core.prune import PruneSet, cache_reorder, live_in
from flowedge.core.sampling import SamplingParams, make_generator, warp_probs
from flowedge.engine.events import Compute, Failed, Finish, Prune, Segment, Send
from flowedge.models.kv_cache import CacheLike
from flowedge.models.stage import bool_to_float_mask

log = logging.getLogger(__name__)


def tree_rows(parent_of: torch.Tensor, is_root: torch.Tensor, seg_ids: torch.Tensor,
              columns: torch.Tensor) -> torch.Tensor:
    """[n, m] bool: column id is the segment node itself or one of its ancestors.

    parent_of: [ids] parent id per node id, read where is_root ([ids] bool: the node hangs off the
    committed context, or is unknown) is False; seg_ids and columns are ids below len(parent_of).
    Walks all rows one level per iteration (tree-depth times, not once per token) and marks the ids
    met in an [n, ids] table, so memory never grows with the depth. A chain visits an id at most
    once, so the walk ends after len(parent_of) levels even if a peer made a cycle."""
    marks = torch.zeros(seg_ids.numel(), parent_of.numel(), dtype=torch.bool)
    rows = torch.arange(seg_ids.numel())
    cur, walking = seg_ids, torch.ones(seg_ids.numel(), dtype=torch.bool)
    for _ in range(parent_of.numel() + 1):
        marks[rows[walking], cur[walking]] = True
        walking = walking & ~is_root[cur]
        if not bool(walking.any()):
            break
        cur = torch.where(walking, parent_of[cur], cur)
    return marks[:, columns]


CLOSED_REMEMBERED = 4096   # finished request ids a stage remembers, so a late prefill cannot revive one
# Requests whose prune records (version, prefix length) are kept for the lossless checks. Small on purpose:
# the records of 4,096 requests of 24 tokens grew a soaked stage by ~12 MB, which read as a leak for half an hour
HISTORY_REQUESTS = 256
BATCHES_REMEMBERED = 1024   # requests per forward, the most recent (tests and reports read them)
HISTORY_REMEMBERED = 4096   # the most recent prune records of all requests, for the same checks


@dataclass
class RequestSlot:
    """One request's state on a stage (mutable: it is the stage's bookkeeping, not a message)."""
    run_id: int
    cache: CacheLike                       # KVCache (LengthOnlyCache under oracle verification)
    prefix_len: int = 0
    round_id: int = 0
    version: int = 0
    last_prune: PruneSet | None = None
    draft_ids: torch.Tensor = field(default_factory=lambda: torch.empty(0, dtype=torch.long))
    parent_of: torch.Tensor = field(default_factory=lambda: torch.zeros(64, dtype=torch.long))
    is_root: torch.Tensor = field(default_factory=lambda: torch.ones(64, dtype=torch.bool))  # or unknown
    waiting: list[Segment] = field(default_factory=list)
    pending_prunes: dict[int, Prune] = field(default_factory=dict)
    chooses_tokens: bool = False           # return chosen tokens, not hidden states
    params: SamplingParams = field(default_factory=SamplingParams)
    generator: torch.Generator | None = None

    def next_ready(self) -> Segment | None:
        """The oldest segment whose prunes have all been applied (FIFO per request keeps parents first)."""
        for i, seg in enumerate(self.waiting):
            if seg.prune_version <= self.version:
                return self.waiting.pop(i)
        return None


@dataclass(frozen=True, slots=True)
class _Row:
    """A segment prepared for the batched forward: its rows' mask over its own request's cache."""
    slot: RequestSlot
    seg: Segment
    allowed: torch.Tensor     # [n, past + n] bool
    past: int

    @property
    def hidden(self) -> torch.Tensor:
        """The rows' input: a segment on its way to a stage carries hidden states (token choices only leave
        the last one)."""
        if self.seg.hidden is None:
            raise ValueError(f"segment {self.seg.seq} reached a stage without hidden states")
        return self.seg.hidden


class StageLayers(Protocol):
    """What a stage worker runs: a `StageModel`'s layer range, or the simulator's shape-only stand-in
    (sim/oracle.py). One that can choose tokens also has `logits` (the worker asks with hasattr)."""

    def new_cache(self) -> CacheLike: ...

    def forward_packed(self, hidden: torch.Tensor, positions: torch.Tensor, masks: list[torch.Tensor],
                       caches: list[Any]) -> torch.Tensor:
        """`caches`: each request's, as `new_cache` made it."""
        ...


Layers = TypeVar("Layers", bound=StageLayers)


class StageWorker(Generic[Layers]):
    def __init__(self, index: int, model: Layers, n_stages: int, can_choose: bool = False,
                 contain_failures: bool = False) -> None:
        self.index = index                  # 1..N
        self.model = model
        self.can_choose = can_choose        # holds the lm_head (or stands in for one: shape-only stages)
        self.contain_failures = contain_failures   # one request's error fails it alone (daemon); else raise
        self._failed: list[Failed] = []
        self.next_node = 0 if index == n_stages else index + 1
        self.slots: dict[int, RequestSlot] = {}
        self._closed: deque[int] = deque(maxlen=CLOSED_REMEMBERED)
        # (prune version, prefix_len after it): the last HISTORY_REMEMBERED of all requests, and per request for
        # the last HISTORY_REQUESTS requests: what the lossless checks compare with the head's record
        self.history: deque[tuple[int, int]] = deque(maxlen=HISTORY_REMEMBERED)
        self.history_by_request: dict[int, list[tuple[int, int]]] = {}
        self.batch_sizes: deque[int] = deque(maxlen=BATCHES_REMEMBERED)
        self.forwards = 0            # batched forwards run, and the requests they held (all time: status)
        self.forward_requests = 0

    def reset(self) -> None:
        """Forget every request (a new assignment: the head may be a new process reusing request ids)."""
        for rid in list(self.slots):
            self._free(rid)
        self._closed.clear()

    # ---- inspection -----------------------------------------------------------------------------
    def cache_lengths(self) -> dict[int, int]:
        """KV entries held per live request."""
        return {rid: slot.cache.length for rid, slot in self.slots.items()}

    def history_of(self, run_id: int) -> list[tuple[int, int]]:
        return self.history_by_request.get(run_id, [])

    def cached_tokens(self) -> int:
        return sum(self.cache_lengths().values())

    # ---- events ---------------------------------------------------------------------------------
    def receive(self, message: Segment | Prune | Finish) -> list:
        return self.receive_all([message])

    def receive_all(self, messages: list) -> list:
        """Take every message that arrived while the stage was busy, then run what is ready: one batched
        forward per wave, at most one segment per request in each (a request's own segments stay in order)."""
        for m in messages:
            self._guarded(m.run_id, self._accept, m)
        actions: list = []
        while True:
            batch = []
            for slot in list(self.slots.values()):
                seg = self._guarded(slot.run_id, self._next_ready, slot)
                if seg is not None:
                    batch.append((slot, seg))
            if not batch:
                failed, self._failed = self._failed, []
                return actions + failed
            actions += self._run_batch(batch)

    def _next_ready(self, slot: RequestSlot) -> Segment | None:
        self._apply_pending(slot)
        return slot.next_ready()

    def _guarded(self, run_id: int, step, *args):
        """`step(*args)`; with `contain_failures` an exception fails `run_id` alone (None returned)."""
        if not self.contain_failures:
            return step(*args)
        try:
            return step(*args)
        except Exception as err:  # noqa: BLE001 - one request's error must not reach the others
            self._fail(run_id, err)
            return None

    def _fail(self, run_id: int, err: Exception) -> None:
        log.error("request %d failed on stage %d: %r; freed", run_id, self.index, err, exc_info=True)
        self._free(run_id)
        self._failed.append(Failed(run_id, f"{type(err).__name__}: {err}"[:300]))

    def _accept(self, message) -> None:
        rid = message.run_id
        if isinstance(message, Finish):
            self._free(rid)
            return
        starts = isinstance(message, Segment) and message.phase == "prefill" and int(message.positions[0]) == 0
        if starts and rid not in self._closed:
            self.slots[rid] = RequestSlot(rid, self.model.new_cache())   # a new request, or a replay from scratch
        slot = self.slots.get(rid)
        if slot is None:
            return   # a finished, cancelled or unknown request: nothing to do
        if isinstance(message, Prune):
            slot.pending_prunes[message.version] = message
        else:
            slot.waiting.append(message)

    def _free(self, run_id: int) -> None:
        """The request is over (finished or cancelled): drop its KV cache and never revive it."""
        self._closed.append(run_id)
        slot = self.slots.pop(run_id, None)
        if slot is not None:
            slot.cache.truncate(0)

    def _apply_pending(self, slot: RequestSlot) -> None:
        while (p := slot.pending_prunes.pop(slot.version + 1, None)) is not None:
            self._apply(slot, p)

    def _apply(self, slot: RequestSlot, p: Prune) -> None:
        slot.version = p.version
        commit_pos, keep_pos = cache_reorder(slot.draft_ids, p.prune)
        if p.end_round:
            keep_pos = keep_pos[:0]
        base = torch.arange(slot.prefix_len)
        slot.cache.keep(torch.cat([base, slot.prefix_len + commit_pos, slot.prefix_len + keep_pos]))
        slot.prefix_len += int(commit_pos.numel())
        slot.draft_ids = slot.draft_ids[keep_pos]
        if p.end_round:
            slot.round_id = p.round_id + 1
            slot.last_prune = None
            slot.is_root.fill_(True)
        else:
            slot.last_prune = p.prune
        self.history.append((p.version, slot.prefix_len))
        if slot.run_id not in self.history_by_request and len(self.history_by_request) >= HISTORY_REQUESTS:
            del self.history_by_request[next(iter(self.history_by_request))]   # the oldest request's
        self.history_by_request.setdefault(slot.run_id, []).append((p.version, slot.prefix_len))

    # ---- the batched forward --------------------------------------------------------------------
    def _prepare(self, slot: RequestSlot, seg: Segment) -> _Row | None:
        """Drop rows a newer prune killed and build the segment's mask; None: dead on arrival."""
        past = slot.cache.length
        if seg.phase == "prefill":   # a prompt chunk: plain causal attention, committed at once
            n = len(seg)
            allowed = torch.ones(n, past + n, dtype=torch.bool)
            allowed[:, past:] = torch.ones(n, n, dtype=torch.bool).tril()
            return _Row(slot, seg, allowed, past)
        if seg.round_id != slot.round_id:
            return None   # built for a round that has ended
        if slot.last_prune is not None:
            live = live_in(seg.node_ids, slot.last_prune)
            seg = seg.select(live) if not bool(live.all()) else seg
        n = len(seg)
        if n:
            _record_parents(slot, seg)
        allowed = torch.zeros(n, past + n, dtype=torch.bool)
        allowed[:, : slot.prefix_len] = True
        allowed[:, slot.prefix_len:] = tree_rows(slot.parent_of, slot.is_root, seg.node_ids,
                                                 torch.cat([slot.draft_ids, seg.node_ids]))
        return _Row(slot, seg, allowed, past)

    def _run_batch(self, batch: list[tuple[RequestSlot, Segment]]) -> list:
        rows = [r for slot, seg in batch
                if (r := self._guarded(slot.run_id, self._prepare, slot, seg)) is not None]
        if not rows:
            return []
        run = [r for r in rows if len(r.seg)]
        by_row = dict(zip((id(r) for r in run), self._forward_contained(run) if run else []))
        failed = {f.run_id for f in self._failed}
        run = [r for r in run if r.slot.run_id not in failed]
        rows = [r for r in rows if r.slot.run_id not in failed]
        if run:
            self.batch_sizes.append(len(run))
            self.forwards += 1
            self.forward_requests += len(run)
        n_total = sum(len(r.seg) for r in run)
        phases = {r.seg.phase for r in run}
        attended = sum(len(r.seg) * r.past for r in run) / n_total if n_total else 0.0   # each its own cache
        actions: list = [Compute("stage", n_total, sum(r.past for r in run),
                                 phases.pop() if len(phases) == 1 else "batch", attended)] if run else []
        outs, lm_rows = [], 0
        for r in rows:
            h = by_row.get(id(r), r.seg.hidden)
            finished = self._guarded(r.slot.run_id, self._finish_row, r, h)
            if finished is not None:
                outs.append(finished[0])
                lm_rows += finished[1]
        if lm_rows:
            actions.append(Compute("lm_head", lm_rows, 0, actions[0].phase if actions else ""))
        return actions + [Send(self.next_node, out) for out in outs]

    def _forward_contained(self, rows: list[_Row]) -> Sequence[torch.Tensor | None]:
        """The batched forward; if it raises (and failures are contained), every cache goes back to
        where it was and each request runs alone: only one that fails by itself is failed (None)."""
        if not self.contain_failures:
            return self._forward(rows)
        try:
            return self._forward(rows)
        except Exception as err:  # noqa: BLE001 - isolate the request(s) that caused it
            if len(rows) > 1:
                log.warning("stage %d: a batched forward of requests %s raised %r; running them one at a time",
                            self.index, [r.slot.run_id for r in rows], err)
            for r in rows:
                r.slot.cache.truncate(r.past)
            if len(rows) == 1:
                self._fail(rows[0].slot.run_id, err)
                return [None]
        return [self._guarded(r.slot.run_id, self._forward_alone, r) for r in rows]

    def _forward_alone(self, r: _Row) -> torch.Tensor:
        try:
            return self._forward([r])[0]
        except Exception:
            r.slot.cache.truncate(r.past)
            raise

    def _forward(self, rows: list[_Row]) -> list[torch.Tensor]:
        """One forward over every row of every request: [sum n, H] packed, each request attending over its
        own cache with its own mask (bit-identical per request to running it alone, with W4A16 stages)."""
        hidden = torch.cat([r.hidden for r in rows])
        positions = torch.cat([r.seg.positions for r in rows])
        masks = [bool_to_float_mask(r.allowed, hidden.dtype) for r in rows]
        out = self.model.forward_packed(hidden, positions, masks, [r.slot.cache for r in rows])
        return list(out.split([len(r.seg) for r in rows]))

    def _finish_row(self, r: _Row, hidden: torch.Tensor) -> tuple[Segment, int]:
        """Book the forward into the request's state; returns the outgoing segment and lm_head rows spent."""
        slot, seg, n = r.slot, r.seg, len(r.seg)
        everything = torch.ones(n, dtype=torch.bool)
        if seg.phase != "prefill":
            slot.draft_ids = torch.cat([slot.draft_ids, seg.node_ids])
            if not slot.chooses_tokens:
                return seg.select(everything, hidden), 0
            return seg.chosen(self._choose(slot, hidden)), n
        slot.prefix_len += n
        if int(seg.positions[0]) == 0:   # first chunk: does the head want this stage's token choices?
            sampling = seg.sampling if self.can_choose else None
            slot.chooses_tokens = sampling is not None
            if sampling is not None:
                slot.params, slot.generator = sampling, make_generator(sampling)
        if not slot.chooses_tokens:
            return seg.select(everything, hidden), 0
        tokens = self._choose(slot, hidden[-1:])   # the token after the chunk's last row: [1] (or None)
        return seg.chosen(tokens), 1

    def _choose(self, slot: RequestSlot, hidden: torch.Tensor) -> torch.Tensor | None:
        """[n, H] final hidden states -> [n] tokens drawn from the base distribution (one independent
        draw per row with the request's own generator); None when the model is shape-only (the
        simulator's oracle mode, where the head reads the base logits itself but this stage is charged
        for the lm_head)."""
        if not hasattr(self.model, "logits"):
            return None
        if hidden.shape[0] == 0:
            return torch.empty(0, dtype=torch.long)
        logits = self.model.logits(hidden)               # [n, V] float32
        if slot.params.greedy:
            return logits.argmax(dim=-1)                 # first maximum, as choose_token
        return torch.multinomial(warp_probs(logits, slot.params), 1, generator=slot.generator).squeeze(1)


def _record_parents(slot: RequestSlot, seg: Segment) -> None:
    top = int(seg.node_ids.max()) + 1
    if top > slot.parent_of.numel():
        size = max(top, 2 * slot.parent_of.numel())
        parent_of, is_root = torch.zeros(size, dtype=torch.long), torch.ones(size, dtype=torch.bool)
        parent_of[: slot.parent_of.numel()] = slot.parent_of
        is_root[: slot.is_root.numel()] = slot.is_root
        slot.parent_of, slot.is_root = parent_of, is_root
    slot.parent_of[seg.node_ids] = seg.parent_ids
    slot.is_root[seg.node_ids] = seg.root_mask()
