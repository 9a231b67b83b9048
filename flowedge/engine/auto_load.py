"""How requests sharing the pipeline, and a drafter board, change each strategy's rate: the cost side of
strategy `auto`'s prediction (engine/auto_policy.Prediction), from the profiles' batched costs
(costs/sizing.TreeCosts)."""
from __future__ import annotations

from dataclasses import dataclass

FLOWSPEC, AR_PP, PIPEDEC = "flowspec", "ar-pp", "pipedec"


def _at(costs: tuple[float, ...], k: float) -> float:
    """`costs[i]` is the cost for i + 1 requests; linear in between, the last one past the end."""
    k = min(max(k, 1.0), float(len(costs)))
    lo = int(k)
    hi = min(lo + 1, len(costs))
    return costs[lo - 1] + (k - lo) * (costs[hi - 1] - costs[lo - 1])


@dataclass(frozen=True)
class DrafterCosts:
    """A drafter board that pre-drafts for node 0. Node 0's draft call is what limits flowspec's
    step; with a drafter, a returning segment whose outcome was pre-drafted (a hit) costs node 0 only the
    drafter's answer over the link, and a miss still costs node 0 its own call."""
    link_rtt_s: float      # node 0 -> drafter -> node 0 for one pre-drafted expansion
    hit_rate: float        # returning segments whose outcome the drafter had pre-drafted

    def __post_init__(self) -> None:
        if not (0.0 <= self.hit_rate <= 1.0) or self.link_rtt_s < 0:
            raise ValueError(f"hit_rate in [0, 1] and link_rtt_s >= 0, got {self.hit_rate}, {self.link_rtt_s}")

    def call_s(self, call_s: float) -> float:
        """What node 0's `call_s` draft call leaves on flowspec's critical path: the link on a hit, the call
        itself on a miss."""
        return self.hit_rate * min(self.link_rtt_s, call_s) + (1.0 - self.hit_rate) * call_s


@dataclass(frozen=True)
class LoadModel:
    """How one request's rate falls as `load` requests share the pipeline (1 alone).

    ar-pp: each request keeps one token circulating through the stages, so the aggregate grows with the
    requests until the slowest stage is busy all the time, and from there as that stage batches the
    tokens waiting at it (requests / stages of them, at `ar_batch_s`). flowspec (and pipedec): every
    request needs node 0's draft call and a stage step per segment. A call serves its own request and
    each other one whose segment came back while it ran (once per trip through the pipeline): about
    1 + (load - 1) x call / trip of them (on the Orin profile 1.49, 2.46 and 4.4 at 2, 4 and 8; the
    simulator measured 1.41, 2.18 and 4.06 per draft call, docs/bench/orin-nano-concurrency-8), and the
    step for that many costs the slower of their batched draft call and their batched stage segment."""
    token_latency_s: float              # one token through every stage, then the lm_head
    n_stages: int
    ar_batch_s: tuple[float, ...]       # the slowest stage's ar-pp step for 1, 2, ... requests' tokens
    pipeline_latency_s: float = 0.0     # an l_max segment through every stage
    draft_batch_s: tuple[float, ...] = ()   # one draft call for 1, 2, ... requests' expansions
    flow_batch_s: tuple[float, ...] = ()    # the slowest stage on 1, 2, ... requests' mean segments
    drafter: DrafterCosts | None = None   # flowspec's draft calls pre-drafted on a drafter board

    def factor(self, strategy: str, load: int) -> float:
        if load <= 1:
            return 1.0
        if strategy == AR_PP:
            return self._ar(load)
        return self._drafting(load, self.drafter if strategy == FLOWSPEC else None)

    def _ar(self, load: int) -> float:
        if self.token_latency_s <= 0 or not self.ar_batch_s or self.ar_batch_s[0] <= 0:
            return 1.0
        batch = max(1.0, load / max(1, self.n_stages))   # tokens waiting at a stage when it is saturated
        aggregate = min(load / self.token_latency_s, batch / _at(self.ar_batch_s, batch))
        return min(1.0, aggregate * self.token_latency_s / load)

    def _drafting(self, load: int, drafter: DrafterCosts | None = None) -> float:
        """(A drafter leaves each call's requests as they were, the calls run on it, and only the part of
        the call node 0 waits for in the step.)"""
        calls, stages = self.draft_batch_s, self.flow_batch_s
        if not calls or calls[0] <= 0 or self.pipeline_latency_s <= 0:
            return 1.0

        def step_s(requests: float) -> float:   # node 0's batched call or the slowest stage's, the slower
            call_s = _at(calls, requests)
            call_s = drafter.call_s(call_s) if drafter is not None else call_s
            return max(call_s, _at(stages, requests) if stages else 0.0)

        k = self._per_call(load)
        speedup = min(float(load), max(1.0, k * step_s(1.0) / step_s(k)))   # the aggregate over one alone
        return speedup / load

    def _per_call(self, load: int) -> float:
        """Requests one draft call serves: its own and those whose segment came back while it ran."""
        return 1.0 + (load - 1) * min(1.0, self.draft_batch_s[0] / self.pipeline_latency_s)

    def ar_among_speculating(self, load: int) -> float | None:
        """One ar-pp request's tok/s while the `load - 1` others speculate: its token waits behind their
        batched segment at every stage and behind node 0's batched draft call (measured on the Orin profile,
        128-token answers: 6.7 tok/s at 2 requests, 4.1 at 8; this gives 7.3 and 3.6; all on ar-pp 13.6
        and 9.1). None where the costs are unknown."""
        if load <= 1 or not self.draft_batch_s or not self.flow_batch_s or self.pipeline_latency_s <= 0:
            return None
        k = self._per_call(load)
        return 1.0 / (self.n_stages * _at(self.flow_batch_s, k) + _at(self.draft_batch_s, k))
