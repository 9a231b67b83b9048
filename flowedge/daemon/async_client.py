"""The asyncio client: the same requests as `Client`, for gateway apps built on asyncio.

    from flowedge import AsyncClient
    async with AsyncClient("127.0.0.1:5555") as client:
        async for piece in client.stream("Write a haiku about routers", stop=["\\n\\n"]):
            print(piece, end="", flush=True)
        print(client.last_result["wall_tokens_per_s"])

Each AsyncClient is one DEALER socket that carries any number of requests at once (several tasks may
`await` on one client): one reader task hands each reply to its request by request id. A stream
that is abandoned (the task cancelled, the generator closed, the client closed) sends `Cancel`, so
the head stops the request and frees its KV cache.
"""
from __future__ import annotations

import asyncio
import contextlib
import itertools
import os
import time
from collections.abc import AsyncIterator
from pathlib import Path

import zmq
import zmq.asyncio

from flowedge.daemon.client import HELLO_TIMEOUT_S, Answer, prompt_request, send_cancel
from flowedge.daemon.config import DEFAULT_PORT, flowedge_home, split_addr, tcp
from flowedge.errors import FlowedgeError, ProtocolError
from flowedge.transport import protocol as proto
from flowedge.transport.security import load_keys, secure_client, warn_insecure


class AsyncClient:
    """A connection to a head for asyncio code; several requests may be in flight on it at once."""

    def __init__(self, addr: str = f"127.0.0.1:{DEFAULT_PORT}", *, keys_dir: str | Path | None = None,
                 insecure: bool = False, timeout_s: float = 300.0, head_timeout_s: float = 5.0,
                 context: zmq.asyncio.Context | None = None) -> None:
        self.addr = addr
        self.timeout_s = timeout_s
        self.head_timeout_s = head_timeout_s
        self._own_ctx = context is None
        self.ctx = context or zmq.asyncio.Context()
        self.sock = self.ctx.socket(zmq.DEALER)
        self.sock.linger = 0
        if insecure:
            warn_insecure()
        else:
            secure_client(self.sock, load_keys(keys_dir or flowedge_home() / "keys"))
        host, port = split_addr(addr)
        self.sock.connect(tcp(host, port))
        self._ids = itertools.count(1)
        self._welcomed = False
        self._control_lock: asyncio.Lock | None = None   # HELLO and status: replies without a request id
        self._control: asyncio.Queue | None = None
        self._open: dict[int, asyncio.Queue] = {}        # request id -> its replies, for unfinished requests
        self._reader: asyncio.Task | None = None
        self._last_heard = time.monotonic()
        self.last_result: dict | None = None             # the totals of the request that finished last

    async def __aenter__(self) -> AsyncClient:
        return self

    async def __aexit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        """Cancel every unfinished request at the head, then close the socket."""
        for rid in list(self._open):
            send_cancel(self.sock, rid)
        self._open.clear()
        if self._reader is not None:
            with contextlib.suppress(RuntimeError):   # its event loop already closed
                self._reader.cancel()
        self.sock.close(0)
        if self._own_ctx:
            self.ctx.term()

    # ---- the socket's one reader ------------------------------------------------------------------
    def _start_reader(self) -> None:
        if self._reader is None or self._reader.done():
            self._control_lock = self._control_lock or asyncio.Lock()
            self._control = self._control or asyncio.Queue()
            self._reader = asyncio.get_running_loop().create_task(self._read())

    async def _read(self) -> None:
        """Every message from the head to whoever waits for it; heartbeats answered while requests are open."""
        with contextlib.suppress(zmq.ZMQError):
            while True:
                frames = await self.sock.recv_multipart(copy=False)
                self._last_heard = time.monotonic()
                try:
                    msg = proto.decode(frames)
                except ProtocolError as err:
                    msg = err
                if isinstance(msg, proto.Heartbeat):
                    if self._open:
                        await self._send(proto.Heartbeat(node_id=f"client-{os.getpid()}", load=0.0, rss_bytes=0))
                    continue
                queue = self._open.get(getattr(msg, "request_id", None))
                (queue or self._control).put_nowait(msg)

    async def _send(self, msg: proto.Message) -> None:
        await self.sock.send_multipart(msg.to_frames(), copy=False)

    async def _next(self, queue: asyncio.Queue, timeout_s: float | None = None,
                    open_request: bool = False) -> proto.Message:
        """The next message for one waiter. A request in progress gives up after `head_timeout_s`
        without a word from the head (it heartbeats while it holds a request), any wait after `timeout_s`."""
        start = time.monotonic()
        limit_s = self.timeout_s if timeout_s is None else timeout_s
        while True:
            now = time.monotonic()
            wait_s = limit_s - (now - start)
            if open_request:
                wait_s = min(wait_s, self.head_timeout_s - (now - max(self._last_heard, start)))
            if wait_s <= 0:
                raise FlowedgeError(f"the head at {self.addr} went silent for {now - start:.1f} s")
            try:
                msg = await asyncio.wait_for(queue.get(), wait_s)
            except TimeoutError:
                continue   # heard meanwhile (another request's reply, a heartbeat)? the loop decides
            if isinstance(msg, ProtocolError):
                raise msg
            return msg

    async def _hello(self) -> None:
        self._start_reader()
        async with self._control_lock:
            if self._welcomed:
                return
            await self._send(proto.Hello(node_id=f"client-{os.getpid()}", role="client", device="client",
                                         free_memory_bytes=0, capabilities={"heartbeat": True}))
            try:
                reply = await self._next(self._control, min(self.timeout_s, HELLO_TIMEOUT_S))
            except (FlowedgeError, ProtocolError) as err:
                raise FlowedgeError(f"cannot reach a flowedge head at {self.addr}: {err}") from None
            if isinstance(reply, proto.Refuse):
                raise FlowedgeError(f"the head at {self.addr} refused this client: {reply.reason}")
            if not isinstance(reply, proto.Welcome):
                raise FlowedgeError(f"the head at {self.addr} answered HELLO with {reply.TYPE}")
            self._welcomed = True

    # ---- requests ---------------------------------------------------------------------------------
    def stream(self, prompt: str | list[int] | None = None, **kwargs) -> AsyncIterator[str]:
        """Text pieces as the head accepts tokens (same arguments as `Client.stream`); afterwards
        `last_result` holds the totals. Leaving early or being cancelled cancels the request."""
        return self._pieces(Answer(), prompt, **kwargs)

    async def generate(self, prompt: str | list[int] | None = None, **kwargs) -> dict:
        """The whole answer at once (the keys of `Client.generate`); safe to run several at once."""
        answer = Answer()
        async for _ in self._pieces(answer, prompt, **kwargs):
            pass
        return dict(answer.result or {})

    async def _pieces(self, answer: Answer, prompt: str | list[int] | None, **kwargs) -> AsyncIterator[str]:
        request = prompt_request(next(self._ids), prompt, **kwargs)   # a bad one is refused before the head
        rid = request.request_id
        await self._hello()
        queue: asyncio.Queue = asyncio.Queue()
        self._open[rid] = queue
        try:
            await self._send(request)
            while not answer.done:
                piece = answer.take(await self._next(queue, open_request=True), rid)
                if piece:
                    yield piece
        finally:
            if self._open.pop(rid, None) is not None and not answer.done:
                send_cancel(self.sock, rid)
        self.last_result = answer.result

    async def status(self) -> list[dict]:
        """One map per node, as `flowedge status --json`."""
        await self._hello()
        async with self._control_lock:
            await self._send(proto.StatusRequest())
            while True:
                msg = await self._next(self._control)
                if isinstance(msg, proto.StatusReply):
                    return msg.nodes
