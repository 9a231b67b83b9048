"""The simulated cluster: the real engine and real model math in one process, on a virtual clock.

Each node handles its messages in arrival order, one at a time; a `Compute` action advances the node's
clock by the cost model's time for that work, a `Send` occupies the directed link for latency + bytes /
bandwidth. Noise-free and repeatable, so strategies can be compared on devices we do not have.
"""
from __future__ import annotations

import heapq
import itertools
import logging
from dataclasses import dataclass, field
from typing import Callable

from flowedge.core.sampling import SamplingParams
from flowedge.engine.events import Compute, Continue, Done, Emit, Finish, Prune, Segment, Send
from flowedge.sim.sizing import TreeCosts
from flowedge.sim.trace import Trace, TraceEvent

log = logging.getLogger(__name__)

WIRE_HIDDEN_BYTES = 2      # hidden states travel as fp16/bf16
HEADER_BYTES = 96          # msgpack header, measured order of magnitude


def message_bytes(msg) -> int:
    """On-wire size of a message: header + payload at wire dtypes (int16/int32 ids, 16-bit hidden)."""
    if isinstance(msg, Segment):
        n = len(msg)
        hidden = msg.hidden.shape[-1] * n * WIRE_HIDDEN_BYTES if msg.hidden.dim() == 2 else 0
        chose = msg.hidden.dim() == 2 and msg.hidden.shape[-1] == 0   # the last stage chose tokens
        tokens = 4 * n if chose else 0    # chosen tokens travel as int32 (charged per row, as before 1.4)
        return HEADER_BYTES + hidden + tokens + 3 * n * 4
    if isinstance(msg, Prune):
        return HEADER_BYTES + 4 * (msg.prune.commit.numel() + msg.prune.keep.numel())
    return HEADER_BYTES


@dataclass
class CostModel:
    """Turns Compute actions and message sizes into seconds; None profile = free (tests)."""
    compute_s: Callable[[int, Compute], float]
    transfer_s: Callable[[int, int, int], float]
    lm_head_segment_ratio: float | None = None   # last stage's l_max-token / 1-token lm_head (placement)
    tree: TreeCosts | None = None                # what flowspec's tree is sized from (None: no draft)

    @staticmethod
    def free() -> "CostModel":
        return CostModel(lambda node, c: 0.0, lambda a, b, n: 0.0)


@dataclass
class SimResult:
    done: Done
    sim_time_s: float
    trace: Trace


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


class SimCluster:
    """Every node takes all the messages that arrived while it was busy at once: a stage batches several
    requests' segments into one forward (`StageWorker.receive_all`), node 0 their draft calls
    (`MultiHead.receive_all`)."""

    def __init__(self, head, stages: list, costs: CostModel | None = None) -> None:
        self.nodes = [head, *stages]
        self.costs = costs or CostModel.free()

    def run(self, request_id: int, prompt_ids: list[int], max_new_tokens: int, params,
            on_tokens: Callable[[list[int]], None] | None = None, max_events: int = 2_000_000) -> SimResult:
        """One request through a plain Head (today's single-request path)."""
        from flowedge.engine.scheduler import MultiHead

        head = self.nodes[0]
        self.nodes[0] = MultiHead.around(head)
        try:
            sink = (lambda rid, tokens: on_tokens(tokens)) if on_tokens else None
            res = self.run_many([SimRequest(request_id, tuple(prompt_ids), max_new_tokens, params)], sink,
                                max_events)
        finally:
            self.nodes[0] = head
        timing = res.requests[request_id]
        return SimResult(timing.done, timing.finish_s, res.trace)

    def run_many(self, requests: list[SimRequest], on_tokens: Callable[[int, list[int]], None] | None = None,
                 max_events: int = 2_000_000) -> MultiResult:
        """Several requests through a `MultiHead` on node 0; returns each one's token timings."""
        from flowedge.engine.scheduler import Cancel, Submit

        trace = Trace()
        busy_until = [0.0] * len(self.nodes)
        link_free: dict[tuple[int, int], float] = {}
        queue: list = []
        order = itertools.count()
        timings = {r.request_id: RequestTiming(r.arrival_s) for r in requests}
        follow_ups: list = []
        now = [0.0]   # virtual time of the work node 0 is doing: the heads' clock (strategy `auto`)
        if hasattr(self.nodes[0], "clock"):
            self.nodes[0].clock = lambda: now[0]

        def execute(node: int, t: float, actions: list) -> float:
            for a in actions:
                if isinstance(a, Compute):
                    dur = self.costs.compute_s(node, a)
                    if dur > 0:
                        trace.add(TraceEvent(_lane(node), "compute", a.phase or a.what, t, t + dur, a.tokens,
                                             label=a.what))
                    t += dur
                elif isinstance(a, Send):
                    nbytes = message_bytes(a.message)
                    start = max(t, link_free.get((node, a.to), 0.0))
                    end = start + self.costs.transfer_s(node, a.to, nbytes)
                    link_free[(node, a.to)] = end
                    if end > start:
                        phase = getattr(a.message, "phase", type(a.message).__name__.lower())
                        trace.add(TraceEvent(f"link{node}->{a.to}", "transfer", phase, start, end,
                                             len(a.message) if isinstance(a.message, Segment) else 0, nbytes))
                    heapq.heappush(queue, (end, next(order), a.to, a.message))
                elif isinstance(a, Emit):
                    timings[a.request_id].emits.append((t, len(a.tokens)))
                    if on_tokens:
                        on_tokens(a.request_id, a.tokens)
                elif isinstance(a, Continue):
                    follow_ups.append(a.event)
                elif isinstance(a, Done):
                    timings[a.request_id].done, timings[a.request_id].finish_s = a, t
            return t

        def step_node0(t: float, events: list) -> float:
            """Node 0 takes one piece of work per request per step: its follow-ups (`Continue`) first,
            depth-first, then its messages in arrival order — the order of work it would have alone — while
            the steps interleave the requests, so one request's pipeline fill and another's verification
            share a step and their draft calls share forwards."""
            work: dict[int, list] = {}
            for m in events:
                work.setdefault(m.request_id, []).append(m)
            while work:
                step = [chain.pop(0) for chain in work.values()]
                work = {rid: chain for rid, chain in work.items() if chain}
                follow_ups.clear()
                now[0] = t
                t = execute(0, t, self.nodes[0].receive_all(step))
                for rid in dict.fromkeys(e.request_id for e in follow_ups):
                    work[rid] = [e for e in follow_ups if e.request_id == rid] + work.get(rid, [])
                if work:
                    for m in _take_arrived(queue, 0, t):
                        work.setdefault(m.request_id, []).append(m)
            return t

        for r in requests:
            heapq.heappush(queue, (r.arrival_s, next(order), 0,
                                   Submit(r.request_id, tuple(r.prompt_ids), r.max_new_tokens, r.params)))
            if r.cancel_s is not None:
                heapq.heappush(queue, (r.cancel_s, next(order), 0, Cancel(r.request_id)))
        events = 0
        while queue and any(tm.done is None for tm in timings.values()):
            t, seq, node, msg = heapq.heappop(queue)
            if t < busy_until[node]:
                heapq.heappush(queue, (busy_until[node], seq, node, msg))
                continue
            events += 1
            if events > max_events:
                raise RuntimeError("simulation did not finish: event budget exhausted")
            if node == 0:
                busy_until[0] = step_node0(t, [msg, *_take_arrived(queue, 0, t)])
            else:
                busy_until[node] = execute(node, t, self.nodes[node].receive_all([msg, *_take_arrived(queue, node, t)]))
        if any(tm.done is None for tm in timings.values()):
            raise RuntimeError("simulation stalled: the pipeline went idle before every request finished")
        # Let stages see the Finish messages so their caches are released.
        for _, _, node, msg in sorted(queue):
            if isinstance(msg, Finish) and node:
                self.nodes[node].receive(msg)
        return MultiResult(timings, max(tm.finish_s for tm in timings.values()), trace)


def _take_arrived(queue: list, node: int, t: float) -> list:
    """Pop every message for `node` that has arrived by `t`, in arrival (then send) order."""
    mine = sorted(e for e in queue if e[2] == node and e[0] <= t)
    if mine:
        queue[:] = [e for e in queue if not (e[2] == node and e[0] <= t)]
        heapq.heapify(queue)
    return [e[3] for e in mine]


def _lane(node: int) -> str:
    return "node0 (head)" if node == 0 else f"stage{node}"
