"""Socket helpers over real 127.0.0.1 sockets: messages, garbage, the HELLO handshake, wire overhead."""
from __future__ import annotations

import logging
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import msgpack
import pytest
import torch
import zmq

from flowedge.errors import ProtocolError
from flowedge.transport import security
from flowedge.transport.channel import (
    answer_hello,
    hello_exchange,
    recv_msg,
    recv_routed,
    send_msg,
    send_routed,
    wire_bytes,
)
from flowedge.transport.protocol import PROTOCOL_VERSION, Hello, Prune, Refuse, Reset, Segment, Welcome, decode

torch.set_num_threads(1)
V2_MESSAGE = "peer speaks flowedge protocol 2.0, this node speaks {}.{}".format(*PROTOCOL_VERSION)
HELLO = Hello(node_id="pi-1", role="stage", device="cpu", free_memory_bytes=1 << 30)
WELCOME = Welcome(node_id="head", heartbeat_interval_ms=500)


@pytest.fixture
def ctx() -> Iterator[zmq.Context]:
    context = zmq.Context()
    yield context
    context.destroy(linger=0)


@pytest.fixture
def pair(ctx: zmq.Context) -> tuple[zmq.Socket, zmq.Socket]:
    """(head ROUTER, stage DEALER) connected over tcp://127.0.0.1 without Curve."""
    router, dealer = ctx.socket(zmq.ROUTER), ctx.socket(zmq.DEALER)
    port = router.bind_to_random_port("tcp://127.0.0.1")
    dealer.connect(f"tcp://127.0.0.1:{port}")
    return router, dealer


def _segment(n: int, hidden_size: int) -> Segment:
    return Segment(
        run_id=1, round_id=1, seq=0, prune_version=0, kind="draft", sent_at_step=0,
        node_ids=torch.arange(n), parent_ids=torch.arange(n).clamp(max=n - 2).clamp(min=0),
        positions=torch.arange(500, 500 + n), hidden=torch.randn(n, hidden_size),
    )


def test_send_and_receive_both_ways(pair) -> None:
    router, dealer = pair
    prune = Prune(run_id=1, round_id=2, version=3, horizon=9, commit_ids=torch.tensor([1]),
                  keep_ids=torch.tensor([4, 5]))
    send_msg(dealer, prune)
    identity, frames = recv_routed(router, 5000)
    assert decode(frames) == prune
    send_routed(router, identity, Reset(run_id=1))
    assert recv_msg(dealer, 5000) == Reset(run_id=1)


def test_timeout_returns_none(pair) -> None:
    _, dealer = pair
    start = time.monotonic()
    assert recv_msg(dealer, 50) is None
    assert time.monotonic() - start < 2.0


def test_garbage_raises_and_the_socket_keeps_working(pair) -> None:
    router, dealer = pair
    dealer.send_multipart([b"\x93not a header", b"x"])
    send_msg(dealer, Reset(run_id=2))
    _, frames = recv_routed(router, 5000)
    with pytest.raises(ProtocolError):
        decode(frames)
    _, frames = recv_routed(router, 5000)
    assert decode(frames) == Reset(run_id=2)


def test_segment_survives_the_wire_in_bf16(pair) -> None:
    router, dealer = pair
    seg = Segment(
        run_id=1, round_id=1, seq=0, prune_version=0, kind="expansion", sent_at_step=0,
        node_ids=torch.arange(3), parent_ids=torch.zeros(3, dtype=torch.long),
        positions=torch.arange(3), hidden=torch.randn(3, 64), hidden_wire="bfloat16",
    )
    send_msg(dealer, seg)
    out = decode(recv_routed(router, 5000)[1])
    assert out.hidden.dtype == torch.bfloat16 and torch.equal(out.hidden, seg.hidden.bfloat16())


def _serve_one_hello(router: zmq.Socket, results: list, admit=None) -> threading.Thread:
    def run() -> None:
        got = recv_routed(router, 5000)
        results.append(None if got is None else answer_hello(router, got[0], got[1], WELCOME, admit))

    thread = threading.Thread(target=run)
    thread.start()
    return thread


def test_hello_exchange_over_curve(ctx: zmq.Context, tmp_path: Path) -> None:
    security.init_keys(tmp_path)
    sec = security.Security.start(ctx, tmp_path, insecure=False)
    try:
        router, dealer = ctx.socket(zmq.ROUTER), ctx.socket(zmq.DEALER)
        sec.server(router)
        sec.client(dealer)
        dealer.connect(f"tcp://127.0.0.1:{router.bind_to_random_port('tcp://127.0.0.1')}")
        results: list = []
        thread = _serve_one_hello(router, results)
        assert hello_exchange(dealer, HELLO, 5000) == WELCOME
        thread.join()
        assert results == [HELLO]
    finally:
        sec.stop()


def test_admission_policy_refusal_reaches_the_peer(pair) -> None:
    router, dealer = pair
    results: list = []
    thread = _serve_one_hello(router, results, admit=lambda h: "a head is already connected")
    with pytest.raises(ProtocolError, match="refused by peer: a head is already connected"):
        hello_exchange(dealer, HELLO, 5000)
    thread.join()
    assert results == [None]


def test_server_refuses_another_major_version_on_both_sides(pair, caplog) -> None:
    router, dealer = pair
    header = msgpack.packb({"v": [2, 0], "type": "hello", "node_id": "new", "tensors": {}})
    dealer.send_multipart([header])
    identity, frames = recv_routed(router, 5000)
    with caplog.at_level(logging.WARNING):
        assert answer_hello(router, identity, frames, WELCOME) is None
    assert V2_MESSAGE in caplog.text
    reply = recv_msg(dealer, 5000)  # a REFUSE is readable whatever the version
    assert reply == Refuse(reason=V2_MESSAGE)


def test_client_refuses_a_server_of_another_major_version(pair) -> None:
    router, dealer = pair

    def fake_v2_head() -> None:
        identity, _ = recv_routed(router, 5000)
        header = {"v": [2, 0], "type": "welcome", "node_id": "head", "heartbeat_interval_ms": 5, "tensors": {}}
        router.send_multipart([identity, msgpack.packb(header)])

    thread = threading.Thread(target=fake_v2_head)
    thread.start()
    with pytest.raises(ProtocolError) as err:
        hello_exchange(dealer, HELLO, 5000)
    thread.join()
    assert str(err.value) == V2_MESSAGE


def test_first_message_must_be_a_hello(pair) -> None:
    router, dealer = pair
    send_msg(dealer, Reset(run_id=1))
    identity, frames = recv_routed(router, 5000)
    assert answer_hello(router, identity, frames, WELCOME) is None
    assert recv_msg(dealer, 5000) == Refuse(reason="expected HELLO first, got reset")


def test_silent_peer_is_a_clear_error(ctx: zmq.Context) -> None:
    router, dealer = ctx.socket(zmq.ROUTER), ctx.socket(zmq.DEALER)
    dealer.connect(f"tcp://127.0.0.1:{router.bind_to_random_port('tcp://127.0.0.1')}")
    with pytest.raises(ProtocolError, match="no answer to HELLO within 100 ms"):
        hello_exchange(dealer, HELLO, 100)


def test_framing_overhead_of_a_hidden_segment_is_below_two_percent() -> None:
    seg = _segment(16, 1536)
    frames = seg.to_frames()
    payload = 16 * 1536 * 2 + 3 * 16 * 2  # fp16 states + three int16 index sets
    assert sum(len(memoryview(f)) for f in frames[1:]) == payload
    for curve in (False, True):
        overhead = wire_bytes(frames, curve=curve) / payload - 1
        assert 0 < overhead < 0.02, (curve, overhead)


class _CountingProxy:
    """A TCP relay on 127.0.0.1 that counts the bytes going from client to server."""

    def __init__(self, target_port: int) -> None:
        self.up_bytes = 0
        self._target = target_port
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.port = self._listener.getsockname()[1]
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        client, _ = self._listener.accept()
        server = socket.create_connection(("127.0.0.1", self._target))
        threading.Thread(target=self._pump, args=(client, server, True), daemon=True).start()
        threading.Thread(target=self._pump, args=(server, client, False), daemon=True).start()

    def _pump(self, src: socket.socket, dst: socket.socket, up: bool) -> None:
        while data := src.recv(1 << 16):
            if up:
                self.up_bytes += len(data)
            dst.sendall(data)


@pytest.mark.parametrize("curve", [False, True])
def test_wire_bytes_matches_what_crosses_the_socket(ctx: zmq.Context, tmp_path: Path, curve: bool) -> None:
    sec = security.Security(keys=None, auth=None)
    if curve:
        security.init_keys(tmp_path)
        sec = security.Security.start(ctx, tmp_path, insecure=False)
    try:
        router, dealer = ctx.socket(zmq.ROUTER), ctx.socket(zmq.DEALER)
        router.linger = dealer.linger = 0
        sec.server(router)
        sec.client(dealer)
        proxy = _CountingProxy(router.bind_to_random_port("tcp://127.0.0.1"))
        dealer.connect(f"tcp://127.0.0.1:{proxy.port}")
        send_msg(dealer, Reset(run_id=0))  # handshake + a first message
        assert recv_routed(router, 5000) is not None
        before = proxy.up_bytes
        frames = _segment(16, 1536).to_frames()
        send_msg(dealer, _segment(16, 1536))
        assert recv_routed(router, 5000) is not None
        assert proxy.up_bytes - before == wire_bytes(frames, curve=curve)
    finally:
        sec.stop()
