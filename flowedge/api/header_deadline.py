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
counted for its client address; the connections it names (ones that waited past its grace, of a full
address or of all) are closed, and a newcomer it queues (part of a burst) is held back: not read, and not
yet handed to uvicorn's protocol, so uvicorn does not count it until the admission lets it in. A
connection closed here is reported lost to uvicorn's protocol
at once (asyncio's own `connection_lost` comes a loop turn later and is then not passed on), so it
leaves what `limit_concurrency` counts now: closed-but-not-yet-lost connections of a flood once filled
that cap and a legitimate request got 503.
"""
from __future__ import annotations

import asyncio
import logging
from typing import Any

from uvicorn.protocols.http.h11_impl import H11Protocol   # uvicorn's `http="h11"`

from flowedge.api.admission import Admission, Verdict
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
        self._retry: asyncio.TimerHandle | None = None   # a held-back connection asks the admission again
        self._in_request = False
        self._closed = False
        self._made = False   # uvicorn's protocol has the connection (a queued newcomer's waits for its turn)
        self._held = False
        self._early: list[bytes] = []   # bytes that arrived before uvicorn's protocol had the connection

    # asyncio's calls, passed on
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport   # type: ignore[assignment]
        peer = transport.get_extra_info("peername")
        self.peer = tuple(peer[:2]) if isinstance(peer, tuple) else None
        self.watch.opened(self)
        self._await_head()   # the admission may hold this connection back, or refuse it
        if not self._held and not self._closed:
            self._hand_over()

    def data_received(self, data: bytes) -> None:
        if self._closed:
            return
        if not self._made:
            self._early.append(data)
            return
        if not self._in_request and self._timer is None:
            self._await_head()
        self.inner.data_received(data)

    def eof_received(self) -> bool | None:
        return None if self._closed or not self._made else self.inner.eof_received()

    def pause_writing(self) -> None:
        if self._made:
            self.inner.pause_writing()

    def resume_writing(self) -> None:
        if self._made:
            self.inner.resume_writing()

    def connection_lost(self, exc: Exception | None) -> None:
        self._forget()
        if not self._closed:
            self._closed = True
            if self._made:
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
        if self._made:
            self.inner.connection_lost(None)
        if self.transport is not None:
            self.transport.close()

    # what the admission decides
    def hold(self, retry_s: float) -> None:
        """Queued: stop reading until let in, asking the admission again every `retry_s`."""
        if self._closed or self.transport is None:
            return
        self._held = True
        self.transport.pause_reading()
        if self._retry is None:
            self._retry = asyncio.get_running_loop().call_later(retry_s, self._ask_again)

    def let_in(self) -> None:
        """This connection's turn: hand it to uvicorn's protocol (if not yet) and read it again."""
        self._cancel_retry()
        if not self._held or self._closed or self.transport is None:
            return
        self._held = False
        if not self._made:
            self._hand_over()
        self.transport.resume_reading()

    def _hand_over(self) -> None:
        assert self.transport is not None   # only after connection_made
        self._made = True
        self.inner.connection_made(self.transport)
        early, self._early = self._early, []
        for data in early:
            self.inner.data_received(data)

    def _ask_again(self) -> None:
        self._retry = None
        if self._held and not self._closed:
            self.watch.retry(self)

    def _cancel_retry(self) -> None:
        if self._retry is not None:
            self._retry.cancel()
            self._retry = None

    def _await_head(self) -> None:
        self._timer = asyncio.get_running_loop().call_later(self.watch.timeout_s, self._overdue)
        self.watch.waiting(self)

    def _stop_timer(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
            self.watch.not_waiting(self)

    def _forget(self) -> None:
        self._cancel_retry()
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
        """Count this wait for a head: the admission may hold it back, or close others (or it)."""
        if self.admission is not None:
            self._obey(conn, self.admission.waits(conn, conn.peer[0] if conn.peer else "?"))

    def retry(self, conn: HeadDeadline) -> None:
        if self.admission is not None:
            self._obey(conn, self.admission.retry(conn))

    def not_waiting(self, conn: HeadDeadline) -> None:
        """Its head arrived (or it closed): the queued connections the admission names come in."""
        if self.admission is not None:
            for other in self.admission.done(conn):
                assert isinstance(other, HeadDeadline)   # the admission holds what it was given
                other.let_in()

    def _obey(self, conn: HeadDeadline, verdict: Verdict) -> None:
        """This connection first (held back, or let in), then the others closed: closing one can let this
        one in, which must not be undone afterwards."""
        assert self.admission is not None
        if verdict.queued:
            conn.hold(self.admission.grace_s)
        elif conn not in verdict.close:
            conn.let_in()
        for other in verdict.close:
            assert isinstance(other, HeadDeadline)
            if (self.admission.evicted + self.admission.refused) % 100 == 1:   # a flood must not flood the log
                log.warning("closed %d connections that sent no complete request head in %g s and %d past the "
                            "queue (too many from one address or in all); the latest from %s",
                            self.admission.evicted, self.admission.grace_s, self.admission.refused,
                            other.peer[0] if other.peer else "?")
            other.close()


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
