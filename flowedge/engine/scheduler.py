"""Many requests through one pipeline: admission, fair queueing, and routing events to per-request heads.

`Head` stays one request's engine (its tree, verification, prune versions, sampling generator).
`MultiHead` sits above it on node 0: it admits up to `max_concurrent` requests, each with its own Head
and draft cache, queues the rest first come first served, and admits the next one whenever a request
ends or is cancelled. Segments of the admitted requests flow through the pipeline interleaved; a stage
that holds segments of several requests runs them as one batched forward (`stage_worker`), which is where
the throughput comes from: while one request waits for its verification, the others keep the stages busy,
and on memory-bound devices a forward of 4 requests' rows costs little more than one request's.

Admission also respects the stages' KV memory: each request reserves its worst case (prompt + new tokens
+ the largest draft tree it can have in flight) against `kv_budget_tokens`, so a stage never holds more.
Sans-IO like the Head: events in (`Submit`, `Cancel`, segments, follow-ups), actions out.
"""
from __future__ import annotations

import logging
import time
from collections import deque
from dataclasses import dataclass
from functools import partial
from typing import Callable

from flowedge.core.sampling import SamplingParams
from flowedge.engine.events import Continue, Done, Finish, Segment, Send, Stats
from flowedge.errors import ConfigError

log = logging.getLogger(__name__)

ENDED_REMEMBERED = 256   # finished heads kept for inspection (tests, reports)


@dataclass(frozen=True, slots=True)
class BatchConfig:
    """How many requests share the pipeline, and the KV tokens each stage may hold for all of them."""
    max_concurrent: int = 4
    kv_budget_tokens: int | None = None   # None: limited by max_concurrent only
    batch_drafts: bool = True             # node 0 runs the requests' draft calls as shared forwards

    def __post_init__(self) -> None:
        if self.max_concurrent < 1:
            raise ConfigError(f"max-concurrent must be >= 1 (got {self.max_concurrent})")
        if self.kv_budget_tokens is not None and self.kv_budget_tokens < 1:
            raise ConfigError(f"kv budget must be >= 1 token (got {self.kv_budget_tokens})")


@dataclass(frozen=True, slots=True)
class Submit:
    """A new request for the pipeline."""
    request_id: int
    prompt_ids: tuple[int, ...]
    max_new_tokens: int
    params: SamplingParams = SamplingParams()


@dataclass(frozen=True, slots=True)
class Cancel:
    """Stop a request (its client went away): queued ones never run, running ones free their KV."""
    request_id: int


@dataclass(frozen=True, slots=True)
class Routed:
    """A head's own follow-up event (`Continue`), tagged with its request so it finds its way back."""
    request_id: int
    event: object


class MultiHead:
    def __init__(self, make_head: Callable[[Submit], object], n_stages: int, config: BatchConfig = BatchConfig(),
                 tree_reserve: int = 0, batcher=None) -> None:
        self.make_head, self.n_stages, self.config = make_head, n_stages, config
        self.batcher = batcher                # engine/draft_batch.DraftBatcher shared by the heads' drafters
        self.tree_reserve = tree_reserve      # draft entries a request can hold on a stage at once
        self.heads: dict[int, object] = {}    # running requests
        self.queue: deque[Submit] = deque()
        self.reserved: dict[int, int] = {}
        self.ended: dict[int, object] = {}    # recently finished heads (bounded)
        self.clock: Callable[[], float] = time.monotonic   # the simulator sets its virtual clock

    def now(self) -> float:
        """The heads' clock (strategy `auto` measures its rates on it)."""
        return self.clock()

    @classmethod
    def around(cls, head) -> "MultiHead":
        """One request at a time through an existing Head (the single-request drivers)."""
        return cls(lambda sub: head, head.n_stages, BatchConfig(max_concurrent=1))

    # ---- inspection -----------------------------------------------------------------------------
    @property
    def in_flight(self) -> int:
        return len(self.heads)

    @property
    def queued(self) -> int:
        return len(self.queue)

    def head_of(self, request_id: int):
        return self.heads.get(request_id) or self.ended.get(request_id)

    def footprint(self, sub: Submit) -> int:
        """KV entries the request can hold on one stage: its whole context plus a tree in flight."""
        return len(sub.prompt_ids) + sub.max_new_tokens + self.tree_reserve

    # ---- events ---------------------------------------------------------------------------------
    def receive(self, event) -> list:
        if isinstance(event, Submit):
            return self._submit(event)
        if isinstance(event, Cancel):
            return self._cancel(event.request_id)
        if isinstance(event, Routed):
            rid, inner = event.request_id, event.event
        elif isinstance(event, Segment):
            rid, inner = event.request_id, event
        else:
            raise TypeError(f"MultiHead cannot handle {type(event).__name__}")
        head = self.heads.get(rid)
        if head is None:
            return []   # a finished or cancelled request's straggler
        return self._wrap(rid, head.receive(inner))

    def receive_all(self, events: list) -> list:
        """Every event that reached node 0 while it was busy, its own follow-ups (`Continue`) included: a
        driver hands those back together with whatever arrived meanwhile, so one request's pipeline fill
        and another's verification share a step. Submits and cancels first; then one handler per request
        (its events in order) — side by side through the draft batcher, so the requests' draft calls share
        forwards. Actions come out request after request."""
        actions: list = []
        per_request: dict[int, list] = {}
        for ev in events:
            if isinstance(ev, (Submit, Cancel)):
                actions += self.receive(ev)
            elif isinstance(ev, Routed):
                per_request.setdefault(ev.request_id, []).append(ev.event)
            elif isinstance(ev, Segment):
                per_request.setdefault(ev.request_id, []).append(ev)
            else:
                raise TypeError(f"MultiHead cannot handle {type(ev).__name__}")
        live = [(rid, evs) for rid, evs in per_request.items() if rid in self.heads]
        handlers = [partial(_handle, self.heads[rid], evs) for rid, evs in live]
        results = self.batcher.run_step(handlers) if self.batcher is not None else [h() for h in handlers]
        for (rid, _), head_actions in zip(live, results):
            actions += self._wrap(rid, head_actions)
        return actions

    def _submit(self, sub: Submit) -> list:
        if sub.request_id in self.heads or any(q.request_id == sub.request_id for q in self.queue):
            raise ConfigError(f"request id {sub.request_id} is already in use")
        budget = self.config.kv_budget_tokens
        if budget is not None and self.footprint(sub) > budget:
            raise ConfigError(f"request {sub.request_id} needs {self.footprint(sub)} KV tokens per stage; "
                              f"the budget is {budget}")
        self.queue.append(sub)
        return self._admit()

    def _fits(self, sub: Submit) -> bool:
        if len(self.heads) >= self.config.max_concurrent:
            return False
        budget = self.config.kv_budget_tokens
        return budget is None or sum(self.reserved.values()) + self.footprint(sub) <= budget

    def _admit(self) -> list:
        """Start queued requests in arrival order while they fit (never skip ahead: no starvation)."""
        actions: list = []
        while self.queue and self._fits(self.queue[0]):
            sub = self.queue.popleft()
            head = self.make_head(sub)
            if hasattr(head, "clock"):
                head.clock = self.now
            if hasattr(head, "running_requests"):   # every engine Head (the tests' fakes may not)
                head.running_requests = lambda: self.in_flight   # strategy `auto` weighs its predictions by it
            self.heads[sub.request_id] = head
            self.reserved[sub.request_id] = self.footprint(sub)
            log.debug("admitted request %d (%d running, %d queued)", sub.request_id, len(self.heads),
                      len(self.queue))
            actions += self._wrap(sub.request_id, head.start(sub.request_id, list(sub.prompt_ids),
                                                             sub.max_new_tokens, sub.params))
        return actions

    def _cancel(self, request_id: int) -> list:
        for sub in list(self.queue):
            if sub.request_id == request_id:
                self.queue.remove(sub)
                return [Done([], Stats(), request_id, cancelled=True)]
        head = self.heads.get(request_id)
        if head is None:
            return []
        head.finished = True
        actions: list = [Send(i, Finish(request_id)) for i in range(1, self.n_stages + 1)]
        actions.append(Done(list(head.outputs), head.stats, request_id, cancelled=True))
        return actions + self._release(request_id)

    def _wrap(self, request_id: int, actions: list) -> list:
        out: list = []
        ended = False
        for a in actions:
            if isinstance(a, Continue):
                a = Continue(Routed(request_id, a.event))
            elif isinstance(a, Done):
                ended = True
            out.append(a)
        return out + self._release(request_id) if ended else out

    def _release(self, request_id: int) -> list:
        self.ended[request_id] = self.heads.pop(request_id)
        self.reserved.pop(request_id, None)
        while len(self.ended) > ENDED_REMEMBERED:
            self.ended.pop(next(iter(self.ended)))
        return self._admit()


def _handle(head, events: list) -> list:
    """One request's events through its head, in order (its follow-ups come back as `Continue`s)."""
    actions: list = []
    for ev in events:
        actions += head.receive(ev)
    return actions
