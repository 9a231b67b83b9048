"""`auto`'s decisions, as plain numbers: which strategy to run next, and why.

Two sources, in this order of trust:

1. **Measured rates.** Tokens emitted over seconds spent while a strategy ran, per request (the head's
   clock: virtual on the simulator, wall on the daemon). A strategy's rate counts once it has produced
   `AutoPolicy.window_tokens` tokens.
2. **The prediction** from the cluster's device profiles (`Prediction.from_costs`): ar-pp sends one token
   through every stage per output token; flowspec keeps the pipeline full and accepts about
   `ACCEPT_PER_STEP` tokens per segment that returns, one segment per step of its slowest device (a stage
   on a mean segment, or node 0's draft call). Where a strategy has no measurement yet, its predicted rate
   (flowspec's) is scaled by how far ar-pp's measurement is from its own prediction (profiles may be off
   in absolute speed, as real processes here are, but the ratio holds better).

**Answer length.** Every choice weighs the tokens the answer still has to go (`RoundView.tokens_left`): a
speculative start (the draft's prefill, the first tree, its first trip through the pipeline; none of which
ar-pp pays) costs about `START_TOKENS` of its own tokens, so over n tokens left flowspec runs at
rate x n / (n + START_TOKENS). Short answers favour ar-pp, long ones flowspec: on the Orin profile at 8
concurrent requests flowspec is predicted 1.18x ar-pp per request, which pays from ~90 tokens left on (the
sweep, docs/bench/orin-nano-concurrency-8/length-aware: ar-pp 10% ahead at 64 tokens, flowspec 1% ahead at 128;
an earlier build had flowspec 11% ahead at 128 while `auto`, without the length, stayed on ar-pp).

A fall-back from flowspec to ar-pp is tried again after `probe_tokens` tokens, then twice as many after
each try that did not pay; where the profiles already predict ar-pp, flowspec is never probed (a probe
would cost the request time on exactly the devices where speculation cannot pay).

**Load.** Requests that share the pipeline (engine/scheduler.py, in the simulator and the daemon alike) slow each
other down, each strategy differently (`engine/auto_load.LoadModel`), so every prediction is taken at the number of
requests running: the first choice (made when a request's first round starts), the comparisons with a
measured rate after it (comparing a loaded flowspec measurement with ar-pp alone made `auto` fall back at
4 concurrent requests on the Orin profile, where flowspec's aggregate is 1.23x ar-pp's:
docs/bench/orin-nano-concurrency-auto), and a request that started on ar-pp because of the load goes
speculative once the load has fallen enough.
"""
from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

from flowedge.costs.sizing import TreeCosts
from flowedge.engine.auto_load import AR_PP, FLOWSPEC, PIPEDEC, DrafterCosts, LoadModel

__all__ = ["AR_PP", "FLOWSPEC", "PIPEDEC", "START_TOKENS", "AutoPolicy", "Chooser", "DrafterCosts", "LoadModel",
           "Prediction", "predict_from_costs"]

SPECULATIVE = (FLOWSPEC, PIPEDEC)   # what auto may run instead of ar-pp (same lm_head placement)
# flowspec: tokens accepted per returning segment in the steady state, and tokens per round (each round
# restart costs a trip through the pipeline). Fitted to the real pair's simulated runs: 5 x Orin Nano 33.6
# tok/s at a 35.6 ms draft-call step and 73 ms pipeline (the first Orin Nano benchmark), 70B over 14 Orin Nanos at an
# 88 ms stage step and 1.19 s pipeline (docs/bench/orin-nano-70b-14stages). Before the 70B fit flowspec
# was 1.2 tokens per step with no restart term: the same on 5 nodes, where a restart costs two steps.
ACCEPT_PER_STEP = 1.73
ROUND_TOKENS = 8.0
# A speculative start costs about as long as this many of its own tokens at the same load (fitted to the Orin
# sweep at 8 concurrent: flowspec's first token 0.26 s after ar-pp's, and its last request ending later);
# one round's worth: the rate above charges a trip through the pipeline every ROUND_TOKENS.
START_TOKENS = ROUND_TOKENS
# pipedec: the chance the base's token is in the level that comes back (one level per step; a miss costs
# a trip through the pipeline), fitted on the same 70B runs.
PIPEDEC_HIT = 0.84


@dataclass(frozen=True)
class Prediction:
    """Tokens per second the profiles predict for each strategy (one request alone), and how a request's
    rate scales when several share the pipeline (`load`; None: as alone)."""
    rates: dict[str, float]
    source: str = "profiles"
    load: LoadModel | None = None
    undrafted: "Prediction | None" = None   # with a drafter: the same cluster's prediction without it

    def load_factor(self, strategy: str, running: int) -> float:
        return self.load.factor(strategy, running) if self.load is not None else 1.0

    def at_load(self, running: int) -> dict[str, float]:
        """Each strategy's predicted rate for one request among `running` ones. Never below the rate without
        the drafter: one that lags leaves node 0 drafting alone."""
        rates = {s: r * self.load_factor(s, running) for s, r in self.rates.items()}
        if self.undrafted is not None:
            rates = {s: max(r, self.undrafted.at_load(running)[s]) for s, r in rates.items()}
        return rates

    def ar_among_speculating(self, running: int) -> float | None:
        """ar-pp's rate for one request that falls back while the others speculate (`LoadModel`)."""
        among = self.load.ar_among_speculating(running) if self.load is not None else None
        return None if among is None else min(among, self.at_load(running)[AR_PP])

    @property
    def speculative(self) -> str:
        """The speculative strategy predicted fastest (flowspec on a tie)."""
        return max((s for s in SPECULATIVE if s in self.rates), key=lambda s: (self.rates[s], s == FLOWSPEC))

    @staticmethod
    def from_costs(token_latency_s: float, flow_step_s: float, draft_call_s: float,
                   accept_per_step: float = ACCEPT_PER_STEP, *, pipeline_latency_s: float = 0.0,
                   segment_step_s: float = 0.0, n_stages: int = 0, ar_batch_s: tuple[float, ...] = (),
                   draft_batch_s: tuple[float, ...] = (), flow_batch_s: tuple[float, ...] = (),
                   drafter: DrafterCosts | None = None) -> "Prediction | None":
        """From the profile costs (costs/sizing.TreeCosts); None where the costs are unknown (free).

        Seconds per token: flowspec step / accept_per_step + pipeline latency / ROUND_TOKENS; pipedec
        (where `segment_step_s`, a stage's l_max-token segment, is known) one level per step of the
        slower of that and the draft call when it hits, a trip through the pipeline when it misses.
        `n_stages` and the batched costs (where known) give the load model (`LoadModel`). A `drafter`
        takes node 0's draft call off flowspec's step where it pre-drafted the outcome (`DrafterCosts`);
        pipedec's levels are not pre-drafted."""
        if token_latency_s <= 0 or max(flow_step_s, draft_call_s) <= 0:
            return None
        undrafted = (Prediction.from_costs(token_latency_s, flow_step_s, draft_call_s, accept_per_step,
                                           pipeline_latency_s=pipeline_latency_s, segment_step_s=segment_step_s,
                                           n_stages=n_stages, ar_batch_s=ar_batch_s, draft_batch_s=draft_batch_s,
                                           flow_batch_s=flow_batch_s)
                     if drafter is not None else None)
        step_s = max(flow_step_s, drafter.call_s(draft_call_s) if drafter is not None else draft_call_s)
        rates = {AR_PP: 1.0 / token_latency_s,
                 FLOWSPEC: 1.0 / (step_s / accept_per_step + pipeline_latency_s / ROUND_TOKENS)}
        if segment_step_s > 0:
            level_s = max(segment_step_s, draft_call_s)
            rates[PIPEDEC] = 1.0 / (PIPEDEC_HIT * level_s + (1 - PIPEDEC_HIT) * (pipeline_latency_s + draft_call_s))
        load = (LoadModel(token_latency_s, n_stages, tuple(ar_batch_s), pipeline_latency_s, tuple(draft_batch_s),
                          tuple(flow_batch_s), drafter) if ar_batch_s and n_stages else None)
        return Prediction(rates, load=load, undrafted=undrafted)


def predict_from_costs(costs: TreeCosts, drafter: DrafterCosts | None = None) -> Prediction | None:
    """What strategy `auto` starts from: each strategy's tok/s on these costs (with a drafter board, where
    one pre-drafts for node 0)."""
    return Prediction.from_costs(costs.token_latency_s, costs.flow_step_s, costs.draft_call_s,
                                 pipeline_latency_s=costs.pipeline_latency_s, segment_step_s=costs.segment_step_s,
                                 n_stages=costs.n_stages, ar_batch_s=costs.ar_batch_s,
                                 draft_batch_s=costs.draft_batch_s, flow_batch_s=costs.flow_batch_s,
                                 drafter=drafter)


@dataclass(frozen=True)
class AutoPolicy:
    # flowspec is started only if predicted this much faster than ar-pp over the tokens left, its start
    # included (and a measured flowspec falls back only this much slower): the simulator and real
    # processes agree on the flowspec / ar-pp ratio within 7% (docs/design.md). 1.2 before the start was
    # priced; that kept ar-pp at 8 concurrent on the Orin profile at any length (predicted 1.18x there).
    margin: float = 1.08
    window_tokens: int = 16      # a measured rate counts after this many tokens
    probe_tokens: int = 32       # ar-pp tokens before flowspec is tried again after a fall-back
    max_probe_tokens: int = 512  # the doubling stops here
    unload_tokens: int = 64      # a request started on ar-pp for load goes speculative only with this many left


class _Meter:
    """Tokens and seconds over a strategy's recent observations (at most ~4 windows of tokens)."""

    def __init__(self, keep_tokens: int) -> None:
        self.samples: deque[tuple[int, float]] = deque()
        self.keep_tokens = keep_tokens
        self.tokens, self.seconds = 0, 0.0

    def add(self, tokens: int, seconds: float) -> None:
        self.samples.append((tokens, seconds))
        self.tokens += tokens
        self.seconds += seconds
        while len(self.samples) > 1 and self.tokens - self.samples[0][0] >= self.keep_tokens:
            t, s = self.samples.popleft()
            self.tokens -= t
            self.seconds -= s

    def rate(self, min_tokens: int) -> float | None:
        if self.tokens < min_tokens or self.seconds <= 0:
            return None
        return self.tokens / self.seconds

    def clear(self) -> None:
        self.samples.clear()
        self.tokens, self.seconds = 0, 0.0


class Chooser:
    """Per request: the current choice, the reason for it, and the switches made."""

    def __init__(self, prediction: Prediction | None, policy: AutoPolicy = AutoPolicy(),
                 load: Callable[[], int] = lambda: 1, tokens_left: int | None = None) -> None:
        self.prediction, self.policy = prediction, policy
        self.load = load   # requests running on the pipeline now, this one included
        self.tokens_left = tokens_left   # of the answer, when the first choice is made (None: unbounded)
        self.spec = prediction.speculative if prediction is not None else FLOWSPEC   # the one tried
        self.meters = {s: _Meter(4 * policy.window_tokens) for s in (self.spec, AR_PP)}
        self.tokens = {self.spec: 0, AR_PP: 0}
        self.switches: list[dict] = []
        self.probe_after = policy.probe_tokens
        self.since_switch = 0
        self.fell_back = False   # probes only follow a measured fall-back, never a predicted ar-pp
        self.initial_load = load()   # the first choice is made at it
        self.choice, self.reason = self._initial()
        self.initial = (self.choice, self.reason)
        self.starting = self.choice != AR_PP   # a speculative start not measured yet (see observe)

    def _initial(self) -> tuple[str, str]:
        if self.prediction is None:
            return FLOWSPEC, "no device profile for every node: flowspec, FlowSpec's default"
        running = self.initial_load
        speculate, words = self._profiles_speculate(self.prediction, running, self.tokens_left)
        among = "" if running <= 1 else f" (each of {running} requests)"
        return (self.spec if speculate else AR_PP), words + among

    @staticmethod
    def over(rate: float, tokens_left: int | None) -> float:
        """A speculative `rate` over the `tokens_left` of an answer, its start (`START_TOKENS`) included."""
        if tokens_left is None:
            return rate
        n = max(tokens_left, 1)
        return rate * n / (n + START_TOKENS)

    def _pays(self, rates: dict[str, float], tokens_left: int | None) -> tuple[bool, str]:
        """Whether starting the speculative strategy at `rates` pays over `tokens_left`; the comparison in words."""
        fs, ar = rates[self.spec], rates[AR_PP]
        fs_left = self.over(fs, tokens_left)
        speculate = fs_left >= self.policy.margin * ar
        left = "" if tokens_left is None else f" ({fs_left:.2f} over {tokens_left} tokens left, its start included)"
        return speculate, (f"{self.spec} {fs:.2f} tok/s{left} {'>=' if speculate else '<'} "
                           f"{self.policy.margin}x ar-pp {ar:.2f}")

    def _profiles_speculate(self, prediction: Prediction, running: int, tokens_left: int | None) -> tuple[bool, str]:
        """Whether the profiles predict the speculative strategy `margin` times ar-pp's rate or more, for
        each of `running` requests over the `tokens_left` of the answer; and that comparison in words."""
        rates = prediction.at_load(running)
        speculate, words = self._pays(rates, tokens_left)
        others = "".join(f", {s} {r:.2f}" for s, r in rates.items() if s not in (self.spec, AR_PP))
        return speculate, f"profiles predict {words}{others}"

    def observe(self, tokens: int, seconds: float) -> None:
        """`tokens` were emitted over `seconds` while the current choice ran. A speculative start (up to its
        first tokens: the draft's prefill, the first tree, its first trip) is counted, not measured: it is
        paid by then, and what a fall-back weighs is the rate from there on (priced in the first window it
        made a request fall back at 2 concurrent, 12.2 tok/s against ar-pp's 13.6 / 1.08)."""
        if tokens <= 0 and seconds <= 0:
            return
        if self.starting:
            self.starting = tokens <= 0
        else:
            self.meters[self.choice].add(tokens, seconds)
        self.tokens[self.choice] += tokens
        self.since_switch += tokens

    def rate(self, strategy: str) -> tuple[float | None, str]:
        """Measured rate if there is one, else the prediction at the current load, scaled by the other's
        measurement (which was taken under load too)."""
        measured = self.meters[strategy].rate(self.policy.window_tokens)
        if measured is not None:
            return measured, "measured"
        return self._predicted(strategy)

    def _predicted(self, strategy: str) -> tuple[float | None, str]:
        """The prediction at the current load, scaled by ar-pp's measurement where there is one."""
        if self.prediction is None:
            return None, "unknown"
        running = self.load()
        rates = self.prediction.at_load(running)
        how = "predicted" if running <= 1 else f"predicted at {running} requests"
        # the speculative estimate follows ar-pp's measured speed (the devices' absolute speed); ar-pp's
        # never follows the speculative one's (that one also carries the prompt's acceptance)
        ar_measured = self.meters[AR_PP].rate(self.policy.window_tokens) if strategy != AR_PP else None
        scale = ar_measured / rates[AR_PP] if ar_measured is not None else 1.0
        return rates[strategy] * scale, how

    def decide(self, tokens_left: int | None = None) -> str:
        """The strategy to run from here (may switch; the reason says why). `tokens_left`: of the answer.
        The first call, before any token, makes the first choice again where the length was not known
        at construction (strategy `auto` builds its Chooser before it asks)."""
        fresh = not self.switches and not any(self.tokens.values())
        if fresh and self.tokens_left is None and tokens_left is not None:
            self.tokens_left = tokens_left
            self.choice, self.reason = self.initial = self._initial()
            self.starting = self.choice != AR_PP
            return self.choice
        if self.choice != AR_PP:
            self._maybe_fall_back()
        elif self.fell_back:
            self._maybe_probe(tokens_left)
        elif tokens_left is None or tokens_left >= self.policy.unload_tokens:
            self._maybe_unload(tokens_left)
        return self.choice

    def _maybe_fall_back(self) -> None:
        """A measured window `margin` times slower than ar-pp ends the speculation (within the margin the
        difference is the measurement's noise, and a fall-back costs a restart and a probe later). Under
        load, ar-pp is what one request gets among the others' segments, not what all on ar-pp would get:
        weighed against the latter, 2 of 8 requests fell back at 8 concurrent and ran ar-pp at 4.1 tok/s."""
        fs, _ = self.rate(self.spec)
        ar, how = self.rate(AR_PP)
        running = self.load()
        among = self.prediction.ar_among_speculating(running) if self.prediction is not None else None
        if how != "measured" and among is not None and ar is not None and among < ar:
            # alone on ar-pp among the others' segments (in a burst they chose as this one did)
            ar, how = among, f"predicted among {running - 1} speculating requests"
        if (self.meters[self.spec].rate(self.policy.window_tokens) is None or fs is None or ar is None
                or self.policy.margin * fs >= ar):
            return
        self.fell_back = True
        self._switch(AR_PP, f"measured {self.spec} {fs:.2f} tok/s < ar-pp {how} {ar:.2f} / {self.policy.margin}")

    def _maybe_probe(self, tokens_left: int | None) -> None:
        """Try the speculative strategy again, if its prediction (at ar-pp's measured speed) would pay for a
        new start over the tokens left: near the end of an answer a probe cannot."""
        if self.since_switch < self.probe_after:
            return
        fs, how = self._predicted(self.spec)
        ar, _ = self.rate(AR_PP)
        words = f"{self.spec} {how} {fs}, ar-pp {ar}"
        if fs is not None and ar is not None:
            pays, words = self._pays({self.spec: fs, AR_PP: ar}, tokens_left)
            if not pays:
                return
        measured = self.meters[self.spec].rate(self.policy.window_tokens)
        self.meters[self.spec].clear()   # a fresh window: the last one was another part of the answer
        self.probe_after = min(2 * self.probe_after, self.policy.max_probe_tokens)
        last = f"; measured {measured:.2f} before" if measured is not None else ""
        self._switch(self.spec, f"probe after {self.since_switch} ar-pp tokens ({how} {words}{last})")

    def _maybe_unload(self, tokens_left: int | None) -> None:
        """ar-pp was predicted at the load there was: go speculative if the profiles predict it at the
        load there is now (requests ended), over the tokens left. Where ar-pp is predicted alone this never
        switches. Only with `unload_tokens` of the answer left: a switch starts a round, a trip through the
        pipeline, and the draft's prefill of the whole context so far (measured
        on a burst of 8 x 48-token answers on the Orin profile: switching for the last tokens as the others
        ended took the aggregate from 64.46 to 59.08 tok/s)."""
        running = self.load()
        if self.prediction is None or running >= self.initial_load:
            return
        speculate, words = self._profiles_speculate(self.prediction, running, tokens_left)
        if speculate:   # from here a slow measurement falls back and probes, as after any other start
            self._switch(self.spec, f"{running} requests running now: {words}")

    def _switch(self, to: str, reason: str) -> None:
        self.switches.append({"to": to, "after_tokens": sum(self.tokens.values()), "reason": reason})
        self.choice, self.reason, self.since_switch = to, reason, 0
        self.starting = to != AR_PP

    def report(self) -> dict:
        """What an answer's stats carry."""
        out: dict[str, object] = {"choice": self.initial[0], "reason": self.initial[1], "final": self.choice,
               "tokens": dict(self.tokens), "switches": list(self.switches)}
        if self.prediction is not None:
            out["predicted_tok_s"] = {k: round(v, 3) for k, v in self.prediction.rates.items()}
            if self.tokens_left is not None:
                out["tokens_left"] = self.tokens_left
            if self.initial_load > 1:   # what the first choice was made on
                out["requests_running"] = self.initial_load
                out["predicted_tok_s_each"] = {k: round(v, 3)
                                               for k, v in self.prediction.at_load(self.initial_load).items()}
        return out
