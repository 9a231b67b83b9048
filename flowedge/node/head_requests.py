"""The head's client side of the request scheduler: the daemon's driver of `engine.scheduler.Scheduler`.

The scheduler (admission, KV budget, a fair queue per client, draft batching, cancel, pause and replay on
a stage loss, deadlines) is the one the simulator runs too; what is the daemon's own lives here: requests
belong to client connections (`owner`) and to the clients they are for (`client_name`), prompts become
jobs through the `EnginePort` (token ids, sampling, KV need), tokens go back as `TokenChunk`s with their
text cut at stop strings, failures as one `ErrorReply`, and the scheduler's actions go out through an
`OutPort` (the head node's sockets; a recording fake plays both ports in the unit tests). Counters and the
live table feed `flowedge status`.

Requests queued before an outage wait through it, however long: each under its client's own deadline
(every flowedge client gives up after its timeout and cancels; a client that leaves is dropped). A request
that arrives while a stage slot is empty waits at most `recovery_s` for it, then is told which stage is
missing (`ClusterNotReady`), rather than waiting out its client's timeout in silence.

Counters (`served`): answers completed, tokens streamed, requests `rejected` for what they asked (a
context overflow, bad parameters: the client's mistake), `failed` by the cluster (a lost stage, an
internal error), `cancelled` by their clients.
"""
from __future__ import annotations

import logging
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Protocol

from flowedge.core.sampling import SamplingParams
from flowedge.engine.engine_context import EngineContext
from flowedge.engine.events import Done, Offload, Send, Stats
from flowedge.node.live_figures import TokenRate
from flowedge.text.streams import StopText
from flowedge.engine.jobs import (Cancelled, Emitted, Failed, Finished, FromEngine, Job, KvBudget, Limits, Request,
                                  RequestEngine, ResetStages, State)
from flowedge.engine.scheduler import Handlers, Scheduler, run_in_turn
from flowedge.errors import ClusterNotReady, FlowedgeError
from flowedge.transport import protocol as proto

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class Prepared:
    """A prompt made ready to run: token ids, sampling params, strategy."""
    prompt_ids: list[int]
    params: SamplingParams
    strategy: str


class EnginePort(Protocol):
    """What the head computes with (the head's `HeadEngines`)."""

    def prepare(self, msg: proto.PromptRequest) -> Prepared: ...
    def accept(self, msg: proto.Segment): ...   # a routed segment -> engine event, or None (dropped)
    def kv_budget(self) -> KvBudget | None: ...   # the tightest stage's KV tokens (None: no limit known)
    def kv_need(self, prepared: Prepared, max_new_tokens: int) -> int: ...
    def engine(self, strategy: str, context: EngineContext): ...   # one request's engine (engine_context.py)
    def text_stream(self, sink): ...
    def finish_stats(self, req: "ClientRequest", done: Done) -> dict: ...


class TextSink(Protocol):
    """Token ids -> printable pieces (text.streams.TextStream)."""

    def __call__(self, tokens: list[int]) -> None: ...
    def flush(self) -> None: ...


class OutPort(Protocol):
    """Where the head's messages go (the head node's sockets)."""

    def to_client(self, identity: bytes, msg: proto.Message) -> None: ...
    def to_stages(self, action: Send) -> None: ...
    def reset_stages(self, run_id: int) -> None: ...
    def offload(self, key: int, action: Offload) -> None: ...   # a pre-draft job for a drafter


@dataclass
class ClientRequest:
    """One client's prompt: who asked, what it asked, its text stream, and the scheduler's request."""
    owner: bytes
    msg: proto.PromptRequest
    prepared: Prepared
    run: Request | None = None        # the scheduler's, once submitted
    text: TextSink | None = None      # set by `submit` right after the request is built
    stop: StopText = field(default_factory=StopText)   # the request's stop strings over its text
    pieces: list[str] = field(default_factory=list)

    @property
    def key(self) -> int:
        return self.run.key if self.run is not None else 0

    @property
    def request_id(self) -> int:
        return self.msg.request_id

    @property
    def submitted(self) -> Request:
        """The scheduler's request: what reads it below comes after `submit` handed it over."""
        assert self.run is not None, "the request is read before the scheduler took it"
        return self.run

    @property
    def stream(self) -> TextSink:
        assert self.text is not None, "the request's text is read before `submit` set its stream"
        return self.text

    @property
    def run_id(self) -> int:
        return self.submitted.run_id

    @property
    def engine(self) -> RequestEngine | None:
        return self.submitted.engine

    @property
    def emitted(self) -> list[int]:
        return self.submitted.emitted

    @property
    def replays(self) -> int:
        return self.submitted.replays

    @property
    def started_s(self) -> float:
        return self.submitted.started_s

    def take_pieces(self) -> str:
        piece = "".join(self.pieces)
        self.pieces.clear()
        return piece


def client_name(owner: bytes, msg: proto.PromptRequest) -> str:
    """Whom a request is for: the name a gateway gave (`PromptRequest.client`), else its connection."""
    return msg.client or f"zmq:{owner.hex()}"


def request_scheduler(engines: EnginePort, limits: Limits = Limits(),
                      run_handlers: Handlers = run_in_turn) -> Scheduler:
    """The head's request scheduler: its engines come from `engines`, reading the scheduler's clock and load."""
    return Scheduler(lambda req, context: engines.engine(req.job.strategy, context), limits, engines.kv_budget,
                     engines.accept, run_handlers=run_handlers)


class HeadRequests:
    def __init__(self, engines: EnginePort, out: OutPort, limits: Limits = Limits(),
                 run_handlers: Handlers = run_in_turn, client_weights: Mapping[str, float] | None = None,
                 scheduler: Scheduler | None = None) -> None:
        """`client_weights`: a client's share of the starts by its name (`client_name`; others 1);
        `scheduler`: one built first (`request_scheduler`, with `limits` and `run_handlers` of its own) by a
        root that hands its `deliver` to a part built before these requests (node/roots.py)."""
        self.engines, self.out = engines, out
        self.client_weights = dict(client_weights or {})
        self.scheduler = scheduler or request_scheduler(engines, limits, run_handlers)
        self.clients: dict[int, ClientRequest] = {}   # the scheduler's key -> live request (node/run_router.py)
        self.keys = 0
        self.served = {"requests": 0, "tokens": 0, "rejected": 0, "failed": 0, "cancelled": 0}   # status, metrics
        self.rate = TokenRate()   # tokens/s as they stream
        self.last_stats: dict = {}
        self.last_auto: dict = {}   # the latest `auto` answer's choice, reason and switches (status)
        self.last_predraft: dict = {}   # the latest pre-drafted answer's jobs, calls, hits, misses (status)

    def use_handlers(self, run_handlers: Handlers) -> None:
        """A (new) plan's way of running one step's handlers: its draft batcher's `run_step`, or in turn."""
        self.scheduler.run_handlers = run_handlers

    # ---- events in --------------------------------------------------------------------------------
    def submit(self, owner: bytes, msg: proto.PromptRequest, now: float, ready: bool,
               missing: list[str]) -> None:
        """A client's prompt: refused at once before the cluster was ever whole; queued otherwise (while a
        stage is missing, for at most `recovery_s`)."""
        if not ready and not self.scheduler.ever_ready:
            self._refuse(owner, msg.request_id, f"{ClusterNotReady.PREFIX}waiting for {', '.join(missing)}")
            return
        self.keys += 1
        try:
            prepared = self.engines.prepare(msg)
            job = Job(tuple(prepared.prompt_ids), msg.max_new_tokens, prepared.params, prepared.strategy,
                      self.engines.kv_need(prepared, msg.max_new_tokens), **self._whose(owner, msg))
            client = ClientRequest(owner, msg, prepared, stop=StopText(msg.stop))
            client.text = self.engines.text_stream(client.pieces.append)
        except FlowedgeError as err:   # the request's own mistake: a context overflow, bad parameters
            self._refuse(owner, msg.request_id, str(err), rejected=True)
            return
        except Exception as err:  # noqa: BLE001 - a bug met by one request must not take the head down
            log.exception("request %d could not start", self.keys)
            self._refuse(owner, msg.request_id, f"internal error: {type(err).__name__}: {err}")
            return
        self.clients[self.keys] = client
        actions = self.scheduler.submit(self.keys, job, now, ready)
        client.run = self.scheduler.get(self.keys)
        self._carry_out(actions)

    def _whose(self, owner: bytes, msg: proto.PromptRequest) -> dict:
        """The fair queue's lane of a request, and its weight."""
        client = client_name(owner, msg)
        return {"client": client, "weight": float(self.client_weights.get(client, 1.0))}

    def deliver(self, key: int, event) -> None:
        """The outcome of work an engine sent off node 0 (a drafter's pre-draft), queued as its follow-up."""
        self.scheduler.deliver(key, event)

    def add_segment(self, run_id: int, segment, now: float) -> None:
        """A segment back from the pipeline (routed by node/run_router.py), queued on its request until a
        `step` takes it."""
        self.scheduler.add_work(run_id, segment, now)

    def on_segment(self, run_id: int, segment, now: float) -> None:
        """A segment, and every step it leads to, at once (the lifecycle tests' driver)."""
        self.add_segment(run_id, segment, now)
        while self.step(now):
            pass

    def step(self, now: float) -> bool:
        """One piece of work per running request (their draft calls share forwards); returns whether work
        is left."""
        self._carry_out(self.scheduler.step(now))
        return self.scheduler.has_work()

    def has_work(self) -> bool:
        return self.scheduler.has_work()

    def has_idle_work(self) -> bool:
        return self.scheduler.has_idle_work()

    def idle_step(self, now: float) -> None:
        """One piece of the engines' idle work (a pre-draft call): only when nothing else waits."""
        self._carry_out(self.scheduler.idle_step(now))

    def cancel(self, owner: bytes, request_id: int, why: str = "cancelled by its client") -> None:
        for c in [c for c in self.clients.values() if c.owner == owner and c.request_id == request_id]:
            self._carry_out(self.scheduler.cancel(c.key, why))

    def client_gone(self, owner: bytes, why: str) -> None:
        for c in [c for c in self.clients.values() if c.owner == owner]:
            self._carry_out(self.scheduler.cancel(c.key, f"cancelled by its client ({why})"))

    def stage_lost(self, why: str, now: float) -> None:
        self._carry_out(self.scheduler.stage_lost(why, now))

    def fail(self, key: int, message: str) -> None:
        """End request `key` now (a stage gave up on its run), its asker told `message`."""
        self._carry_out(self.scheduler.stop(key, State.FAILED, message))

    def fail_waiting(self, message: str) -> None:
        """End every request waiting for the cluster (paused or queued) with `message`: it cannot serve them."""
        keys = list(self.scheduler.running) + [r.key for r in self.scheduler.queue]
        for key in keys:
            self._carry_out(self.scheduler.stop(key, State.FAILED, message))

    def extend_deadlines(self, until_s: float) -> None:
        """A re-plan is under way: requests waiting for the cluster wait until `until_s` at least."""
        for req in [*self.scheduler.running.values(), *self.scheduler.queue]:
            if req.deadline_s is not None:
                req.deadline_s = max(req.deadline_s, until_s)

    def tick(self, now: float, ready: bool, missing: Sequence[str] = ()) -> None:
        """Deadlines, replays and starts; `missing`: the stages the cluster waits for (named to whoever it fails)."""
        self._carry_out(self.scheduler.tick(now, ready, ", ".join(missing)))

    # ---- queries ----------------------------------------------------------------------------------
    @property
    def running(self) -> dict[int, ClientRequest]:
        """Running and paused requests, by key."""
        return {k: self.clients[k] for k in self.scheduler.running}

    @property
    def queue(self) -> list[ClientRequest]:
        return [self.clients[r.key] for r in self.scheduler.queue]

    def kv_reserved(self) -> int:
        return self.scheduler.kv_reserved()

    def client_queues(self) -> list[dict]:
        """Per client with requests here (or refused lately): its weight, queued, running and refused."""
        return self.scheduler.queue.table()

    def busy_clients(self) -> set[bytes]:
        return {c.owner for c in self.clients.values()}

    def pending(self) -> int:
        return self.scheduler.pending()

    def live(self, now: float, name: Callable[[bytes], str] = lambda owner: "") -> dict:
        """The requests as they are now, for status: counts by state, and per running request its tokens
        so far, its tokens a second since it started, its mean accepted length so far (acceptance that moves
        while the answer streams) and the client that asked (`name` of its connection)."""
        rows = []
        for req in self.scheduler.running.values():
            accepts = getattr(getattr(req.engine, "stats", None), "accept_lens", None) or []
            elapsed = now - req.started_s if req.started_s else 0.0
            client = self.clients.get(req.key)
            rows.append({"id": req.key, "state": req.state.value, "tokens": len(req.emitted),
                         "elapsed_s": round(elapsed, 3),
                         "tokens_per_s": round(len(req.emitted) / elapsed, 3) if elapsed > 0 else None,
                         "client": (client.msg.client or name(client.owner)) if client is not None else "",
                         "mean_accept_len": round(sum(accepts) / len(accepts), 4) if accepts else None})
        running = self.scheduler.running.values()
        return {"queued": len(self.scheduler.queue), "running": self.scheduler.running_count(),
                "paused": sum(1 for r in running if r.state is State.PAUSED), "tokens_per_s": self.rate.per_s(now),
                "active": rows}

    # ---- actions out ------------------------------------------------------------------------------
    def _carry_out(self, actions: list) -> None:
        """The scheduler's actions, in order; a request that ended meanwhile (a stop string) gets no more.
        An action that raises fails its own request, never the head: the rest still go out."""
        for a in actions:
            try:
                self._carry_out_one(a)
            except Exception as err:  # noqa: BLE001 - a bug met by one request must not take the head down
                log.exception("request %d: could not carry out %s", a.key, type(a).__name__)
                self._fail_after_bug(a.key, f"internal error: {type(err).__name__}: {err}")

    def _fail_after_bug(self, key: int, message: str) -> None:
        """End the request whose action raised; its asker hears why even if the scheduler had already
        let it go (a bug while finishing)."""
        client = self.clients.get(key)
        actions = self.scheduler.stop(key, State.FAILED, message)
        if any(isinstance(a, Failed) for a in actions):
            self._carry_out(actions)
        elif client is not None:
            self._carry_out(actions)
            self._fail(client, message)

    def _carry_out_one(self, a) -> None:
        client = self.clients.get(a.key)
        if isinstance(a, ResetStages):
            self.out.reset_stages(a.run_id)
        elif client is None:
            return
        elif isinstance(a, FromEngine):
            if isinstance(a.action, Send):
                self.out.to_stages(a.action)
            elif isinstance(a.action, Offload):
                self.out.offload(a.key, a.action)
        elif isinstance(a, Emitted):
            self._stream(client, a.tokens)
        elif isinstance(a, Finished):
            self._finish(client, a.done)
        elif isinstance(a, Failed):
            self._fail(client, a.message, a.rejected)
        elif isinstance(a, Cancelled):
            self.clients.pop(a.key, None)
            self.served["cancelled"] += 1

    def _stream(self, client: ClientRequest, tokens: list[int]) -> None:
        tokens, text = self._up_to_stop(client, tokens)
        self.served["tokens"] += len(tokens)   # as they stream, so status shows live tokens/s
        self.rate.add(len(tokens), self.scheduler.now_s)
        self.out.to_client(client.owner, proto.TokenChunk(
            request_id=client.request_id, token_ids=tuple(tokens), text=text, done=False))
        if client.stop.hit:   # a stop string: the answer ends here, the stages drop its KV
            stats = getattr(client.engine, "stats", None)   # a Head's; a stand-in engine may keep none
            resets = self.scheduler.end(client.key)
            self._finish(client, Done(list(client.emitted), Stats() if stats is None else stats, client.key))
            self._carry_out(resets)

    @staticmethod
    def _up_to_stop(client: ClientRequest, tokens: list[int]) -> tuple[list[int], str]:
        """The tokens to hand out and their text: with stop strings, a token at a time up to the one that
        completes a stop string (a strategy that accepts several tokens at once would otherwise hand out,
        and count, tokens past the stop that another strategy never made). The answer's tokens end there."""
        if not client.stop.stops:
            client.stream(tokens)
            return tokens, client.take_pieces()
        text = ""
        for i, token in enumerate(tokens):
            client.stream([token])
            text += client.stop.feed(client.take_pieces())
            if client.stop.hit:
                del client.emitted[len(client.emitted) - len(tokens) + i + 1:]
                return tokens[:i + 1], text
        return tokens, text

    def _finish(self, client: ClientRequest, done: Done) -> None:
        self.clients.pop(client.key, None)
        stats = self.engines.finish_stats(client, done)
        stats["finish_reason"] = "stop" if client.stop.hit or len(client.emitted) < client.msg.max_new_tokens \
            else "length"
        client.stream.flush()
        self.out.to_client(client.owner, proto.TokenChunk(
            request_id=client.request_id, token_ids=(), text=client.stop.finish(client.take_pieces()),
            done=True, stats=stats))
        self.served["requests"] += 1
        self.last_stats = stats
        self.last_auto = stats.get("auto") or self.last_auto
        self.last_predraft = stats.get("predraft") or self.last_predraft
        log.info("request %d done: %d tokens in %.2f s%s", client.key, len(client.emitted),
                 stats.get("wall_s", 0.0), f" ({client.replays} replays)" if client.replays else "")

    def _fail(self, client: ClientRequest, message: str, rejected: bool = False) -> None:
        self.clients.pop(client.key, None)
        self._refuse(client.owner, client.request_id, message, rejected)

    def _refuse(self, owner: bytes, request_id: int, message: str, rejected: bool = False) -> None:
        """Tell the asker why its request ends; counted `rejected` (its own mistake) or `failed` (the cluster's)."""
        self.served["rejected" if rejected else "failed"] += 1
        self.out.to_client(owner, proto.ErrorReply(request_id=request_id, message=message))
