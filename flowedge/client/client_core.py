"""The client's protocol, with no I/O: one connection's requests as a state machine.

Both faces (`Client`, sync; `AsyncClient`, asyncio) drive this core and only move messages: they
send what it returns, feed it what arrives (`receive`), a lost connection (`lost_connection`) and
the time (`expire`, `next_deadline`), and hand its events to their callers. So the handshake,
heartbeats, timeouts, cancel, late replies, typed errors and the totals are written once, and tested
by events without a socket (tests/test_client_core.py).

    core = ClientCore("127.0.0.1:5555")
    send(core.hello(now))                          # -> Welcomed, or Failed(CONTROL, FlowedgeError)
    send(core.start(core.request("Hi", max_new_tokens=8), now))   # -> Piece(rid, text, ids)..., Done(rid, answer)
    for event in core.receive(msg, now): ...       # Send(msg) events are heartbeat answers to send
"""
from __future__ import annotations

import os
import secrets
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from flowedge.client.client_answer import Answer, answer_from
from flowedge.errors import FlowedgeError, HeadLost, HeadUnreachable, ProtocolError, Refused, refusal
from flowedge.transport import protocol as proto

# A head answers HELLO from its event loop at once; silence this long means no head there. Short, so
# a wrong or dead address is reported in seconds (waiting for a head that is still starting is
# `wait_ready`'s job, which tries again).
HELLO_TIMEOUT_S = 2.0

CONTROL = 0   # the waiter key of HELLO and status, whose replies carry no request id (requests count from 1)
DEFAULT_MAX_NEW_TOKENS = 64

Prompt = str | Sequence[int]           # a text, or token ids
Turns = Sequence[Mapping[str, str]]    # a conversation: {"role": "system" | "user" | "assistant", "content": ...}
Stops = Sequence[str] | str            # strings that end an answer


# ---- events out ----------------------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class Send:
    """A message the face must send now (a heartbeat answer)."""
    msg: proto.Message


@dataclass(frozen=True, slots=True)
class Welcomed:
    """The head admitted this client."""


@dataclass(frozen=True, slots=True)
class Status:
    """The head's status: one map per node."""
    nodes: list[dict[str, Any]]


@dataclass(frozen=True, slots=True)
class Piece:
    """New text of request `request_id` and the token ids it came from (never both empty)."""
    request_id: int
    text: str
    token_ids: tuple[int, ...] = ()


@dataclass(frozen=True, slots=True)
class Done:
    """Request `request_id` finished: its whole answer, with the head's figures and the client's."""
    request_id: int
    answer: Answer


@dataclass(frozen=True, slots=True)
class Failed:
    """A waiter (a request id, or CONTROL) ends with `error`; the face raises it to its caller."""
    request_id: int
    error: FlowedgeError


Event = Send | Welcomed | Status | Piece | Done | Failed


# ---- the request ---------------------------------------------------------------------------------
def prompt_request(rid: int, prompt: Prompt | None, *, messages: Turns | None = None, system: str | None = None,
                   stop: Stops | None = None, raw: bool = False, max_new_tokens: int | None = None,
                   max_tokens: int | None = None, temperature: float = 0.0, top_k: int | None = None,
                   top_p: float | None = None, seed: int | None = None, strategy: str = "",
                   client: str = "") -> proto.PromptRequest:
    """The PromptRequest for one call of `stream`; FlowedgeError (ProtocolError from the message's own
    checks) for a request that cannot be sent, so a bad one never reaches the head. `max_tokens` is
    OpenAI's name for `max_new_tokens` (either, or both when they agree)."""
    if (prompt is None) == (messages is None):
        raise FlowedgeError("give exactly one of a prompt or messages")
    if raw and (messages is not None or system is not None):
        raise FlowedgeError("raw mode sends the prompt as is: no messages, no system prompt")
    text, ids = (prompt, None) if isinstance(prompt, str) or prompt is None else (None, tuple(prompt))
    turns = None if messages is None else [dict(m) for m in messages]
    if system is not None:
        if ids is not None:
            raise FlowedgeError("a system prompt needs a text prompt or messages, not token ids")
        asked = turns if turns is not None else [{"role": "user", "content": str(text)}]
        turns, text = [{"role": "system", "content": system}, *asked], None
    return proto.PromptRequest(
        request_id=rid, max_new_tokens=new_tokens_limit(max_new_tokens, max_tokens), text=text, token_ids=ids,
        messages=turns, stop=[stop] if isinstance(stop, str) else list(stop or ()), raw=raw,
        temperature=temperature, top_k=top_k or None, top_p=top_p if top_p not in (None, 1.0) else None,
        seed=seed, strategy=strategy, client=client)


def new_tokens_limit(max_new_tokens: int | None, max_tokens: int | None) -> int:
    """The one limit `max_new_tokens` and its alias `max_tokens` give (DEFAULT_MAX_NEW_TOKENS: neither)."""
    if max_new_tokens is not None and max_tokens is not None and max_new_tokens != max_tokens:
        raise FlowedgeError(f"max_tokens={max_tokens} and max_new_tokens={max_new_tokens} disagree: "
                            "give one (max_tokens is the same limit by its OpenAI name)")
    for limit in (max_new_tokens, max_tokens):
        if limit is not None:
            return limit
    return DEFAULT_MAX_NEW_TOKENS


# ---- one request's answer so far -----------------------------------------------------------------
@dataclass(slots=True)
class Pending:
    """One request's replies folded into totals; `last_s` is when it last heard of it (for `timeout_s`)."""
    started_s: float
    last_s: float
    tokens: list[int] = field(default_factory=list)
    pieces: list[str] = field(default_factory=list)
    first_token_s: float | None = None

    def chunk(self, msg: proto.TokenChunk, now: float) -> Answer | None:
        """Take one TokenChunk; the whole Answer when it is the last one."""
        self.tokens += msg.token_ids
        if msg.token_ids and self.first_token_s is None:
            self.first_token_s = now - self.started_s
        if msg.text:
            self.pieces.append(msg.text)
        if not msg.done:
            return None
        return answer_from(msg.stats or {}, "".join(self.pieces), tuple(self.tokens),
                           client_wall_s=now - self.started_s, first_token_s=self.first_token_s)


@dataclass(slots=True)
class _Control:
    """The one HELLO or status exchange in progress."""
    kind: str          # "hello" | "status"
    since_s: float
    limit_s: float


# ---- the core ------------------------------------------------------------------------------------
class ClientCore:
    """One connection to a head: its handshake, its open requests and their deadlines.

    Timeouts (deadlines are data: every call takes `now`, a `time.monotonic()` value): a waiter fails
    after `timeout_s` without a reply of its own; an open request also after `head_timeout_s` without
    a word from the head (it heartbeats a client while it holds a request of its).

    `client`: whom the requests are for, when this connection asks on behalf of others (a gateway): the
    head queues each client's requests in a lane of its own (empty: this connection is the client)."""

    def __init__(self, addr: str, *, timeout_s: float = 300.0, head_timeout_s: float = 5.0,
                 node_id: str | None = None, client: str = "") -> None:
        self.addr, self.client = addr, client
        self.timeout_s = timeout_s
        self.head_timeout_s = head_timeout_s
        # unique per connection: a new head matches a request sent again by (node id, request id)
        self.node_id = node_id or f"client-{os.getpid()}-{secrets.token_hex(4)}"
        self.welcomed = False
        self.open: dict[int, Pending] = {}    # request id -> its answer so far, for unfinished requests
        self.control: _Control | None = None
        self.last_heard_s = 0.0               # any message from the head (heartbeats too)
        self._next_id = CONTROL

    # ---- what to send ----------------------------------------------------------------------------
    def request(self, prompt: Prompt | None, **kwargs: Any) -> proto.PromptRequest:
        """A new PromptRequest on this connection (`prompt_request`'s arguments); not open until `start`."""
        self._next_id += 1
        return prompt_request(self._next_id, prompt, client=self.client, **kwargs)

    def hello(self, now: float, limit_s: float = HELLO_TIMEOUT_S) -> proto.Hello:
        """The HELLO to send; Welcomed or Failed(CONTROL) follows (after `limit_s` at most without an answer)."""
        self.control = _Control("hello", now, min(self.timeout_s, limit_s))
        return proto.Hello(node_id=self.node_id, role="client", device="client", free_memory_bytes=0,
                           capabilities={"heartbeat": True})

    def status(self, now: float, timeline: bool = False) -> proto.StatusRequest:
        """The status request to send (`timeline`: with the head's recent past); Status or Failed(CONTROL)
        follows."""
        self.control = _Control("status", now, self.timeout_s)
        return proto.StatusRequest(timeline=timeline)

    def start(self, request: proto.PromptRequest, now: float) -> proto.PromptRequest:
        """Open `request` (built by `prompt_request`); returns it to send."""
        if request.request_id in self.open or request.request_id == CONTROL:
            raise FlowedgeError(f"request id {request.request_id} is already in use on this connection")
        self.open[request.request_id] = Pending(started_s=now, last_s=now)
        return request

    def cancel(self, request_id: int) -> proto.Cancel | None:
        """Forget an unfinished request; the Cancel to send (None: nothing open by that id)."""
        return proto.Cancel(request_id=request_id) if self.open.pop(request_id, None) is not None else None

    def forget(self, request_id: int) -> None:
        """Forget a request without telling the head (its connection is going away anyway)."""
        self.open.pop(request_id, None)

    def cancel_all(self) -> list[proto.Cancel]:
        return [c for c in map(self.cancel, list(self.open)) if c is not None]

    # ---- what happened ---------------------------------------------------------------------------
    def receive(self, msg: proto.Message, now: float) -> list[Event]:
        """A message from the head, as events for its waiters."""
        self.last_heard_s = now
        if isinstance(msg, proto.Heartbeat):
            beat = proto.Heartbeat(node_id=self.node_id, load=0.0, rss_bytes=0)
            return [Send(beat)] if self.open else []
        rid = getattr(msg, "request_id", None)
        if rid is None:
            return self._control_reply(msg)
        answer = self.open.get(rid)
        if answer is None:
            return []   # a late reply to an abandoned request
        answer.last_s = now
        if isinstance(msg, proto.ErrorReply):
            del self.open[rid]
            return [Failed(rid, refusal(msg.message))]
        if not isinstance(msg, proto.TokenChunk):
            return []
        done = answer.chunk(msg, now)
        events: list[Event] = [Piece(rid, msg.text, tuple(msg.token_ids))] if msg.text or msg.token_ids else []
        if done is not None:
            del self.open[rid]
            events.append(Done(rid, done))
        return events

    def malformed(self, err: ProtocolError, now: float) -> list[Event]:
        """A frame that would not decode: the head speaks another protocol, so every waiter fails."""
        self.last_heard_s = now
        if self.control is not None and self.control.kind == "hello":
            return self._fail_all(HeadUnreachable(f"cannot reach a flowedge head at {self.addr}: {err}"))
        return self._fail_all(err)

    def lost_connection(self, now: float) -> list[Event]:
        """The connection to the head closed. Before the handshake that is a retry, not news."""
        if not self.welcomed:
            return []
        self.welcomed = False
        return self._fail_all(HeadLost(f"lost the connection to the head at {self.addr} "
                                       "(did it stop or restart?)"))

    def next_deadline(self) -> float | None:
        """When `expire` next has something to say (None: nobody waits)."""
        times = [self._deadline(a) for a in self.open.values()]
        if self.control is not None:
            times.append(self.control.since_s + self.control.limit_s)
        return min(times, default=None)

    def expire(self, now: float) -> list[Failed]:
        """Every waiter whose deadline has passed, failed."""
        events: list[Failed] = []
        c = self.control
        if c is not None and now >= c.since_s + c.limit_s:
            self.control = None
            events.append(Failed(CONTROL, self._control_timeout(c)))
        for rid, answer in list(self.open.items()):
            if now >= self._deadline(answer):
                del self.open[rid]
                quiet_s = now - max(self.last_heard_s, answer.started_s)
                silent = now - answer.last_s < self.timeout_s
                why = f"went silent for {quiet_s:.1f} s" if silent else f"gave no answer for {self.timeout_s:.0f} s"
                events.append(Failed(rid, (HeadLost if silent else FlowedgeError)(f"the head at {self.addr} {why}")))
        return events

    # ---- internals -------------------------------------------------------------------------------
    def _deadline(self, answer: Pending) -> float:
        return min(answer.last_s + self.timeout_s,
                   max(self.last_heard_s, answer.started_s) + self.head_timeout_s)

    def _control_timeout(self, c: _Control) -> FlowedgeError:
        if c.kind == "hello":
            return HeadUnreachable(f"cannot reach a flowedge head at {self.addr}: no answer to HELLO within "
                                   f"{c.limit_s:.1f} s: is the head up, and does this client have the "
                                 "cluster's keys (or do both run --insecure)?")
        return FlowedgeError(f"the head at {self.addr} gave no answer for {c.limit_s:.0f} s")

    def _control_reply(self, msg: proto.Message) -> list[Event]:
        c = self.control
        if c is None:
            return []
        if c.kind == "status":
            if not isinstance(msg, proto.StatusReply):
                return []   # e.g. a late WELCOME
            self.control = None
            return [Status(msg.nodes)]
        self.control = None
        try:
            if isinstance(msg, proto.Refuse):
                raise Refused(f"refused by peer: {msg.reason}")
            if not isinstance(msg, proto.Welcome):
                raise ProtocolError(f"expected WELCOME after HELLO, got {msg.TYPE}")
            proto.check_version(msg.version)
        except ProtocolError as err:
            return [Failed(CONTROL, HeadUnreachable(f"cannot reach a flowedge head at {self.addr}: {err}"))]
        self.welcomed = True
        return [Welcomed()]

    def _fail_all(self, err: FlowedgeError) -> list[Event]:
        events: list[Event] = [Failed(rid, err) for rid in self.open]
        if self.control is not None:
            events.append(Failed(CONTROL, err))
        self.open.clear()
        self.control = None
        return events
