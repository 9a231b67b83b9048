"""The simulated cluster: the real engine and real model math in one process, on a virtual clock.

Each node handles its messages in arrival order, one at a time; a `Compute` action advances the node's
clock by the cost model's time for that work, a `Send` occupies the directed link for latency + bytes /
bandwidth. Noise-free and repeatable, so strategies can be compared on devices we do not have.
"""
from __future__ import annotations

import heapq
import itertools
import logging
from dataclasses import dataclass
from typing import Callable

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
        tokens = 4 * n if msg.tokens is not None else 0    # chosen tokens travel as int32
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


class SimCluster:
    def __init__(self, head, stages: list, costs: CostModel | None = None) -> None:
        self.nodes = [head, *stages]
        self.costs = costs or CostModel.free()

    def run(self, request_id: int, prompt_ids: list[int], max_new_tokens: int, params,
            on_tokens: Callable[[list[int]], None] | None = None, max_events: int = 2_000_000) -> SimResult:
        trace = Trace()
        busy_until = [0.0] * len(self.nodes)
        link_free: dict[tuple[int, int], float] = {}
        queue: list = []
        order = itertools.count()
        state = {"done": None, "t": 0.0}

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
                    if on_tokens:
                        on_tokens(a.tokens)
                elif isinstance(a, Continue):
                    t = execute(node, t, self.nodes[node].receive(a.event))
                elif isinstance(a, Done):
                    state["done"], state["t"] = a, t
            return t

        busy_until[0] = execute(0, 0.0, self.nodes[0].start(request_id, prompt_ids, max_new_tokens, params))
        events = 0
        while queue and state["done"] is None:
            t, seq, node, msg = heapq.heappop(queue)
            if t < busy_until[node]:
                heapq.heappush(queue, (busy_until[node], seq, node, msg))
                continue
            events += 1
            if events > max_events:
                raise RuntimeError("simulation did not finish: event budget exhausted")
            busy_until[node] = execute(node, t, self.nodes[node].receive(msg))
        if state["done"] is None:
            raise RuntimeError("simulation stalled: the pipeline went idle before the request finished")
        # Let stages see the Finish messages so their caches are released.
        for _, _, node, msg in sorted(queue):
            if isinstance(msg, Finish) and node:
                self.nodes[node].receive(msg)
        return SimResult(state["done"], state["t"], trace)


def _lane(node: int) -> str:
    return "node0 (head)" if node == 0 else f"stage{node}"
