"""systemd's notify protocol (sd_notify(3)): tell the service manager when a node can serve, that its
poll loop is alive, and what it is doing.

The protocol is one datagram of newline-separated `KEY=VALUE` lines to the AF_UNIX socket named in
$NOTIFY_SOCKET (a path, or an abstract socket when it starts with '@'). With `Type=notify` systemd
calls the unit active only after READY=1; with `WatchdogSec=` it sets $WATCHDOG_USEC and restarts a
node whose WATCHDOG=1 pings stop (a hung poll loop). Outside systemd the variable is unset and every
call is a no-op. Written here rather than taken from the `sdnotify` package: the protocol is a dozen
lines, and the package neither parses WATCHDOG_USEC/WATCHDOG_PID nor rate-limits the pings.
"""
from __future__ import annotations

import logging
import os
import socket
import time
from collections.abc import Callable, Mapping

log = logging.getLogger(__name__)


def _address(value: str) -> str | bytes | None:
    """The socket address in $NOTIFY_SOCKET: a path, or an abstract name ('@' -> leading NUL)."""
    if value.startswith("@"):
        return b"\0" + value[1:].encode()
    if value.startswith("/"):
        return value
    return None   # vsock or garbage: not for us


def watchdog_interval_s(env: Mapping[str, str]) -> float | None:
    """How often to ping: half of $WATCHDOG_USEC (as sd_watchdog_enabled advises), None when the
    watchdog is off or meant for another process ($WATCHDOG_PID)."""
    try:
        usec = int(env.get("WATCHDOG_USEC", ""))
    except ValueError:
        return None
    pid = env.get("WATCHDOG_PID")
    if usec <= 0 or (pid is not None and pid.strip() != str(os.getpid())):
        return None
    return usec / 2e6


class Notifier:
    """sd_notify for one node. `ready()` once it can serve, `watchdog()` from every poll-loop turn
    (sent at most every half watchdog period), `status(text)` when the summary changes (repeats are
    not resent), `stopping()` on shutdown. Never raises: a missing manager must not stop a node."""

    def __init__(self, env: Mapping[str, str] | None = None, clock: Callable[[], float] = time.monotonic) -> None:
        env = os.environ if env is None else env
        self.address = _address(env.get("NOTIFY_SOCKET", ""))
        self.watchdog_s = watchdog_interval_s(env) if self.address is not None else None
        self.clock = clock
        self._sock: socket.socket | None = None
        self._last_ping_s: float | None = None
        self._last_status = ""
        self._last_status_s: float | None = None
        self.is_ready = False

    @property
    def enabled(self) -> bool:
        return self.address is not None

    def send(self, *lines: str) -> bool:
        """One datagram of `KEY=VALUE` lines; False when not under systemd or the send failed.

        Never blocks: a manager that stops reading (its queue holds `net.unix.max_dgram_qlen` datagrams,
        10 by default) would otherwise freeze the node's loop in `sendto` — a head that answers no HELLO.
        A datagram that does not fit is dropped; the next watchdog ping or status follows soon anyway."""
        if self.address is None:
            return False
        try:
            if self._sock is None:
                self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC)
            self._sock.sendto("\n".join(lines).encode(), socket.MSG_DONTWAIT, self.address)
            return True
        except OSError as err:
            log.debug("sd_notify to %r failed: %s", self.address, err)
            return False

    def ready(self, status: str = "") -> None:
        """The node can serve (sent once; a re-join after a head restart does not resend it)."""
        if self.is_ready:
            if status:
                self.status(status)
            return
        self.is_ready = True
        self._last_status = status or self._last_status
        self.send("READY=1", *([f"STATUS={status}"] if status else []), f"MAINPID={os.getpid()}")

    def status(self, text: str) -> None:
        text = " ".join(text.split())   # one line
        if text != self._last_status:
            self._last_status = text
            self.send(f"STATUS={text}")

    def watchdog(self) -> None:
        """Ping the watchdog if half its period has passed since the last ping."""
        if self.watchdog_s is None:
            return
        now = self.clock()
        if self._last_ping_s is None or now - self._last_ping_s >= self.watchdog_s:
            self._last_ping_s = now
            self.send("WATCHDOG=1")

    def tick(self, status: Callable[[], str], every_s: float = 1.0) -> None:
        """One poll-loop turn: ping the watchdog, and refresh STATUS from `status()` at most every
        `every_s` (cheap to call every turn; `status` is not even called outside systemd)."""
        if self.address is None:
            return
        self.watchdog()
        now = self.clock()
        if self._last_status_s is None or now - self._last_status_s >= every_s:
            self._last_status_s = now
            self.status(status())

    def stopping(self, status: str = "stopping") -> None:
        self.send("STOPPING=1", f"STATUS={status}")

    def close(self) -> None:
        if self._sock is not None:
            self._sock.close()
            self._sock = None
