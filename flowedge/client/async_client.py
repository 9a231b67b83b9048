"""The asyncio client: the same requests as `Client`, for gateway apps built on asyncio.

    from flowedge import AsyncClient
    async with AsyncClient("127.0.0.1:5555") as client:
        async for piece in client.stream("Write a haiku about routers", stop=["\\n\\n"]):
            print(piece, end="", flush=True)
        print(client.last_result.wall_tokens_per_s)

Each AsyncClient is one DEALER socket that carries any number of requests at once (several tasks may
`await` on one client): one reader task feeds every reply to the `ClientCore`, and hands the core's
events to the waiting task by request id. A stream that is abandoned (the task cancelled, the
generator closed, the client closed) sends `Cancel`, so the head stops the request and frees its KV cache.
"""
from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncGenerator, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any, TypeVar

from flowedge.client.client_answer import Answer, Chunk
from flowedge.client.client_core import (CONTROL, ClientCore, Done, Event, Failed, Pending, Piece, Prompt, Send, Status,
                                         Stops, Turns, Welcomed)
from flowedge.home import flowedge_home
from flowedge.transport.addresses import DEFAULT_PORT, head_addresses, split_addr, tcp
from flowedge.errors import FlowedgeError, HeadLost, LinkError, ProtocolError
from flowedge.transport import protocol as proto
from flowedge.transport.async_link import AsyncLink, ZmqAsyncLink
from flowedge.transport.link import Event as LinkEvent
from flowedge.transport.link import Inbound, PeerEvent

log = logging.getLogger(__name__)
FAILOVER_HELLO_S = 1.0   # with several head addresses: each address's HELLO waits this long
_Reply = TypeVar("_Reply", Welcomed, Status)   # what a HELLO, or a status request, is answered with


class _AsyncSocket:
    """AsyncClient's link calls, all of them: one DEALER to the head."""

    def __init__(self, addr: str, link: AsyncLink, own_link: bool) -> None:
        host, port = split_addr(addr)
        self.link, self.own_link = link, own_link
        self.dealer = link.dealer(tcp(host, port))

    async def send(self, msg: proto.Message) -> None:
        await self.dealer.send(msg)

    def send_nowait(self, msg: proto.Message) -> None:
        """Send if possible (a Cancel on the way out): a closed link or a full queue means no one listens."""
        self.dealer.send_nowait(msg)

    async def recv(self) -> proto.Message | ProtocolError | PeerEvent | None:
        """The next message, the ProtocolError of one that would not decode, the connection's DISCONNECTED
        (the socket monitor), or None for another peer event; LinkError once closed."""
        got = await self.dealer.receive()
        if not isinstance(got, Inbound):
            return got if got.kind is LinkEvent.DISCONNECTED else None
        try:
            return proto.decode(got.frames)
        except ProtocolError as err:
            return err

    def close(self) -> None:
        self.dealer.close()
        if self.own_link:
            self.link.close()

    def moved(self, addr: str) -> _AsyncSocket:
        """A socket to another head on the same link."""
        self.dealer.close()
        return _AsyncSocket(addr, self.link, self.own_link)


def client_link(keys_dir: str | Path | None = None, insecure: bool = False) -> AsyncLink:
    """The link AsyncClients of one process share (ZeroMQ, the cluster's client keys unless `insecure`)."""
    return ZmqAsyncLink(keys_dir or flowedge_home() / "keys", insecure)


class AsyncClient:
    """A connection to a head for asyncio code; several requests may be in flight on it at once.
    The protocol is `ClientCore`'s; this face only awaits the socket and routes events to tasks. `client`
    names whom the requests are for, for the head's fair queue (a gateway sets it; `ClientCore`).
    Several heads (`addr` = "A,B"): as `Client`, it finds the one that answers and follows the head to a
    standby that takes over, sending unfinished requests again with the tokens they hold."""

    def __init__(self, addr: str = f"127.0.0.1:{DEFAULT_PORT}", *, keys_dir: str | Path | None = None,
                 insecure: bool = False, timeout_s: float = 300.0, head_timeout_s: float = 5.0,
                 client: str = "", link: AsyncLink | None = None, failover_s: float = 15.0) -> None:
        self.heads = head_addresses(addr)
        self.addr, self.failover_s = self.heads[0], failover_s
        addr = self.addr
        self.core = ClientCore(addr, timeout_s=timeout_s, head_timeout_s=head_timeout_s, client=client)
        own = link is None
        self._socket = _AsyncSocket(addr, link if link is not None else client_link(keys_dir, insecure), own)
        self._control_lock: asyncio.Lock | None = None   # one HELLO or status exchange at a time
        self._queues: dict[int, asyncio.Queue[Event]] = {}   # request id (or CONTROL) -> its events
        self._reader: asyncio.Task[None] | None = None
        self.last_result: Answer | None = None   # the answer of the request that finished last (`chunks`: each's own)

    async def __aenter__(self) -> AsyncClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        """Cancel every unfinished request at the head, then close the socket."""
        for cancel in self.core.cancel_all():
            self._socket.send_nowait(cancel)
        if self._reader is not None:
            with contextlib.suppress(RuntimeError):   # its event loop already closed
                self._reader.cancel()
        self._socket.close()

    # ---- the socket's one reader, and the waiters ---------------------------------------------------
    @property
    def _lock(self) -> asyncio.Lock:
        """The control lock, made on first use (in the loop that runs the reader)."""
        if self._control_lock is None:
            self._control_lock = asyncio.Lock()
        return self._control_lock

    def _start_reader(self) -> None:
        if self._reader is None or self._reader.done():
            self._queues.setdefault(CONTROL, asyncio.Queue())
            self._reader = asyncio.get_running_loop().create_task(self._read())

    async def _read(self) -> None:
        """Every message from the head into the core, and its events to their waiters."""
        with contextlib.suppress(LinkError):
            while True:
                got = await self._socket.recv()
                if got is None:
                    continue
                now = time.monotonic()
                if isinstance(got, PeerEvent):   # the head's connection closed: news at once, as for `Client`
                    await self._dispatch(self.core.lost_connection(now))
                    continue
                await self._dispatch(self.core.malformed(got, now) if isinstance(got, ProtocolError)
                                     else self.core.receive(got, now))

    async def _dispatch(self, events: Sequence[Event]) -> None:
        for ev in events:
            if isinstance(ev, Send):
                await self._socket.send(ev.msg)
                continue
            queue = self._queues.get(getattr(ev, "request_id", CONTROL))
            if queue is not None:
                queue.put_nowait(ev)

    async def _next(self, key: int) -> Event:
        """The next event for one waiter; on a deadline the core's timeouts go to whoever they concern."""
        queue = self._queues[key]
        while True:
            deadline = self.core.next_deadline()
            wait_s = None if deadline is None else max(0.0, deadline - time.monotonic())
            try:
                return await asyncio.wait_for(queue.get(), wait_s)
            except TimeoutError:
                await self._dispatch(self.core.expire(time.monotonic()))

    async def _control(self, msg: proto.Message, answer: type[_Reply]) -> _Reply:
        """Send a HELLO or status request (under the control lock) and wait for its answer (Welcomed or
        Status: the core ends the exchange with it or with a Failed, which is raised)."""
        await self._socket.send(msg)
        while True:
            ev = await self._next(CONTROL)
            if isinstance(ev, Failed):
                raise ev.error
            if isinstance(ev, answer):
                return ev

    async def _hello(self) -> None:
        self._start_reader()
        async with self._lock:
            if not self.core.welcomed and len(self.heads) > 1:
                await self._reach_head(move=False)
            elif not self.core.welcomed:
                await self._control(self.core.hello(time.monotonic()), Welcomed)

    async def _reach_head(self, move: bool) -> None:
        """Each head address in turn (from the next one when `move`) until one WELCOMEs this client, for up
        to `failover_s`; HeadLost naming them all if none does. Called under the control lock."""
        deadline, last = time.monotonic() + self.failover_s, None
        while time.monotonic() < deadline:
            if move:
                self.addr = self.heads[(self.heads.index(self.addr) + 1) % len(self.heads)]
                self.core.addr, self.core.welcomed, self.core.control = self.addr, False, None
                self._socket = self._socket.moved(self.addr)
                if self._reader is not None:
                    self._reader.cancel()   # it read the old socket (a cancelled task is not done at once)
                    self._reader = None
                self._start_reader()
            move = True
            try:
                await self._control(self.core.hello(time.monotonic(), FAILOVER_HELLO_S), Welcomed)
                return
            except FlowedgeError as err:
                last = err
                await asyncio.sleep(0.1)
        raise HeadLost(f"head failover: no head answered at {', '.join(self.heads)} within {self.failover_s:g} s "
                       f"({last})")

    async def _follow_head(self, request: proto.PromptRequest, pending: Pending, lost_at: str) -> None:
        """The head was lost mid-answer: reach the one that took over (unless another request already has)
        and send it the request again with the tokens held so far."""
        async with self._lock:
            if self.addr == lost_at or not self.core.welcomed:
                await self._reach_head(move=True)
        log.warning("head failover: request %d follows the head to %s, holding %d tokens", request.request_id,
                    self.addr, len(pending.tokens))
        pending.last_s = time.monotonic()
        self.core.open[request.request_id] = pending
        await self._socket.send(replace(request, resumed=len(pending.tokens), held_ids=tuple(pending.tokens) or None))

    # ---- requests ---------------------------------------------------------------------------------
    def chunks(self, prompt: Prompt | None = None, *, messages: Turns | None = None, system: str | None = None,
               stop: Stops | None = None, raw: bool = False, max_new_tokens: int | None = None,
               max_tokens: int | None = None, temperature: float = 0.0, top_k: int | None = None,
               top_p: float | None = None, seed: int | None = None,
               strategy: str = "") -> AsyncGenerator[Chunk, None]:
        """The answer as it comes: a Chunk (text, token ids) per reply of the head, the last one carrying
        the whole Answer (so each of several concurrent streams has its own). The arguments are
        `Client.stream`'s; leaving early or being cancelled cancels the request."""
        return self._chunks(self.core.request(
            prompt, messages=messages, system=system, stop=stop, raw=raw, max_new_tokens=max_new_tokens,
            max_tokens=max_tokens, temperature=temperature, top_k=top_k, top_p=top_p, seed=seed, strategy=strategy))

    def stream(self, prompt: Prompt | None = None, *, messages: Turns | None = None, system: str | None = None,
               stop: Stops | None = None, raw: bool = False, max_new_tokens: int | None = None,
               max_tokens: int | None = None, temperature: float = 0.0, top_k: int | None = None,
               top_p: float | None = None, seed: int | None = None,
               strategy: str = "") -> AsyncGenerator[str, None]:
        """Text pieces as the head accepts tokens (the arguments are `Client.stream`'s); afterwards
        `last_result` holds the Answer. Leaving early or being cancelled cancels the request."""
        return _texts(self._chunks(self.core.request(
            prompt, messages=messages, system=system, stop=stop, raw=raw, max_new_tokens=max_new_tokens,
            max_tokens=max_tokens, temperature=temperature, top_k=top_k, top_p=top_p, seed=seed, strategy=strategy)))

    async def generate(self, prompt: Prompt | None = None, *, messages: Turns | None = None, system: str | None = None,
                       stop: Stops | None = None, raw: bool = False, max_new_tokens: int | None = None,
                       max_tokens: int | None = None, temperature: float = 0.0, top_k: int | None = None,
                       top_p: float | None = None, seed: int | None = None,
                       strategy: str = "") -> Answer:
        """The whole answer at once (the arguments are `Client.stream`'s); safe to run several at once."""
        chunks = self._chunks(self.core.request(
            prompt, messages=messages, system=system, stop=stop, raw=raw, max_new_tokens=max_new_tokens,
            max_tokens=max_tokens, temperature=temperature, top_k=top_k, top_p=top_p, seed=seed, strategy=strategy))
        try:
            async for chunk in chunks:
                if chunk.answer is not None:
                    return chunk.answer
        finally:
            await chunks.aclose()
        raise FlowedgeError("the answer ended without its totals")   # the core always ends with Done or Failed

    async def _chunks(self, request: proto.PromptRequest) -> AsyncGenerator[Chunk, None]:
        rid = request.request_id   # a bad request was refused before this, by the core
        await self._hello()
        self._queues[rid] = asyncio.Queue()
        try:
            await self._socket.send(self.core.start(request, time.monotonic()))
            pending, addr = self.core.open[rid], self.addr
            while True:
                ev = await self._next(rid)
                if isinstance(ev, Failed) and isinstance(ev.error, HeadLost) and len(self.heads) > 1:
                    await self._follow_head(request, pending, addr)
                    addr = self.addr
                    continue
                if isinstance(ev, Piece):
                    yield Chunk(ev.text, ev.token_ids)
                elif isinstance(ev, Done):
                    self.last_result = ev.answer
                    yield Chunk("", answer=ev.answer)
                    break
                elif isinstance(ev, Failed):
                    raise ev.error
        finally:
            del self._queues[rid]
            cancel = self.core.cancel(rid)   # None when the head finished or failed it
            if cancel is not None:
                self._socket.send_nowait(cancel)

    async def status(self, timeline: bool = False) -> list[dict[str, Any]]:
        """One map per node, as `flowedge status --json`; `timeline`: with the head's recent past."""
        await self._hello()
        async with self._lock:
            return (await self._control(self.core.status(time.monotonic(), timeline), Status)).nodes


async def _texts(chunks: AsyncGenerator[Chunk, None]) -> AsyncGenerator[str, None]:
    """The chunks' text pieces (none empty); closing this closes the chunks, which cancels the request."""
    try:
        async for chunk in chunks:
            if chunk.text:
                yield chunk.text
    finally:
        await chunks.aclose()
