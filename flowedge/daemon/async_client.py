"""The asyncio client: the same requests as `Client`, for gateway apps built on asyncio.

    from flowedge import AsyncClient
    async with AsyncClient("127.0.0.1:5555") as client:
        async for piece in client.stream("Write a haiku about routers", stop=["\\n\\n"]):
            print(piece, end="", flush=True)
        print(client.last_result["wall_tokens_per_s"])

Each AsyncClient is one DEALER socket; one request at a time per client (open one per concurrent
request: they are cheap, and several can share a `zmq.asyncio.Context`). A stream that is abandoned
(the task cancelled, the generator closed, the client closed or its next request started) sends
`Cancel`, so the head stops the request and frees its KV cache.
"""
from __future__ import annotations

import itertools
import os
import time
from collections.abc import AsyncIterator
from pathlib import Path

import zmq
import zmq.asyncio

from flowedge.daemon.client import Answer, prompt_request, send_cancel
from flowedge.daemon.config import DEFAULT_PORT, flowedge_home, split_addr, tcp
from flowedge.errors import FlowedgeError, ProtocolError
from flowedge.transport import protocol as proto
from flowedge.transport.security import load_keys, secure_client, warn_insecure

HELLO_TIMEOUT_S = 10.0


class AsyncClient:
    """A connection to a head for asyncio code. Not safe for two requests at once."""

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
        self._open: int | None = None      # the request id of a stream not yet finished
        self.last_result: dict | None = None

    async def __aenter__(self) -> AsyncClient:
        return self

    async def __aexit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        """Cancel an abandoned stream's request at the head, then close the socket."""
        self._cancel_open()
        self.sock.close(0)
        if self._own_ctx:
            self.ctx.term()

    def _cancel_open(self) -> None:
        if self._open is not None:
            send_cancel(self.sock, self._open)
        self._open = None

    async def _send(self, msg: proto.Message) -> None:
        await self.sock.send_multipart(msg.to_frames(), copy=False)

    async def _recv(self, timeout_s: float | None = None) -> proto.Message:
        """The next answer; while a request is open the head heartbeats this client, which answers each
        heartbeat and gives up after `head_timeout_s` without a word (as `Client` does)."""
        start = time.monotonic()
        limit_s = self.timeout_s if timeout_s is None else timeout_s
        while True:
            wait_s = limit_s - (time.monotonic() - start)
            if self._open is not None:
                wait_s = min(wait_s, self.head_timeout_s)
            if wait_s <= 0 or not await self.sock.poll(int(wait_s * 1000), zmq.POLLIN):
                raise FlowedgeError(f"the head at {self.addr} went silent for {time.monotonic() - start:.1f} s")
            msg = proto.decode(await self.sock.recv_multipart(copy=False))
            if not isinstance(msg, proto.Heartbeat):
                return msg
            if self._open is not None:
                await self._send(proto.Heartbeat(node_id=f"client-{os.getpid()}", load=0.0, rss_bytes=0))

    async def _hello(self) -> None:
        if self._welcomed:
            return
        await self._send(proto.Hello(node_id=f"client-{os.getpid()}", role="client", device="client",
                                     free_memory_bytes=0, capabilities={"heartbeat": True}))
        try:
            reply = await self._recv(min(self.timeout_s, HELLO_TIMEOUT_S))
        except (FlowedgeError, ProtocolError) as err:
            raise FlowedgeError(f"cannot reach a flowedge head at {self.addr}: {err}") from None
        if isinstance(reply, proto.Refuse):
            raise FlowedgeError(f"the head at {self.addr} refused this client: {reply.reason}")
        if not isinstance(reply, proto.Welcome):
            raise FlowedgeError(f"the head at {self.addr} answered HELLO with {reply.TYPE}")
        self._welcomed = True

    async def stream(self, prompt: str | list[int] | None = None, **kwargs) -> AsyncIterator[str]:
        """Text pieces as the head accepts tokens (same arguments as `Client.stream`); afterwards
        `last_result` holds the totals. Leaving early or being cancelled cancels the request."""
        self._cancel_open()   # a stream abandoned without being closed
        request = prompt_request(next(self._ids), prompt, **kwargs)   # a bad one is refused before the head
        rid = request.request_id
        await self._hello()
        await self._send(request)
        self._open = rid
        answer = Answer()
        try:
            while not answer.done:
                piece = answer.take(await self._recv(), rid)
                if piece:
                    yield piece
        finally:
            if answer.done:
                self._open = None
            else:
                self._cancel_open()
        self.last_result = answer.result

    async def generate(self, prompt: str | list[int] | None = None, **kwargs) -> dict:
        """The whole answer at once (the keys of `Client.generate`)."""
        async for _ in self.stream(prompt, **kwargs):
            pass
        return dict(self.last_result or {})

    async def status(self) -> list[dict]:
        """One map per node, as `flowedge status --json`."""
        await self._hello()
        await self._send(proto.StatusRequest())
        while True:
            msg = await self._recv()
            if isinstance(msg, proto.StatusReply):
                return msg.nodes
