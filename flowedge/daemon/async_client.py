"""The asyncio client: the same requests as `Client`, for gateway apps built on asyncio.

    from flowedge import AsyncClient
    async with AsyncClient("127.0.0.1:5555") as client:
        async for piece in client.stream("Write a haiku about routers", stop=["\\n\\n"]):
            print(piece, end="", flush=True)
        print(client.last_result["wall_tokens_per_s"])

Each AsyncClient is one DEALER socket that carries any number of requests at once (several tasks may
`await` on one client): one reader task feeds every reply to the `ClientCore`, and hands the core's
events to the waiting task by request id. A stream that is abandoned (the task cancelled, the
generator closed, the client closed) sends `Cancel`, so the head stops the request and frees its KV cache.
"""
from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator
from pathlib import Path

from flowedge.daemon.client_core import CONTROL, ClientCore, Done, Event, Failed, Piece, Send, Status, Welcomed
from flowedge.daemon.config import DEFAULT_PORT, flowedge_home, split_addr, tcp
from flowedge.errors import LinkError, ProtocolError
from flowedge.transport import protocol as proto
from flowedge.transport.async_link import AsyncLink, ZmqAsyncLink
from flowedge.transport.link import Inbound


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

    async def recv(self) -> proto.Message | ProtocolError | None:
        """The next message, the ProtocolError of one that would not decode, or None for a peer event;
        LinkError once closed."""
        got = await self.dealer.receive()
        if not isinstance(got, Inbound):
            return None
        try:
            return proto.decode(got.frames)
        except ProtocolError as err:
            return err

    def close(self) -> None:
        self.dealer.close()
        if self.own_link:
            self.link.close()


def client_link(keys_dir: str | Path | None = None, insecure: bool = False) -> AsyncLink:
    """The link AsyncClients of one process share (ZeroMQ, the cluster's client keys unless `insecure`)."""
    return ZmqAsyncLink(keys_dir or flowedge_home() / "keys", insecure)


class AsyncClient:
    """A connection to a head for asyncio code; several requests may be in flight on it at once.
    The protocol is `ClientCore`'s; this face only awaits the socket and routes events to tasks."""

    def __init__(self, addr: str = f"127.0.0.1:{DEFAULT_PORT}", *, keys_dir: str | Path | None = None,
                 insecure: bool = False, timeout_s: float = 300.0, head_timeout_s: float = 5.0,
                 link: AsyncLink | None = None) -> None:
        self.addr = addr
        split_addr(addr)   # an address mistake is named before a missing key (the link loads the keys)
        self.core = ClientCore(addr, timeout_s=timeout_s, head_timeout_s=head_timeout_s)
        own = link is None
        self._socket = _AsyncSocket(addr, client_link(keys_dir, insecure) if own else link, own)
        self._control_lock: asyncio.Lock | None = None   # one HELLO or status exchange at a time
        self._queues: dict[int, asyncio.Queue] = {}      # request id (or CONTROL) -> its events
        self._reader: asyncio.Task | None = None
        self.last_result: dict | None = None             # the totals of the request that finished last

    async def __aenter__(self) -> AsyncClient:
        return self

    async def __aexit__(self, *exc) -> None:
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
    def _start_reader(self) -> None:
        if self._reader is None or self._reader.done():
            self._control_lock = self._control_lock or asyncio.Lock()
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
                bad = isinstance(got, ProtocolError)
                await self._dispatch(self.core.malformed(got, now) if bad else self.core.receive(got, now))

    async def _dispatch(self, events: list[Event]) -> None:
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

    async def _control(self, msg: proto.Message) -> Welcomed | Status:
        """Send a HELLO or status request (under the control lock) and wait for its answer."""
        await self._socket.send(msg)
        ev = await self._next(CONTROL)
        if isinstance(ev, Failed):
            raise ev.error
        return ev

    async def _hello(self) -> None:
        self._start_reader()
        async with self._control_lock:
            if not self.core.welcomed:
                await self._control(self.core.hello(time.monotonic()))

    # ---- requests ---------------------------------------------------------------------------------
    def stream(self, prompt: str | list[int] | None = None, **kwargs) -> AsyncIterator[str]:
        """Text pieces as the head accepts tokens (same arguments as `Client.stream`); afterwards
        `last_result` holds the totals. Leaving early or being cancelled cancels the request."""
        return self._pieces({}, prompt, **kwargs)

    async def generate(self, prompt: str | list[int] | None = None, **kwargs) -> dict:
        """The whole answer at once (the keys of `Client.generate`); safe to run several at once."""
        result: dict = {}
        async for _ in self._pieces(result, prompt, **kwargs):
            pass
        return dict(result)

    async def _pieces(self, result: dict, prompt: str | list[int] | None, **kwargs) -> AsyncIterator[str]:
        request = self.core.request(prompt, **kwargs)   # a bad one is refused before the head
        rid = request.request_id
        await self._hello()
        self._queues[rid] = asyncio.Queue()
        try:
            await self._socket.send(self.core.start(request, time.monotonic()))
            while True:
                ev = await self._next(rid)
                if isinstance(ev, Piece):
                    yield ev.text
                elif isinstance(ev, Done):
                    result.update(ev.result)
                    break
                elif isinstance(ev, Failed):
                    raise ev.error
        finally:
            del self._queues[rid]
            cancel = self.core.cancel(rid)   # None when the head finished or failed it
            if cancel is not None:
                self._socket.send_nowait(cancel)
        self.last_result = result

    async def status(self) -> list[dict]:
        """One map per node, as `flowedge status --json`."""
        await self._hello()
        async with self._control_lock:
            return (await self._control(self.core.status(time.monotonic()))).nodes
