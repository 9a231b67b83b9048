"""The simulated cluster: the real engine and real model math in one process, on a virtual clock.

Each node handles its messages in arrival order, one at a time; a `Compute` action advances the node's
clock by the cost model's time for that work, a `Send` crosses the directed link as costs/link_costs.py
prices it (serialisation, latency, jitter and stalls drawn from a seeded stream per link). Repeatable,
so strategies can be compared on devices we do not have.

Node 0 runs the request scheduler the daemon's head runs (engine/scheduler.py): admission, KV budget,
draft batching, cancel, and on a stage loss (a `StageFault` in the plan) pause and replay.
"""
from __future__ import annotations

import heapq
import itertools
import logging
from dataclasses import dataclass, field
from typing import Callable

from flowedge.core.config import SpecConfig
from flowedge.core.sampling import SamplingParams
from flowedge.costs.link_costs import LinkClocks
from flowedge.costs.pipeline import CostModel
from flowedge.engine.draft_sync import DrafterDevice, ReplicaBehind
from flowedge.engine.events import Compute, Done, Finish, Offload, Prune, Segment, Send, Stats
from flowedge.engine.predraft import PreDrafted
from flowedge.engine.jobs import (Cancelled, Emitted, Failed, Finished, FromEngine, Job, Limits, ResetStages,
                                  kv_need)
from flowedge.engine.scheduler import Scheduler
from flowedge.errors import ConfigError
from flowedge.sim.trace import Trace, TraceEvent

log = logging.getLogger(__name__)

WIRE_HIDDEN_BYTES = 2      # hidden states travel as fp16/bf16
HEADER_BYTES = 96          # msgpack header, measured order of magnitude


def message_bytes(msg) -> int:
    """On-wire size of a message: header + payload at wire dtypes (int16/int32 ids, 16-bit hidden)."""
    if isinstance(msg, Segment):
        n = len(msg)
        chose = msg.hidden is None   # the last stage chose tokens
        hidden = 0 if msg.hidden is None else msg.hidden.shape[-1] * n * WIRE_HIDDEN_BYTES
        tokens = 4 * n if chose else 0    # chosen tokens travel as int32 (charged per row, as before 1.4)
        return HEADER_BYTES + hidden + tokens + 3 * n * 4
    if isinstance(msg, Prune):
        return HEADER_BYTES + 4 * (msg.prune.commit.numel() + msg.prune.keep.numel())
    return HEADER_BYTES


@dataclass
class SimResult:
    done: Done
    sim_time_s: float
    trace: Trace


@dataclass(frozen=True, slots=True)
class BatchConfig:
    """How many requests share the simulated pipeline, and the KV tokens each stage may hold for all of them."""
    max_concurrent: int = 4
    kv_budget_tokens: int | None = None   # None: limited by max_concurrent only
    batch_drafts: bool = True             # node 0 runs the requests' draft calls as shared forwards
    recovery_s: float = 30.0              # a paused request's wait for a lost stage (simulated seconds)

    def __post_init__(self) -> None:
        if self.kv_budget_tokens is not None and self.kv_budget_tokens < 1:
            raise ConfigError(f"kv budget must be >= 1 token (got {self.kv_budget_tokens})")
        Limits(max_running=self.max_concurrent)   # checks it

    def limits(self) -> Limits:
        return Limits(max_running=self.max_concurrent, recovery_s=self.recovery_s)


@dataclass(frozen=True, slots=True)
class StageFault:
    """Stage `stage` dies at `at_s` (its KV and everything it holds are gone, messages to it are lost) and a
    fresh process takes its slot at `back_s` (simulated seconds). Node 0 learns of the loss `detect_s` later
    (the daemon: a closed connection at once, missed heartbeats after `stage_timeout_s`)."""
    stage: int
    at_s: float
    back_s: float
    detect_s: float = 0.0

    def __post_init__(self) -> None:
        if self.stage < 1 or not 0 <= self.at_s < self.back_s or self.detect_s < 0:
            raise ConfigError(f"a stage fault needs stage >= 1 and 0 <= at_s < back_s (got {self})")


@dataclass(frozen=True, slots=True)
class SimRequest:
    """A request arriving at node 0 at `arrival_s`; `cancel_s`: its client goes away then."""
    request_id: int
    prompt_ids: tuple[int, ...]
    max_new_tokens: int
    params: SamplingParams = SamplingParams()
    arrival_s: float = 0.0
    cancel_s: float | None = None


@dataclass
class RequestTiming:
    """When one request's tokens came out, on the virtual clock."""
    arrival_s: float
    emits: list[tuple[float, int]] = field(default_factory=list)   # (time, tokens in that Emit)
    done: Done | None = None
    finish_s: float | None = None
    failed: str | None = None      # why it ended without completing (the scheduler's message)
    replays: int = 0               # times it was replayed after a stage loss

    def token_gaps_s(self) -> list[float]:
        """Time between tokens: an Emit of k tokens after a gap g counts as k gaps of g/k (speculative
        decoding hands out tokens in bursts; this is the per-token pace the client sees)."""
        gaps, last = [], None
        for t, k in self.emits:
            if last is not None and k:
                gaps += [(t - last) / k] * k
            last = t
        return gaps


@dataclass
class MultiResult:
    requests: dict[int, RequestTiming]
    sim_time_s: float
    trace: Trace


@dataclass(frozen=True, slots=True)
class _Notice:
    """A stage's loss (`lost`) or return, as node 0 learns of it."""
    stage: int
    lost: bool


@dataclass(frozen=True, slots=True)
class _Wake:
    """Node 0's timer: a scheduler deadline falls due."""


@dataclass(frozen=True, slots=True)
class _IdleTurn:
    """Node 0 finished a piece of idle work: look at what arrived, then maybe do the next."""


@dataclass(frozen=True, slots=True)
class _Delivery:
    """The drafter device's answer to request `key`'s offloaded work, arriving at node 0."""
    key: int
    event: object


class SimCluster:
    """Every node takes all the messages that arrived while it was busy at once: a stage batches several
    requests' segments into one forward (`StageWorker.receive_all`), node 0 steps its scheduler, which
    batches their draft calls. `head`: a `Scheduler`, or one engine `Head` (`run`)."""

    def __init__(self, head, stages: list, costs: CostModel | None = None, faults: tuple[StageFault, ...] = (),
                 spec: SpecConfig | None = None, drafter: DrafterDevice | None = None) -> None:
        self.nodes = [head, *stages]
        self.drafter = drafter   # the drafter device's engine (predraft = drafter); None: jobs go unanswered
        self.costs = costs or CostModel.free()
        self.faults = tuple(faults)
        self.spec = spec   # a job's KV need is worked out from it (None: no KV budget to keep)
        if any(f.stage >= len(self.nodes) for f in self.faults):
            raise ConfigError(f"a stage fault names a stage this {len(stages)}-stage cluster lacks")

    def run(self, request_id: int, prompt_ids: list[int], max_new_tokens: int, params,
            on_tokens: Callable[[list[int]], None] | None = None, max_events: int = 2_000_000) -> SimResult:
        """One request through a plain Head (the single-request path)."""
        head = self.nodes[0]
        self.nodes[0] = Scheduler.single(head)
        try:
            sink = (lambda rid, tokens: on_tokens(tokens)) if on_tokens else None
            res = self.run_many([SimRequest(request_id, tuple(prompt_ids), max_new_tokens, params)], sink,
                                max_events)
        finally:
            self.nodes[0] = head
        timing = res.requests[request_id]
        if timing.done is None or timing.finish_s is None:   # run_many raises on a request left unfinished
            raise RuntimeError(f"request {request_id} did not finish")
        return SimResult(timing.done, timing.finish_s, res.trace)

    def run_many(self, requests: list[SimRequest], on_tokens: Callable[[int, list[int]], None] | None = None,
                 max_events: int = 2_000_000) -> MultiResult:
        """Several requests through the scheduler on node 0; returns each one's token timings."""
        return _SimRun(self, requests, on_tokens).run(max_events)

    def job(self, r: SimRequest) -> Job:
        need = kv_need(self.spec, len(r.prompt_ids), r.max_new_tokens) if self.spec is not None else 0
        return Job(tuple(r.prompt_ids), r.max_new_tokens, r.params, kv_tokens=need)


class _SimRun:
    """One simulation: the event queue, the nodes' and links' busy times, the requests' timings."""

    def __init__(self, cluster: SimCluster, requests: list[SimRequest], on_tokens) -> None:
        self.cluster, self.nodes, self.costs = cluster, cluster.nodes, cluster.costs
        self.sched: Scheduler = cluster.nodes[0]
        self.on_tokens = on_tokens
        self.trace = Trace()
        self.busy_until = [0.0] * len(self.nodes)
        self.link_free: dict[tuple[int, int], float] = {}
        self.links = LinkClocks(self.costs.link, self.costs.link_seed) if self.costs.link is not None else None
        self.queue: list = []
        self.order = itertools.count()
        self.timings = {r.request_id: RequestTiming(r.arrival_s) for r in requests}
        self.down: set[int] = set()   # stages lost now
        self.wake_s: float | None = None
        self.drafter_free = 0.0       # the drafter device (node 0's kind of board): busy until
        self.idle_pending = False     # an _IdleTurn is queued
        for r in requests:
            self._push(r.arrival_s, 0, r)
            if r.cancel_s is not None:
                self._push(r.cancel_s, 0, ("cancel", r.request_id))
        for f in cluster.faults:
            self._push(f.at_s, -1, _Notice(f.stage, True))
            self._push(f.back_s, -1, _Notice(f.stage, False))

    def _push(self, t: float, node: int, msg) -> None:
        heapq.heappush(self.queue, (t, next(self.order), node, msg))

    def run(self, max_events: int) -> MultiResult:
        events = 0
        while self.queue and any(tm.finish_s is None for tm in self.timings.values()):
            t, seq, node, msg = heapq.heappop(self.queue)
            if node == -1:
                self._fault(t, msg)
                continue
            if t < self.busy_until[node]:
                heapq.heappush(self.queue, (self.busy_until[node], seq, node, msg))
                continue
            events += 1
            if events > max_events:
                raise RuntimeError("simulation did not finish: event budget exhausted")
            if node == 0:
                self.busy_until[0] = self._node0(t, [msg, *_take_arrived(self.queue, 0, t)])
            elif node not in self.down:
                arrived = [msg, *_take_arrived(self.queue, node, t)]
                self.busy_until[node] = self._execute(node, t, self.nodes[node].receive_all(arrived))
        finishes = [tm.finish_s for tm in self.timings.values() if tm.finish_s is not None]
        if len(finishes) < len(self.timings):
            raise RuntimeError("simulation stalled: the pipeline went idle before every request finished")
        # Let stages see the Finish messages so their caches are released.
        for _, _, node, msg in sorted(self.queue, key=lambda e: e[:2]):
            if isinstance(msg, Finish) and node > 0 and node not in self.down:
                self.nodes[node].receive(msg)
        return MultiResult(self.timings, max(finishes), self.trace)

    def _fault(self, t: float, notice: _Notice) -> None:
        """A stage dies (everything it held is gone) or a fresh one takes its slot; node 0 hears of it."""
        if notice.lost:
            self.down.add(notice.stage)
            self.nodes[notice.stage].reset()
            detect = next(f.detect_s for f in self.cluster.faults if f.stage == notice.stage and f.at_s == t)
            self._push(t + detect, 0, notice)
            log.info("simulated stage %d lost at %.3f s", notice.stage, t)
        else:
            self.down.discard(notice.stage)
            self.busy_until[notice.stage] = t
            self._push(t, 0, notice)
            log.info("simulated stage %d back at %.3f s", notice.stage, t)

    def _node0(self, t: float, messages: list) -> float:
        """Node 0 takes what arrived, then steps the scheduler — one piece of work per request per step,
        the requests' draft calls sharing forwards — taking new arrivals between steps, until it has no
        work; admissions and replays happen on the ticks between."""
        t = self._arrive(t, messages)
        t = self._execute(0, t, self.sched.tick(t, not self.down))
        while self.sched.has_work():
            t = self._execute(0, t, self.sched.step(t))
            t = self._arrive(t, _take_arrived(self.queue, 0, t))
            t = self._execute(0, t, self.sched.tick(t, not self.down))
        if self.sched.has_idle_work() and not self.idle_pending:
            # One piece of idle work (one draft call), then back to the event loop: what the other nodes
            # send meanwhile reaches node 0 before its next piece.
            t = self._execute(0, t, self.sched.idle_step(t))
            self.idle_pending = True
            self._push(t, 0, _IdleTurn())
        due = self.sched.next_deadline()
        if due is not None and due != self.wake_s:
            self.wake_s = due
            self._push(due + 1e-9, 0, _Wake())
        return t

    def _arrive(self, t: float, messages: list) -> float:
        for m in messages:
            if isinstance(m, _IdleTurn):
                self.idle_pending = False
            elif isinstance(m, SimRequest):
                t = self._execute(0, t, self.sched.submit(m.request_id, self.cluster.job(m), t))
            elif isinstance(m, tuple):   # ("cancel", request id)
                t = self._execute(0, t, self.sched.cancel(m[1]))
            elif isinstance(m, Segment):
                self.sched.add_work(m.run_id, m, t)   # the engine drops rounds that ended (engine/head.py)
            elif isinstance(m, _Delivery):
                self.sched.deliver(m.key, m.event)
            elif isinstance(m, _Notice) and m.lost:
                t = self._execute(0, t, self.sched.stage_lost(f"stage {m.stage} lost", t))
        return t

    def _execute(self, node: int, t: float, actions: list) -> float:
        """Carry out a node's actions in order: compute advances its clock, sends occupy links."""
        for a in actions:
            key, a = (a.key, a.action) if isinstance(a, FromEngine) else (None, a)
            if isinstance(a, Offload):
                if key is None:   # engines make them, and the scheduler names the request of each
                    raise RuntimeError(f"an offload outside any request: {a!r}")
                self._offload(t, key, a)
            elif isinstance(a, Compute):
                t = self._compute(node, t, a)
            elif isinstance(a, Send):
                self._send(node, t, a)
            elif isinstance(a, ResetStages):
                for i in range(1, len(self.nodes)):
                    self._send(node, t, Send(i, Finish(a.run_id)))
            else:
                self._record(t, a)
        return t

    def _compute(self, node: int, t: float, a: Compute) -> float:
        dur = self.costs.compute_s(node, a)
        if dur > 0:
            self.trace.add(TraceEvent(_lane(node), "compute", a.phase or a.what, t, t + dur, a.tokens, label=a.what))
        return t + dur

    def _offload(self, t: float, key: int, a: Offload) -> None:
        """The drafter device: the snapshot reaches it over its link, waits for its earlier jobs, is grown
        there (the same `DrafterDevice` the daemon's drafter runs, on the snapshot as it left node 0), its
        calls charged as node 0's kind of board runs them; the answer travels back to node 0."""
        growth = None
        if self.cluster.drafter is not None:
            try:
                growth = self.cluster.drafter.run(key, a.snapshot)
            except ReplicaBehind:
                growth = None
        calls = [Compute("draft", tokens, ctx, "predraft") for tokens, ctx, _ in (growth.calls if growth else [])]
        arrived = self._over_link((0, -1), t, a.request_bytes)   # jobs queue on the link as segments do
        start = max(arrived, self.drafter_free)
        end = start + sum(self.costs.compute_s(0, c) for c in calls)
        if end > start:
            self.trace.add(TraceEvent("drafter", "compute", "predraft", start, end, sum(c.tokens for c in calls)))
        self.drafter_free = end
        reply = growth.nbytes() if growth is not None else 16
        self._push(self._over_link((-1, 0), end, reply), 0, _Delivery(key, PreDrafted(a.job, growth)))

    def _over_link(self, link: tuple[int, int], t: float, nbytes: int) -> float:
        """When `nbytes` sent at `t` have crossed `link` (-1: the drafter), after what it already carries."""
        return self._cross(link[0], link[1], t, nbytes)[1]

    def _cross(self, src: int, dst: int, t: float, nbytes: int) -> tuple[float, float]:
        """(start, arrival) of a message: on the link clocks (costs/link_costs.py) where the costs name a
        link profile, else each link carries one message at a time for `transfer_s`."""
        if self.links is not None:
            c = self.links.send(src, dst, t, nbytes)
            return c.start_s, c.arrive_s
        start = max(t, self.link_free.get((src, dst), 0.0))
        end = self.link_free[(src, dst)] = start + self.costs.transfer_s(src, dst, nbytes)
        return start, end

    def _send(self, node: int, t: float, a: Send) -> None:
        if node in self.down:
            return   # a dead stage sends nothing
        nbytes = message_bytes(a.message)
        start, end = self._cross(node, a.to, t, nbytes)
        if end > start:
            phase = getattr(a.message, "phase", type(a.message).__name__.lower())
            self.trace.add(TraceEvent(f"link{node}->{a.to}", "transfer", phase, start, end,
                                      len(a.message) if isinstance(a.message, Segment) else 0, nbytes))
        self._push(end, a.to, a.message)

    def _record(self, t: float, a) -> None:
        """A request's tokens or its end, on the virtual clock."""
        timing = self.timings[a.key]
        if isinstance(a, Emitted):
            timing.emits.append((t, len(a.tokens)))
            if self.on_tokens:
                self.on_tokens(a.key, a.tokens)
            return
        if isinstance(a, Failed):
            req = self.sched.get(a.key)
            timing.failed = a.message
            a = Cancelled(a.key, Done(list(req.emitted) if req else [], Stats(), a.key))
        if isinstance(a, (Finished, Cancelled)):
            timing.done, timing.finish_s = a.done, t
            req = self.sched.get(a.key)
            timing.replays = req.replays if req is not None else 0


def _take_arrived(queue: list, node: int, t: float) -> list:
    """Pop every message for `node` that has arrived by `t`, in arrival (then send) order."""
    mine = sorted((e for e in queue if e[2] == node and e[0] <= t), key=lambda e: e[:2])
    if mine:
        queue[:] = [e for e in queue if not (e[2] == node and e[0] <= t)]
        heapq.heapify(queue)
    return [e[3] for e in mine]


def _lane(node: int) -> str:
    return "node0 (head)" if node == 0 else f"stage{node}"
