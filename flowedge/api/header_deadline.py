"""A deadline for a request's head (request line + headers) on uvicorn's h11 protocol.

uvicorn (0.54) has no such timeout: `timeout_keep_alive` only covers the idle time between requests and
is cancelled by the first byte that arrives, so a client that opens a connection and trickles header
bytes (slowloris) holds it for ever, and enough of them exhaust the server. uvicorn's own settings bound
what they can: `h11_max_incomplete_event_size` the bytes of a head, `limit_concurrency` the connections
and tasks at once (503 beyond it) — `build_server` sets both — but neither bounds time (uvicorn issue
#157, "timeout-request-start", still open). The body has the guard's per-chunk `read_timeout_s`.

`header_deadline_protocol(timeout_s)` is uvicorn's `H11Protocol` with one addition: while the server
waits for a request's head (h11's `their_state` is IDLE and bytes have arrived, or the connection has
just opened) a timer runs, armed once and not reset by further bytes; if the head is not complete when
it fires, the connection is closed. Once the head is parsed the timer is off, so a long streamed answer
is never cut. Passed to uvicorn as its `http` protocol class (a documented `Config` option).

The same waits feed the server's `Admission` (admission.py): a connection waiting for its head is
counted for its client address; the connections it names (ones that waited past its grace, of a full
address or of all) are closed, and a newcomer it queues is left unread and uncounted by uvicorn until it
lets it in. A connection this module closes leaves uvicorn's count of connections (what
`limit_concurrency` weighs) at once, not when asyncio later reports it lost (`cut`).
"""
from __future__ import annotations

import asyncio
import logging

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

from flowedge.api.admission import Admission
from flowedge.errors import ConfigError

log = logging.getLogger(__name__)

HEADER_TIMEOUT_S = 10.0


class HeaderDeadlineH11(H11Protocol):
    header_timeout_s: float = HEADER_TIMEOUT_S
    admission: Admission | None = None   # shared by the server's connections
    _head_timer: asyncio.TimerHandle | None = None
    _retry_timer: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._watch_head()

    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        self._watch_head()

    def connection_lost(self, exc: Exception | None) -> None:
        self._stop_head_timer()
        if self._retry_timer is not None:
            self._retry_timer.cancel()
        self._release()
        super().connection_lost(exc)

    def _waiting_for_head(self) -> bool:
        return self.conn.their_state is h11.IDLE and not self.transport.is_closing()

    def _watch_head(self) -> None:
        """Arm the deadline when a head is awaited (once per head); disarm once it is complete."""
        if not self._waiting_for_head():
            self._stop_head_timer()
        elif self._head_timer is None:
            self._head_timer = self.loop.call_later(self.header_timeout_s, self._head_overdue)
            self._admit()

    def _stop_head_timer(self) -> None:
        if self._head_timer is not None:
            self._head_timer.cancel()
            self._head_timer = None
            self._release()

    def _release(self) -> None:
        """This wait is over: let in the queued connections the admission names."""
        if self.admission is not None:
            for other in self.admission.done(self):
                other.let_in()

    def _admit(self) -> None:
        """Count this wait for a head; close the waiting connections the admission gives up, or hold this
        one back (unread, uncounted by uvicorn) while its address's room is full of a burst."""
        if self.admission is None:
            return
        self._obey(self.admission.waits(self, self.client[0] if self.client else "?"))

    def _obey(self, verdict) -> None:
        """This connection first (held back, or let in), then the others closed: closing one can let this
        one in, which must not be undone here afterwards."""
        if verdict.queued and not self.transport.is_closing():
            self.transport.pause_reading()
            self.connections.discard(self)
            self._retry_timer = self.loop.call_later(self.admission.grace_s, self._retry)
        elif not verdict.queued and self not in self.connections and not self.transport.is_closing():
            self.let_in()
        for other in verdict.close:
            if (self.admission.evicted + self.admission.refused) % 100 == 1:   # a flood must not flood the log
                log.warning("closed %d connections that sent no complete request head in %g s and %d past the "
                            "queue (too many from one address or in all); the latest from %s",
                            self.admission.evicted, self.admission.grace_s, self.admission.refused,
                            other.client[0] if other.client else "?")
            other.cut()

    def _retry(self) -> None:
        self._retry_timer = None
        if self.admission is not None and not self.transport.is_closing():
            self._obey(self.admission.retry(self))

    def let_in(self) -> None:
        """A queued connection's turn: read it and count it again."""
        if self._retry_timer is not None:
            self._retry_timer.cancel()
            self._retry_timer = None
        if not self.transport.is_closing():
            self.connections.add(self)
            self.transport.resume_reading()

    def _head_overdue(self) -> None:
        self._head_timer = None
        if self._waiting_for_head():
            client = "%s:%d" % self.client if self.client else "a client"
            log.warning("closing the connection from %s: no complete request head within %g s",
                        client, self.header_timeout_s)
            self.cut()

    def cut(self) -> None:
        """Close this connection, and stop counting it against `limit_concurrency` now: asyncio calls
        `connection_lost` only on a later turn of its loop, and while a flood of new connections was being
        accepted the ones closed but not yet lost filled uvicorn's cap, so a legitimate request got 503."""
        self._stop_head_timer()
        self.connections.discard(self)
        self.transport.close()


def header_deadline_protocol(timeout_s: float, admission: Admission | None = None) -> type[HeaderDeadlineH11]:
    """uvicorn's h11 protocol class with a `timeout_s` deadline for each request head (and, given one,
    an admission shared by every connection of the server)."""
    if not timeout_s > 0:
        raise ConfigError(f"the header timeout must be > 0 s, got {timeout_s}")
    return type("HeaderDeadlineH11", (HeaderDeadlineH11,), {"header_timeout_s": float(timeout_s),
                                                             "admission": admission})
