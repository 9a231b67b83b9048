"""A deadline for a request's head (request line + headers): the one slow-client bound uvicorn lacks.

uvicorn bounds what it can through its `Config` (set in server.py): `h11_max_incomplete_event_size` the
bytes of an incomplete head, `limit_concurrency` the connections and tasks at once (503 beyond),
`timeout_keep_alive` the idle time between requests. None of them bounds time while a head arrives:
the keep-alive timer is cancelled by the first byte, so a client that trickles header bytes (slowloris)
holds a connection for ever, and enough of them exhaust the server (uvicorn has no request-start
timeout; the request for one is still open upstream). Starlette sees a request only once its head is
complete, so no middleware alone can time it either.

So this module is a small adapter over two public seams, and patches nothing:
- `HeadWatch.protocol_class()` is an `asyncio.Protocol` given to uvicorn as its `http=` class (a
  documented `Config` option). It wraps uvicorn's stock h11 protocol by composition: every asyncio
  call is passed on unchanged; around them a timer runs while a head is awaited (from the connection's
  opening, and from the first byte after each answer), armed once and not reset by further bytes. If
  it fires, the connection is closed.
- `HeadWatch.middleware` is an ASGI middleware: the app being called is the moment the head is
  complete (the timer stops), the last body message sent is the answer's end. It finds its connection
  by the client address and port, which name one TCP connection. A long streamed answer is never cut.

The same waits feed the server's `Admission` (admission.py): a connection waiting for its head is
counted for its client address, and the connections it names (the oldest waiting ones, of an address
or of all, past the limits) are closed. A connection closed here is reported lost to uvicorn's protocol
at once (asyncio's own `connection_lost` comes a loop turn later and is then not passed on), so it
leaves what `limit_concurrency` counts now: closed-but-not-yet-lost connections of a flood once filled
that cap and a legitimate request got 503.
"""
from __future__ import annotations

import asyncio
import logging
from typing import Any

from uvicorn.protocols.http.h11_impl import H11Protocol   # uvicorn's `http="h11"`

from flowedge.api.admission import Admission
from flowedge.errors import ConfigError

log = logging.getLogger(__name__)

HEADER_TIMEOUT_S = 10.0


class HeadDeadline(asyncio.Protocol):
    """One connection: uvicorn's protocol inside, the head deadline around it (see the module docstring)."""

    watch: HeadWatch
    inner_class: type[asyncio.Protocol] = H11Protocol

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self.inner = self.inner_class(*args, **kwargs)   # uvicorn's arguments, passed on as given
        self.transport: asyncio.Transport | None = None
        self.peer: tuple[Any, ...] | None = None
        self._timer: asyncio.TimerHandle | None = None
        self._in_request = False
        self._closed = False

    # asyncio's calls, passed on
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport   # type: ignore[assignment]
        peer = transport.get_extra_info("peername")
        self.peer = tuple(peer[:2]) if isinstance(peer, tuple) else None
        self.watch.opened(self)
        self.inner.connection_made(transport)
        self._await_head()

    def data_received(self, data: bytes) -> None:
        if self._closed:
            return
        if not self._in_request and self._timer is None:
            self._await_head()
        self.inner.data_received(data)

    def eof_received(self) -> bool | None:
        return None if self._closed else self.inner.eof_received()

    def pause_writing(self) -> None:
        self.inner.pause_writing()

    def resume_writing(self) -> None:
        self.inner.resume_writing()

    def connection_lost(self, exc: Exception | None) -> None:
        self._forget()
        if not self._closed:
            self._closed = True
            self.inner.connection_lost(exc)

    # what the middleware reports
    def head_done(self) -> None:
        self._in_request = True
        self._stop_timer()

    def answer_done(self) -> None:
        self._in_request = False   # the next byte starts the next head's deadline

    def close(self) -> None:
        """Close now, and tell uvicorn's protocol now (it stops counting the connection at once)."""
        if self._closed:
            return
        self._forget()
        self._closed = True
        self.inner.connection_lost(None)
        if self.transport is not None:
            self.transport.close()

    def _await_head(self) -> None:
        self._timer = asyncio.get_running_loop().call_later(self.watch.timeout_s, self._overdue)
        self.watch.waiting(self)

    def _stop_timer(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
            self.watch.not_waiting(self)

    def _forget(self) -> None:
        self._stop_timer()
        self.watch.closed(self)

    def _overdue(self) -> None:
        self._timer = None
        if not self._in_request and not self._closed:
            client = "%s:%s" % self.peer if self.peer else "a client"
            log.warning("closing the connection from %s: no complete request head within %g s",
                        client, self.watch.timeout_s)
            self.close()


class HeadWatch:
    """A server's connections by client address and port, shared by its protocol class and middleware."""

    def __init__(self, timeout_s: float = HEADER_TIMEOUT_S, admission: Admission | None = None) -> None:
        if not timeout_s > 0:
            raise ConfigError(f"the header timeout must be > 0 s, got {timeout_s}")
        self.timeout_s, self.admission = float(timeout_s), admission
        self.connections: dict[tuple[Any, ...], HeadDeadline] = {}

    def protocol_class(self) -> type[HeadDeadline]:
        """The class for uvicorn's `http=`: each connection it makes reports to this watch."""
        return type("HeadDeadline", (HeadDeadline,), {"watch": self})

    def middleware(self, app: Any) -> HeadMiddleware:
        return HeadMiddleware(app, self)

    def opened(self, conn: HeadDeadline) -> None:
        if conn.peer is not None:
            self.connections[conn.peer] = conn

    def closed(self, conn: HeadDeadline) -> None:
        if conn.peer is not None and self.connections.get(conn.peer) is conn:
            del self.connections[conn.peer]

    def waiting(self, conn: HeadDeadline) -> None:
        """Count this wait for a head; close the waiting connections the admission gives up."""
        if self.admission is None:
            return
        for other in self.admission.waits(conn, conn.peer[0] if conn.peer else "?"):
            assert isinstance(other, HeadDeadline)   # the admission holds what it was given
            if self.admission.evicted % 100 == 1:   # once, then every 100th: a flood must not flood the log
                log.warning("closed %d connections that had sent no complete request head (the oldest of too many "
                            "from one address or in all); the latest from %s", self.admission.evicted,
                            other.peer[0] if other.peer else "?")
            other.close()

    def not_waiting(self, conn: HeadDeadline) -> None:
        if self.admission is not None:
            self.admission.done(conn)


class HeadMiddleware:
    """ASGI middleware (the outermost): tells the request's connection that its head is complete, and
    when its answer has been sent."""

    def __init__(self, app: Any, watch: HeadWatch) -> None:
        self.app, self.watch = app, watch

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        client = scope.get("client") if scope["type"] == "http" else None
        conn = self.watch.connections.get(tuple(client)) if client else None
        if conn is None:
            return await self.app(scope, receive, send)
        conn.head_done()

        async def sending(message: Any) -> None:
            await send(message)
            if message["type"] == "http.response.body" and not message.get("more_body", False):
                conn.answer_done()

        try:
            await self.app(scope, receive, sending)
        finally:
            conn.answer_done()
