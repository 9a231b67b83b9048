"""The client side: stream an answer from a running head, ask for status, or stop the cluster.

Embedding in a gateway app:

    from flowedge import Client
    client = Client("127.0.0.1:5555")
    for piece in client.stream("Write a haiku about routers", max_tokens=64):
        print(piece, end="", flush=True)
    print(client.last_result.wall_tokens_per_s)      # last_result: the typed Answer (client_answer.py)
"""
from __future__ import annotations

import contextlib
import logging
import time
from collections import deque
from dataclasses import replace
from collections.abc import Generator
from pathlib import Path
from typing import Any, TypeVar

from flowedge.client.client_answer import Answer, Chunk
from flowedge.client.client_core import (CONTROL, ClientCore, Done, Event, Failed, Pending, Piece, Prompt, Send, Status,
                                         Stops, Turns, Welcomed, prompt_request)
from flowedge.errors import FlowedgeError, HeadLost, LinkError, ProtocolError, RequestFailed
from flowedge.home import flowedge_home
from flowedge.transport import protocol as proto
from flowedge.transport.addresses import DEFAULT_PORT, head_addresses, split_addr, tcp
from flowedge.transport.link import Event as LinkEvent
from flowedge.transport.link import Inbound, Kind, Link, PeerEvent
from flowedge.transport.zmq_link import ZmqLink

log = logging.getLogger(__name__)

FAILOVER_HELLO_S = 1.0   # with several head addresses: each address's HELLO waits this long
_Reply = TypeVar("_Reply", Welcomed, Status)   # what a HELLO, or a status request, is answered with

__all__ = ["Answer", "Chunk", "Client", "RequestFailed", "prompt_request", "wait_ready"]


class _Socket:
    """The sync client's link calls, all of them: a DEALER to the head, whose DISCONNECTED event says
    the connection closed. It feeds what arrives to the core and returns the core's events; it decides
    nothing itself."""

    def __init__(self, addr: str, link: Link, own_link: bool) -> None:
        host, port = split_addr(addr)
        self.link, self.own_link = link, own_link
        self.dealer = link.connect(Kind.DEALER, tcp(host, port))
        self.held: deque[Inbound] = deque()   # messages read while forgetting old disconnects

    def send(self, msg: proto.Message) -> None:
        self.dealer.send(msg)

    def send_nowait(self, msg: proto.Message) -> None:
        """Send if possible (a Cancel on the way out): a closed link or a gone head means no one listens."""
        with contextlib.suppress(LinkError):
            self.dealer.send(msg)

    def pump(self, core: ClientCore, timeout_s: float) -> list[Event]:
        """Wait up to `timeout_s` for one thing to happen and tell the core."""
        got = self.held.popleft() if self.held else self.dealer.receive(max(0.0, timeout_s))
        now = time.monotonic()
        if isinstance(got, Inbound):
            try:
                return core.receive(proto.decode(got.frames), now)
            except ProtocolError as err:
                return core.malformed(err, now)
        if isinstance(got, PeerEvent) and got.kind is LinkEvent.DISCONNECTED:
            return core.lost_connection(now)
        return []

    def forget_disconnects(self) -> None:
        """Disconnects from before the handshake are no news (the link reconnects by itself)."""
        while (got := self.dealer.receive(0)) is not None:
            if isinstance(got, Inbound):
                self.held.append(got)

    def close(self) -> None:
        self.dealer.close()
        if self.own_link:
            self.link.close()

    def moved(self, addr: str) -> _Socket:
        """A socket to another head on the same link (this one's connection closed)."""
        self.dealer.close()
        return _Socket(addr, self.link, self.own_link)


class Client:
    """A connection to a head. Not thread-safe: one per thread.

    Liveness (Paranoid Pirate): while a request is in progress the head heartbeats this client, which
    answers each heartbeat (so the head drops the request of a client that went away). A closed
    connection to the head (the socket monitor) raises FlowedgeError at once, and so does
    `head_timeout_s` without a word from the head while a request is in progress; `timeout_s` bounds
    the wait for any answer. Closing the client (or the stream) mid-answer cancels the request.
    The protocol is `ClientCore`'s; this face only blocks on the link (its own ZeroMQ link with the
    cluster's keys, unless given one: a `MemoryLink` puts it in an in-process cluster). `client` names
    whom the requests are for, for the head's fair queue (`ClientCore`).

    Several heads (`addr` = "A,B": a head and its standbys): when the head is lost mid-answer, the client
    tries the addresses in turn for up to `failover_s` and sends the request again to the one that took
    over, saying how many tokens it holds; the new head continues after them (node/replication.py)."""

    def __init__(self, addr: str = f"127.0.0.1:{DEFAULT_PORT}", *, keys_dir: str | Path | None = None,
                 insecure: bool = False, timeout_s: float = 300.0, head_timeout_s: float = 5.0,
                 client: str = "", link: Link | None = None, failover_s: float = 15.0) -> None:
        self.heads = head_addresses(addr)
        self.addr, self.failover_s = self.heads[0], failover_s
        addr = self.addr
        self.core = ClientCore(addr, timeout_s=timeout_s, head_timeout_s=head_timeout_s, client=client)
        own = link is None
        link = link if link is not None else ZmqLink(keys_dir or flowedge_home() / "keys", insecure)
        self._socket = _Socket(addr, link, own)
        self._streaming: int | None = None
        self.last_result: Answer | None = None   # the answer of the request that finished last

    @property
    def in_flight(self) -> int | None:
        """The id of the request being streamed, while the head still owes it an answer."""
        return self._streaming if self._streaming in self.core.open else None

    def close(self) -> None:
        self.cancel()
        self._socket.close()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def cancel(self) -> None:
        """Drop the request being streamed: the head frees its KV cache on every stage."""
        for msg in self.core.cancel_all():
            self._socket.send_nowait(msg)

    # ---- the one blocking loop --------------------------------------------------------------------
    def _events(self) -> list[Event]:
        """The core's next events for a caller (heartbeat answers sent on the way); blocks until some."""
        while True:
            now = time.monotonic()
            events: list[Event] = list(self.core.expire(now))
            if not events:
                deadline = self.core.next_deadline()
                events = self._socket.pump(self.core, 0.1 if deadline is None else deadline - now)
            for ev in events:
                if isinstance(ev, Send):
                    self._socket.send(ev.msg)
            events = [ev for ev in events if not isinstance(ev, Send)]
            if events:
                return events

    def _control(self, msg: proto.Message, answer: type[_Reply]) -> _Reply:
        """Send a HELLO or status request and wait for its answer, Welcomed or Status (replies to a request
        are dropped)."""
        self._socket.send(msg)
        while True:
            for ev in self._events():
                if isinstance(ev, answer):
                    return ev
                if isinstance(ev, Failed) and ev.request_id == CONTROL:
                    raise ev.error

    def _hello(self) -> None:
        if self.core.welcomed:
            return
        if len(self.heads) > 1:
            self._reach_head(move=False)
            return
        self._control(self.core.hello(time.monotonic()), Welcomed)
        self._socket.forget_disconnects()

    def _reach_head(self, move: bool) -> None:
        """Each head address in turn (from the next one when `move`: this one was lost) until one WELCOMEs
        this client, for up to `failover_s`; HeadLost naming them all if none does."""
        deadline, last = time.monotonic() + self.failover_s, None
        while time.monotonic() < deadline:
            if move:
                self.addr = self.heads[(self.heads.index(self.addr) + 1) % len(self.heads)]
                self.core.addr, self.core.welcomed, self.core.control = self.addr, False, None
                self._socket = self._socket.moved(self.addr)
            move = True
            try:
                self._control(self.core.hello(time.monotonic(), FAILOVER_HELLO_S), Welcomed)
            except FlowedgeError as err:
                last = err
                time.sleep(0.1)
                continue
            self._socket.forget_disconnects()
            return
        raise HeadLost(f"head failover: no head answered at {', '.join(self.heads)} within {self.failover_s:g} s "
                       f"({last})")

    # ---- requests -------------------------------------------------------------------------------
    def chunks(self, prompt: Prompt | None = None, *, messages: Turns | None = None, system: str | None = None,
               stop: Stops | None = None, raw: bool = False, max_new_tokens: int | None = None,
               max_tokens: int | None = None, temperature: float = 0.0, top_k: int | None = None,
               top_p: float | None = None, seed: int | None = None,
               strategy: str = "") -> Generator[Chunk, None, None]:
        """The answer as it comes: a Chunk (text, token ids) per reply of the head, the last one carrying
        the whole Answer. The arguments are `stream`'s."""
        return self._chunks(self.core.request(
            prompt, messages=messages, system=system, stop=stop, raw=raw, max_new_tokens=max_new_tokens,
            max_tokens=max_tokens, temperature=temperature, top_k=top_k, top_p=top_p, seed=seed, strategy=strategy))

    def stream(self, prompt: Prompt | None = None, *, messages: Turns | None = None, system: str | None = None,
               stop: Stops | None = None, raw: bool = False, max_new_tokens: int | None = None,
               max_tokens: int | None = None, temperature: float = 0.0, top_k: int | None = None,
               top_p: float | None = None, seed: int | None = None,
               strategy: str = "") -> Generator[str, None, None]:
        """Yield text pieces as the head accepts tokens; afterwards `last_result` holds the Answer.

        `prompt` is a user turn (through the chat template), with `raw` the model's text as is, or token
        ids; `messages` a whole conversation; `system` a system turn before either; `stop` strings end the
        answer (cut off); `max_new_tokens` (or its OpenAI name `max_tokens`) bounds it (default 64);
        `strategy` overrides the head's. A request that cannot be sent raises FlowedgeError here, before
        the head sees it. Leaving the loop early cancels the request at the head."""
        return _texts(self._chunks(self.core.request(
            prompt, messages=messages, system=system, stop=stop, raw=raw, max_new_tokens=max_new_tokens,
            max_tokens=max_tokens, temperature=temperature, top_k=top_k, top_p=top_p, seed=seed, strategy=strategy)))

    def generate(self, prompt: Prompt | None = None, *, messages: Turns | None = None, system: str | None = None,
                 stop: Stops | None = None, raw: bool = False, max_new_tokens: int | None = None,
                 max_tokens: int | None = None, temperature: float = 0.0, top_k: int | None = None,
                 top_p: float | None = None, seed: int | None = None, strategy: str = "") -> Answer:
        """The whole answer at once (the arguments are `stream`'s)."""
        chunks = self._chunks(self.core.request(
            prompt, messages=messages, system=system, stop=stop, raw=raw, max_new_tokens=max_new_tokens,
            max_tokens=max_tokens, temperature=temperature, top_k=top_k, top_p=top_p, seed=seed, strategy=strategy))
        return _last(chunks)

    def _chunks(self, request: proto.PromptRequest) -> Generator[Chunk, None, None]:
        rid = request.request_id
        self._hello()
        self._socket.send(self.core.start(request, time.monotonic()))
        self._streaming = rid
        pending = self.core.open[rid]
        try:
            while rid in self.core.open:
                for ev in self._events():
                    if isinstance(ev, Piece) and ev.request_id == rid:
                        yield Chunk(ev.text, ev.token_ids)
                    elif isinstance(ev, Done) and ev.request_id == rid:
                        self.last_result = ev.answer
                        yield Chunk("", answer=ev.answer)
                    elif isinstance(ev, Failed) and ev.request_id == rid and self._can_follow(ev.error):
                        self._follow_head(request, pending)
                    elif isinstance(ev, Failed) and ev.request_id in (rid, CONTROL):
                        raise ev.error
        finally:
            self._streaming = None
            cancel = self.core.cancel(rid)   # None when the head finished or failed it
            if cancel is not None:
                self._socket.send_nowait(cancel)

    def _can_follow(self, error: FlowedgeError) -> bool:
        return isinstance(error, HeadLost) and len(self.heads) > 1

    def _follow_head(self, request: proto.PromptRequest, pending: Pending) -> None:
        """The head was lost mid-answer: find the head that took over (each address in turn, for up to
        `failover_s`) and send it the request again with the tokens held so far; FlowedgeError naming
        the failover if none answers."""
        self._reach_head(move=True)
        log.warning("head failover: request %d follows the head to %s, holding %d tokens", request.request_id,
                    self.addr, len(pending.tokens))
        pending.last_s = time.monotonic()
        self.core.open[request.request_id] = pending
        self._socket.send(replace(request, resumed=len(pending.tokens), held_ids=tuple(pending.tokens) or None))

    def status(self, timeline: bool = False) -> list[dict[str, Any]]:
        """One map per node, as `flowedge status --json`; `timeline`: the head's row carries its recent
        past too (`timeline`, node/timeline.py)."""
        self._hello()
        return self._control(self.core.status(time.monotonic(), timeline), Status).nodes

    def shutdown(self, reason: str = "") -> None:
        """Ask the head to stop itself and every stage."""
        self._hello()
        self._socket.send(proto.Shutdown(reason=reason))
        time.sleep(0.1)


def _texts(chunks: Generator[Chunk, None, None]) -> Generator[str, None, None]:
    """The chunks' text pieces (none empty); closing this closes the chunks, which cancels the request."""
    try:
        for chunk in chunks:
            if chunk.text:
                yield chunk.text
    finally:
        chunks.close()


def _last(chunks: Generator[Chunk, None, None]) -> Answer:
    with contextlib.closing(chunks):
        for chunk in chunks:
            if chunk.answer is not None:
                return chunk.answer
    raise FlowedgeError("the answer ended without its totals")   # the core always ends with Done or Failed


def wait_ready(addr: str, timeout_s: float, *, keys_dir=None, insecure: bool = False,
               progress=None, alive=lambda: True, why=lambda: "", drafters: int = 0) -> list[dict]:
    """Poll a head's status until every stage (and `drafters` drafter nodes) is ready; FlowedgeError on
    timeout or if `alive()` fails.

    Each try uses a fresh connection, so replies queued behind a head that is still loading its
    models can never be mistaken for the answer to a later try."""
    deadline = time.monotonic() + timeout_s
    last = ""
    while time.monotonic() < deadline:
        if not alive():
            raise FlowedgeError(why() or "a cluster process exited before the cluster became ready (see its log)")
        client = Client(addr, keys_dir=keys_dir, insecure=insecure, timeout_s=1.0)  # bad keys raise here
        try:
            nodes = client.status()
        except FlowedgeError:
            line = "waiting for the head (loading models)"
        else:
            stages = [n for n in nodes[1:] if n.get("role") == "stage"]
            drafting = sum(1 for n in nodes if n.get("role") == "drafter" and n.get("ready"))
            if nodes and nodes[0].get("ready") and drafting >= drafters:
                return nodes
            line = f"{sum(1 for n in stages if n.get('ready'))}/{len(stages)} stages ready" + \
                (f", {drafting}/{drafters} drafters" if drafters else "")
        finally:
            client.close()
        if progress and line != last:
            progress(line)
            last = line
        time.sleep(0.5)
    raise FlowedgeError(f"the cluster at {addr} was not ready within {timeout_s:.0f} s")
