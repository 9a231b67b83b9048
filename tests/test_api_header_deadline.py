"""A slowloris flood against the HTTP front's connection handling (api/header_deadline.py, api/admission.py):
one address opens sockets as fast as it can and dribbles header bytes into them, and another address's
/health is still answered every time. The front runs under uvicorn on a real port, its head played by the
test (always ready), the flood from a thread, bounded in sockets and time. The finer rules (deadlines,
which connection is closed) are tested in test_api_units.py."""
from __future__ import annotations

import socket
import threading
import time

import httpx
import pytest

from api_helpers import closed_after_s, serving
from flowedge.api.server import build_server
from flowedge.api.settings import ApiSettings

FLOOD_S = 4.0
OPEN_AT_ONCE = 200   # the flood's sockets open at a time (each reopened once the server closes it)


@pytest.fixture()
def small_api():
    """Room for 16 connections, 4 per address without a complete head; /health answers ready."""
    settings = ApiSettings(head="127.0.0.1:9", insecure=True, max_connections=16, max_connections_per_address=4,
                           header_timeout_s=5.0)
    server = build_server(settings, "127.0.0.1", 0, log_level="critical")

    async def ready():
        return [{"node_id": "head", "role": "head", "ready": True}]

    server.config.app.state.routes.head_status = ready
    with serving(server) as port:
        yield port


def flood(port: int, stop: threading.Event, opened: list[int]) -> None:
    """Open sockets from 127.0.0.2 as fast as the server takes them, each with a request line and one more
    header byte at every pass; reopen the ones the server closes."""
    socks: list[socket.socket | None] = [None] * OPEN_AT_ONCE
    while not stop.is_set():
        for i, s in enumerate(socks):
            try:
                if s is None:
                    s = socks[i] = socket.socket()
                    s.settimeout(1.0)
                    s.bind(("127.0.0.2", 0))
                    s.connect(("127.0.0.1", port))
                    s.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n")
                    opened[0] += 1
                s.sendall(b"X")
            except OSError:
                if s is not None:
                    s.close()
                socks[i] = None
    for s in socks:
        if s is not None:
            s.close()


def test_health_is_answered_every_time_under_a_flood_of_slow_connections(small_api):
    """Connections the admission closed were still counted against uvicorn's `limit_concurrency` until
    asyncio got round to `connection_lost`; a flood of new connections kept enough of them in that state
    to fill the cap, and another address's /health got 503 (45 answers of 46 on the default caps)."""
    stop, opened = threading.Event(), [0]
    attacker = threading.Thread(target=flood, args=(small_api, stop, opened), daemon=True)
    attacker.start()
    answers: list[int | str] = []
    try:
        time.sleep(0.5)
        url = f"http://127.0.0.1:{small_api}/health"
        with httpx.Client(timeout=5) as kept:   # a client keeping its connection, then one connecting anew each time
            deadline = time.monotonic() + FLOOD_S
            while time.monotonic() < deadline:
                for ask in (kept.get, lambda u: httpx.get(u, timeout=5)):
                    try:
                        answers.append(ask(url).status_code)
                    except httpx.HTTPError as err:
                        answers.append(type(err).__name__)
    finally:
        stop.set()
        attacker.join(10)
    assert opened[0] > 5 * OPEN_AT_ONCE   # the flood was one: its sockets were closed and reopened many times
    assert len(answers) >= 20 and answers.count(200) == len(answers), answers


@pytest.fixture()
def quick_api():
    """Head deadline 1 s, keep-alive 5 s (server.py): a cut within ~1 s is the deadline's."""
    settings = ApiSettings(head="127.0.0.1:9", insecure=True, header_timeout_s=1.0, status_timeout_s=0.3)
    server = build_server(settings, "127.0.0.1", 0, log_level="critical")
    with serving(server) as port:
        yield port


def test_the_deadline_is_a_wrapper_on_uvicorn_s_public_seams_not_a_subclass(quick_api):
    """uvicorn's own h11 protocol runs inside, unchanged: the class given as `http=` is not derived from it."""
    from uvicorn.protocols.http.h11_impl import H11Protocol

    from flowedge.api.header_deadline import HeadDeadline

    server = build_server(ApiSettings(head="127.0.0.1:9", insecure=True), "127.0.0.1", 0)
    cls = server.config.http
    assert issubclass(cls, HeadDeadline) and not issubclass(cls, H11Protocol) and cls.inner_class is H11Protocol


def test_the_next_head_on_a_kept_alive_connection_has_the_deadline_too(quick_api):
    """After one whole request and its answer, a second head trickled on the same connection is cut at
    the head deadline (1 s), not let live by the keep-alive timer its bytes keep cancelling."""
    with socket.create_connection(("127.0.0.1", quick_api)) as s:
        s.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
        s.settimeout(5)
        assert s.recv(4096).startswith(b"HTTP/1.1 503")   # answered (no head behind it), kept alive
        time.sleep(1.5)                                   # idle longer than the head deadline: not cut
        s.sendall(b"GET /health HTTP/1.1\r\n")
        took = closed_after_s(s, b"X-Slow: 1\r\n", time.monotonic(), 4.0)
    assert 0.8 < took < 2.5, took


def test_a_request_whose_answer_outlasts_the_deadline_is_answered(quick_api):
    """The deadline stops once the head is complete: a body sent after 1.5 s (deadline 1 s) is still read."""
    with socket.create_connection(("127.0.0.1", quick_api)) as s:
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                  b"Content-Length: 15\r\n\r\n")
        time.sleep(1.5)
        s.sendall(b'{"prompt": "a"}')
        s.settimeout(5)
        assert s.recv(4096).startswith(b"HTTP/1.1 503")


def test_a_burst_of_new_connections_from_one_address_is_answered_not_cut():
    """64 connections opened at once from one address, 4 allowed to wait for their heads: the admission
    once closed the oldest waiting one for each newcomer, so a burst of a legitimate client's requests saw
    its connections cut (ReadError). Now the newcomers wait their turn and every request is answered."""
    import asyncio

    settings = ApiSettings(head="127.0.0.1:9", insecure=True, max_connections=128, max_connections_per_address=4,
                           header_timeout_s=5.0)
    server = build_server(settings, "127.0.0.1", 0, log_level="critical")

    async def ready():
        return [{"node_id": "head", "role": "head", "ready": True}]

    server.config.app.state.routes.head_status = ready

    async def burst(port: int) -> list:
        limits = httpx.Limits(max_connections=64, max_keepalive_connections=0)
        async with httpx.AsyncClient(timeout=10, limits=limits) as web:
            got = await asyncio.gather(*(web.get(f"http://127.0.0.1:{port}/health") for _ in range(64)),
                                       return_exceptions=True)
        return [r.status_code if isinstance(r, httpx.Response) else type(r).__name__ for r in got]

    with serving(server) as port:
        for _ in range(3):
            answers = asyncio.run(burst(port))
            assert answers == [200] * 64, answers
