"""The request lifecycle on the head: queued -> running -> done | failed | cancelled, with a pause
(`paused`) while a stage's slot is empty. Each request has an owner (the client connection) and, while
it waits on a cluster that lost a stage, a deadline.

Events in: `submit`, `on_segment`, `cancel`, `client_gone`, `stage_lost`, `tick`. The engines come from
an `EnginePort` (the head's `HeadEngines`), actions go out through an `OutPort` (the head node's
sockets): messages to the client, engine messages to the stages, resets that free the stages' KV cache
(a recording fake plays both in the unit tests).

No request is lost when a stage dies: the running request pauses and its stages' KV caches are dropped;
when every slot is filled and ready again the head *replays* it: the engine restarts on the prompt plus
every token already sent to the client, for the tokens still to come, under a new engine id (so any
segment of the old run still in the pipeline is ignored). The stages rebuild their KV cache from that
prefill, and the client gets only new tokens: at temperature 0 the answer is token-identical to an
undisturbed run. At temperature > 0 the replay draws from a generator seeded from (seed, tokens
committed): tokens after the fault are drawn with fresh randomness from the same conditional
distribution, so the distribution is exactly kept (the sample itself differs from an undisturbed run
with the same seed; reusing the seed's stream would correlate the draws after the fault with those
before it). Past `recovery_s` without a full cluster a request in flight (paused) fails with one clear
error. Queued requests keep their place through the outage, however long: each waits under its own
deadline, its client's (every flowedge client gives up after its timeout and cancels; a client that
leaves is dropped), and they start in order once the cluster is whole again. A request in flight
has a client watching tokens stop; one in the queue has seen nothing yet and loses nothing by waiting.

`max_running` bounds how many requests run at once, each with its own engine head (the config's
`max_concurrent`: their segments interleave in the pipeline and the stages batch them). Admission also
respects the stages' KV memory (daemon/kv_budget.py): a request starts only when its worst-case KV
(prompt + max new tokens + a draft tree) fits on every stage next to what the running ones reserve;
otherwise it waits its turn (first come, first served: nothing overtakes it), and one that could never
fit gets one clear error as soon as it arrives.

Node 0 batches its draft calls across the running requests the way the simulator does
(sim/cluster.py, `step_node0`): segments back from the pipeline and each engine's own follow-ups
(`Continue`) queue on their request, and every `step` takes one piece of work per request — follow-ups
first, depth-first, then segments in arrival order, so each request sees the order of work it would have
alone — and runs those handlers side by side through `run_handlers` (the head passes the
`DraftBatcher`'s `run_step`: the k-th draft call of every handler becomes one packed forward).
"""
from __future__ import annotations

import hashlib
import logging
from collections import deque
from dataclasses import dataclass, field, replace
from enum import Enum
from functools import partial
from typing import Callable, Protocol

from flowedge.core.sampling import SamplingParams
from flowedge.daemon.kv_budget import KvBudget
from flowedge.daemon.prompting import StopText
from flowedge.engine.events import Compute, Continue, Done, Emit, Send
from flowedge.errors import FlowedgeError
from flowedge.transport import protocol as proto

log = logging.getLogger(__name__)


class State(Enum):
    QUEUED = "queued"
    RUNNING = "running"
    PAUSED = "paused"
    DONE = "done"
    FAILED = "failed"
    CANCELLED = "cancelled"


@dataclass(frozen=True, slots=True)
class Prepared:
    """A prompt made ready to run: token ids, sampling params, strategy."""
    prompt_ids: list[int]
    params: SamplingParams
    strategy: str


class EnginePort(Protocol):
    """What the lifecycle computes with (the head's `HeadEngines`)."""

    def prepare(self, msg: proto.PromptRequest) -> Prepared: ...
    def accept(self, engine, segment): ...   # a returned segment -> engine event, or None (dropped)
    def kv_budget(self) -> KvBudget | None: ...   # the tightest stage's KV tokens (None: no limit known)
    def kv_need(self, prepared: Prepared, max_new_tokens: int) -> int: ...
    def engine(self, strategy: str): ...
    def text_stream(self, sink): ...
    def finish_stats(self, req: "Request", done: Done) -> dict: ...


class OutPort(Protocol):
    """Where the lifecycle's messages go (the head node's sockets)."""

    def to_client(self, identity: bytes, msg: proto.Message) -> None: ...
    def to_stages(self, action: Send) -> None: ...
    def reset_stages(self, engine_id: int) -> None: ...


@dataclass
class Request:
    key: int                          # head-wide id
    owner: bytes                      # the client connection
    msg: proto.PromptRequest
    submitted_s: float
    state: State = State.QUEUED
    deadline_s: float | None = None   # paused: the recovery deadline for a lost stage's slot
    prepared: Prepared | None = None
    engine: object = None
    engine_id: int = 0                # the engine run's id on the wire (a replay gets a new one)
    emitted: list[int] = field(default_factory=list)   # every token sent to the client
    text: object = None               # runner.TextStream: token ids -> printable pieces
    pieces: list[str] = field(default_factory=list)
    started_s: float = 0.0
    last_progress_s: float = 0.0
    replays: int = 0
    stop: StopText = field(default_factory=StopText)   # the request's stop strings over its text
    work: deque = field(default_factory=deque)   # (is_follow_up, item): the engine's next events
    kv_tokens: int = 0                # KV tokens it may hold on every stage (reserved while it runs)
    kv_waited: bool = False           # has waited in the queue for KV (logged once)

    @property
    def request_id(self) -> int:
        return self.msg.request_id

    def take_pieces(self) -> str:
        piece = "".join(self.pieces)
        self.pieces.clear()
        return piece


@dataclass(frozen=True, slots=True)
class Limits:
    recovery_s: float = 30.0          # a request waits this long for a lost stage's slot to be filled
    stall_s: float = 60.0             # a running request with no pipeline output this long is replayed
    max_replays: int = 3
    max_running: int = 1


def replay_params(params: SamplingParams, committed: int) -> SamplingParams:
    """Sampling params of a replay after `committed` output tokens (see the module docstring)."""
    if params.greedy or params.seed is None or committed == 0:
        return params
    digest = hashlib.sha256(f"{params.seed}:{committed}".encode()).digest()
    return replace(params, seed=int.from_bytes(digest[:7], "big"))


Handlers = Callable[[list[Callable[[], list]]], list]


def run_in_turn(handlers: list[Callable[[], list]]) -> list:
    """`run_handlers` without a draft batcher: one after another."""
    return [h() for h in handlers]


class RequestBook:
    def __init__(self, engines: EnginePort, out: OutPort, limits: Limits = Limits(),
                 run_handlers: Handlers = run_in_turn) -> None:
        self.engines, self.out, self.limits = engines, out, limits
        self.run_handlers = run_handlers   # one step's handlers, side by side (the draft batcher) or in turn
        self.queue: deque[Request] = deque()
        self.running: dict[int, Request] = {}     # key -> running or paused request
        self.by_engine: dict[int, Request] = {}   # engine id -> running request
        self.keys = 0
        self.engine_ids = 0
        self.ever_ready = False
        self.lost_why = ""
        self.served = {"requests": 0, "tokens": 0, "failed": 0, "cancelled": 0}   # for status / metrics
        self.last_stats: dict = {}
        self.last_auto: dict = {}   # the latest `auto` answer's choice, reason and switches (status)

    # ---- events in --------------------------------------------------------------------------------
    def submit(self, owner: bytes, msg: proto.PromptRequest, now: float, ready: bool,
               missing: list[str]) -> None:
        if not ready and not self.ever_ready:
            self.out.to_client(owner, proto.ErrorReply(
                request_id=msg.request_id, message=f"cluster not ready: waiting for {', '.join(missing)}"))
            return
        self.keys += 1
        req = Request(self.keys, owner, msg, now)
        if not self._prepare(req) or not self._can_ever_fit(req):
            return
        self.queue.append(req)   # while the cluster lacks a stage too: it waits its turn

    def add_segment(self, engine_id: int, segment, now: float) -> None:
        """A segment back from the pipeline, queued on its request until a `step` takes it."""
        req = self.by_engine.get(engine_id)
        if req is None or req.state is not State.RUNNING:
            return   # output of a cancelled, paused, replayed or finished run
        req.last_progress_s = now
        req.work.append((False, segment))

    def on_segment(self, engine_id: int, segment, now: float) -> None:
        """A segment, and every step it leads to, at once (the lifecycle tests' driver)."""
        self.add_segment(engine_id, segment, now)
        while self.step():
            pass

    def step(self) -> bool:
        """One piece of work per running request, their handlers side by side (their draft calls share
        forwards); their actions carried out request after request. Returns whether work is left."""
        batch: list[tuple[Request, object]] = []
        for req in list(self.running.values()):
            event = self._next_event(req)
            if event is not None:
                batch.append((req, event))
        if batch:
            results = self.run_handlers([partial(_guarded, req.engine.receive, ev) for req, ev in batch])
            for (req, _), result in zip(batch, results):
                if req.state is State.RUNNING:
                    self._run(req, partial(_reraise, result))
        return self.has_work()

    def _running_count(self) -> int:
        return sum(1 for r in self.running.values() if r.state is State.RUNNING)

    def has_work(self) -> bool:
        return any(r.work for r in self.running.values() if r.state is State.RUNNING)

    def _next_event(self, req: Request):
        """The request's next engine event: its oldest follow-up, else its oldest segment that passes the
        port's checks (made against the engine as it is now, after the work before it)."""
        if req.state is not State.RUNNING:
            req.work.clear()
            return None
        while req.work:
            follow_up, item = req.work.popleft()
            event = item if follow_up else self.engines.accept(req.engine, item)
            if event is not None:
                return event
        return None

    def cancel(self, owner: bytes, request_id: int, why: str = "cancelled by its client") -> None:
        for req in [r for r in self._all() if r.owner == owner and r.request_id == request_id]:
            self._end(req, State.CANCELLED, why)

    def client_gone(self, owner: bytes, why: str) -> None:
        for req in [r for r in self._all() if r.owner == owner]:
            self._end(req, State.CANCELLED, f"cancelled by its client ({why})")

    def stage_lost(self, why: str, now: float) -> None:
        """A stage left: running requests pause under the recovery deadline; queued ones keep their place."""
        self.lost_why = why
        for req in list(self.running.values()):
            if req.state is State.RUNNING:
                self._pause(req, why)
            if req.deadline_s is None:
                req.deadline_s = now + self.limits.recovery_s

    def tick(self, now: float, ready: bool) -> None:
        """Deadlines and stalls; with a ready cluster resume paused requests, then start queued ones."""
        self.ever_ready |= ready
        for req in [r for r in self.running.values() if r.deadline_s is not None and now > r.deadline_s]:
            self._end(req, State.FAILED, f"{self.lost_why or 'the cluster lost a stage'}, and no node took its "
                                         f"place within {self.limits.recovery_s:g} s")
        for req in list(self.running.values()):
            if req.state is State.RUNNING and now - req.last_progress_s > self.limits.stall_s:
                self._pause(req, f"the pipeline returned nothing for {self.limits.stall_s:g} s")
                req.deadline_s = None if ready else now + self.limits.recovery_s
        if not ready:
            return
        for req in [r for r in self.running.values() if r.state is State.PAUSED]:
            self._replay(req, now)
        while self.queue and len(self.running) < self.limits.max_running:
            if not self._can_ever_fit(self.queue[0]):
                continue
            if not self._fits_now(self.queue[0]):
                self._note_kv_wait(self.queue[0])
                break   # waits for running requests to free KV; nothing behind it overtakes
            self._start(self.queue.popleft(), now)

    def kv_reserved(self) -> int:
        """KV tokens the running (and paused) requests reserve on every stage."""
        return sum(r.kv_tokens for r in self.running.values())

    def _can_ever_fit(self, req: Request) -> bool:
        budget = self.engines.kv_budget()
        if budget is None or req.kv_tokens <= budget.tokens:
            return True
        self._end(req, State.FAILED, f"the request needs {req.kv_tokens} KV tokens on every stage (prompt + "
                                     f"max_tokens + a draft tree); stage {budget.stage} can hold {budget.tokens} "
                                     f"({budget.why}): shorten the prompt or lower max_tokens", prefix="")
        return False

    def _note_kv_wait(self, req: Request) -> None:
        if not req.kv_waited:
            req.kv_waited = True
            log.info("request %d waits for KV: needs %d tokens per stage, %d of %d held by %d running", req.key,
                     req.kv_tokens, self.kv_reserved(), self.engines.kv_budget().tokens, len(self.running))

    def _fits_now(self, req: Request) -> bool:
        budget = self.engines.kv_budget()
        return budget is None or self.kv_reserved() + req.kv_tokens <= budget.tokens

    # ---- queries ----------------------------------------------------------------------------------
    def engine_of(self, engine_id: int):
        """The engine head of a running request's current run (None: cancelled, paused, replayed, done)."""
        req = self.by_engine.get(engine_id)
        return req.engine if req is not None and req.state is State.RUNNING else None

    def busy_clients(self) -> set[bytes]:
        return {r.owner for r in self._all()}

    def pending(self) -> int:
        return len(self.queue) + len(self.running)

    def live(self, now: float) -> dict:
        """The requests as they are now, for status: counts by state, and per running request its tokens
        so far and its mean accepted length so far (acceptance that moves while the answer streams)."""
        rows = []
        for req in self.running.values():
            accepts = getattr(getattr(req.engine, "stats", None), "accept_lens", None) or []
            rows.append({"id": req.key, "state": req.state.value, "tokens": len(req.emitted),
                         "elapsed_s": round(now - req.started_s, 3) if req.started_s else 0.0,
                         "mean_accept_len": round(sum(accepts) / len(accepts), 4) if accepts else None})
        return {"queued": len(self.queue), "running": self._running_count(),
                "paused": sum(1 for r in self.running.values() if r.state is State.PAUSED), "active": rows}

    def _all(self) -> list[Request]:
        return list(self.running.values()) + list(self.queue)

    # ---- transitions ------------------------------------------------------------------------------
    def _prepare(self, req: Request) -> bool:
        """Token ids, sampling params and KV need, on arrival (a bad request is refused at once)."""
        try:
            req.prepared = self.engines.prepare(req.msg)
            req.kv_tokens = self.engines.kv_need(req.prepared, req.msg.max_new_tokens)
            req.text = self.engines.text_stream(req.pieces.append)
            req.stop = StopText(req.msg.stop)
        except FlowedgeError as err:
            self._end(req, State.FAILED, str(err), prefix="")
            return False
        except Exception as err:  # noqa: BLE001 - a bug met by one request must not take the head down
            log.exception("request %d could not start", req.key)
            self._end(req, State.FAILED, f"internal error: {type(err).__name__}: {err}", prefix="")
            return False
        return True

    def _start(self, req: Request, now: float) -> None:
        req.started_s = now
        self.running[req.key] = req
        self._launch(req, now)

    def _launch(self, req: Request, now: float) -> None:
        """Start (or restart, for a replay) the engine on the prompt plus what the client already has."""
        p = req.prepared
        try:
            req.engine = self.engines.engine(p.strategy)
        except FlowedgeError as err:
            self._end(req, State.FAILED, str(err), prefix="")
            return
        if hasattr(req.engine, "running_requests"):   # every engine Head (the tests' fakes may not)
            req.engine.running_requests = self._running_count   # strategy `auto` weighs its predictions by it
        self.engine_ids += 1
        req.engine_id = self.engine_ids
        req.work.clear()   # a replay: whatever the old run had queued is void
        self.by_engine[req.engine_id] = req
        req.state, req.deadline_s, req.last_progress_s = State.RUNNING, None, now
        left = req.msg.max_new_tokens - len(req.emitted)
        log.info("request %d: %d prompt tokens + %d committed, strategy %s, %d new to go (head request %d%s)",
                 req.engine_id, len(p.prompt_ids), len(req.emitted), p.strategy, left, req.key,
                 f", replay {req.replays}" if req.replays else "")   # the key: FIFO is checked from this line
        ids, params = p.prompt_ids + req.emitted, replay_params(p.params, len(req.emitted))
        self._run(req, lambda: req.engine.start(req.engine_id, ids, left, params))

    def _replay(self, req: Request, now: float) -> None:
        if req.replays >= self.limits.max_replays:
            self._end(req, State.FAILED, f"gave up after {req.replays} replays")
            return
        req.replays += 1
        log.warning("request %d: replaying %d committed tokens to rebuild the stages' KV caches", req.key,
                    len(req.prepared.prompt_ids) + len(req.emitted))
        self._launch(req, now)

    def _pause(self, req: Request, why: str) -> None:
        log.warning("request %d paused after %d tokens: %s", req.key, len(req.emitted), why)
        self.by_engine.pop(req.engine_id, None)
        self.out.reset_stages(req.engine_id)
        req.state = State.PAUSED

    def _end(self, req: Request, state: State, why: str, prefix: str = "request failed: ") -> None:
        """Finish a request that did not complete: one ErrorReply (not for a cancel), stages reset."""
        if req.state is State.RUNNING:
            self.out.reset_stages(req.engine_id)
        self._forget(req)
        req.state = state
        self.served["cancelled" if state is State.CANCELLED else "failed"] += 1
        if state is State.CANCELLED:
            log.info("request %d %s", req.key, why)
            return
        log.error("request %d failed: %s", req.key, why)
        self.out.to_client(req.owner, proto.ErrorReply(request_id=req.request_id, message=prefix + why))

    def _forget(self, req: Request) -> None:
        req.work.clear()
        self.running.pop(req.key, None)
        self.by_engine.pop(req.engine_id, None)
        if req in self.queue:
            self.queue.remove(req)

    # ---- engine actions ---------------------------------------------------------------------------
    def _run(self, req: Request, step) -> None:
        """Run one engine step and carry out its actions; an unexpected error fails this request only."""
        try:
            self._execute(req, step())
        except FlowedgeError as err:
            self._end(req, State.FAILED, str(err), prefix="")
        except Exception as err:  # noqa: BLE001 - a bug met by one request must not take the head down
            log.exception("request %d: engine error", req.key)
            self._end(req, State.FAILED, f"internal error: {type(err).__name__}: {err}", prefix="")

    def _execute(self, req: Request, actions: list) -> None:
        """Carry out one engine step's actions; its follow-ups go first in the request's work (in order)."""
        follow_ups = []
        for a in actions:
            if req.state is not State.RUNNING:
                return
            if isinstance(a, Send):
                self.out.to_stages(a)
            elif isinstance(a, Emit):
                req.emitted += a.tokens
                self.served["tokens"] += len(a.tokens)   # as they stream, so status shows live tokens/s
                req.text(a.tokens)
                self.out.to_client(req.owner, proto.TokenChunk(
                    request_id=req.request_id, token_ids=list(a.tokens), text=req.stop.feed(req.take_pieces()),
                    done=False))
                if req.stop.hit:   # a stop string: the answer ends here, the stages drop its KV
                    self._finish(req, Done(list(req.engine.outputs), req.engine.stats))
                    self.out.reset_stages(req.engine_id)
            elif isinstance(a, Continue):
                follow_ups.append((True, a.event))
            elif isinstance(a, Done):
                self._finish(req, a)
            elif not isinstance(a, Compute):
                log.warning("unhandled engine action %r", a)
        if req.state is State.RUNNING:
            req.work.extendleft(reversed(follow_ups))

    def _finish(self, req: Request, done: Done) -> None:
        stats = self.engines.finish_stats(req, done)
        stats["finish_reason"] = "stop" if req.stop.hit or len(req.emitted) < req.msg.max_new_tokens else "length"
        req.text.flush()
        self.out.to_client(req.owner, proto.TokenChunk(
            request_id=req.request_id, token_ids=(), text=req.stop.finish(req.take_pieces()),
            done=True, stats=stats))
        self._forget(req)
        req.state = State.DONE
        self.served["requests"] += 1
        self.last_stats = stats
        self.last_auto = stats.get("auto") or self.last_auto
        log.info("request %d done: %d tokens in %.2f s%s", req.key, len(req.emitted), stats.get("wall_s", 0.0),
                 f" ({req.replays} replays)" if req.replays else "")


def _guarded(receive, event):
    """One request's engine step; an exception comes back as the result (it fails that request only)."""
    try:
        return receive(event)
    except Exception as err:  # noqa: BLE001 - handed to RequestBook._run, which fails the request
        return err


def _reraise(result):
    if isinstance(result, Exception):
        raise result
    return result
