"""The HTTP front under uvicorn on a real port, in a thread, for tests that need real sockets."""
from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager


@contextmanager
def serving(server) -> Iterator[int]:
    """Run `server` (api.server.build_server's) in a thread until the block ends; yields its port."""
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 10
    while not server.started and time.monotonic() < deadline:
        time.sleep(0.05)
    assert server.started
    try:
        yield server.servers[0].sockets[0].getsockname()[1]
    finally:
        server.should_exit = True
        thread.join(timeout=10)


def closed_after_s(sock, trickle: bytes, t0: float, limit_s: float = 10.0) -> float:
    """Send `trickle` every 0.2 s until the server closes the connection; seconds from `t0` to then
    (fails past `limit_s`)."""
    sock.settimeout(0.2)
    while time.monotonic() - t0 < limit_s:
        try:
            if sock.recv(4096) == b"":
                return time.monotonic() - t0
        except TimeoutError:
            pass
        except ConnectionResetError:
            return time.monotonic() - t0
        try:
            sock.sendall(trickle)
        except (BrokenPipeError, ConnectionResetError):
            return time.monotonic() - t0
    raise AssertionError(f"the server kept a trickling connection open for {limit_s:g} s")
