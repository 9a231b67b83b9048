"""The link contract (transport/link.py), run on both links: ZeroMQ (real loopback sockets) and memory.
Each node of a test gets its own link, as each process would."""
from __future__ import annotations

import time

import pytest
import torch

from cluster_helpers import free_port_pair
from flowedge.errors import AddressInUse, PeerUnreachable
from flowedge.transport import protocol as p
from flowedge.transport.link import Event, Inbound, Kind, PeerEvent, port_of
from flowedge.transport.memory_link import MemoryNetwork
from flowedge.transport.zmq_link import ZmqLink


@pytest.fixture(params=["zmq", "memory"])
def links(request):
    """A factory of links on one network; every link made is closed afterwards."""
    made = []
    net = MemoryNetwork()

    def make():
        made.append(ZmqLink(insecure=True) if request.param == "zmq" else net.link())
        return made[-1]

    yield make
    for link in made:
        link.close()


def _until(endpoint, want, timeout_s: float = 5.0):
    """Receive until an item `want` accepts; fails after `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    seen = []
    while time.monotonic() < deadline:
        got = endpoint.receive(0.05)
        if got is not None:
            seen.append(got)
            if want(got):
                return got
    raise AssertionError(f"nothing wanted arrived; saw {seen}")


def _hello(name: str) -> p.Hello:
    return p.Hello(node_id=name, role="client", device="client", free_memory_bytes=0, capabilities={})


def test_a_dealer_and_a_router_talk_and_the_router_names_each_sender(links):
    server = links().listen(Kind.ROUTER, "127.0.0.1")
    a, b = links().connect(Kind.DEALER, server.address), links().connect(Kind.DEALER, server.address)
    a.send(_hello("a"))
    b.send(_hello("b"))
    got = [_until(server, lambda x: isinstance(x, Inbound)) for _ in range(2)]
    names = {p.decode(g.frames).node_id: g.peer for g in got}
    assert set(names) == {"a", "b"} and names["a"] != names["b"]
    server.send(p.Welcome(node_id="head", heartbeat_interval_ms=100), names["b"])
    reply = b.next_message(5.0)
    assert isinstance(p.decode(reply.frames), p.Welcome) and a.next_message(0.2) is None


def test_a_closed_dealer_is_a_disconnected_event_naming_it_and_sends_to_it_fail_or_vanish(links):
    server = links().listen(Kind.ROUTER, "127.0.0.1")
    dealer_link = links()
    dealer = dealer_link.connect(Kind.DEALER, server.address)
    dealer.send(_hello("x"))
    peer = _until(server, lambda x: isinstance(x, Inbound)).peer
    dealer_link.close()
    gone = _until(server, lambda x: isinstance(x, PeerEvent) and x.kind is Event.DISCONNECTED)
    assert gone.peer == peer
    with pytest.raises(PeerUnreachable):
        server.send(p.StatusRequest(), peer)


def test_a_closed_router_is_a_disconnected_event_at_its_dealer(links):
    server_link = links()
    server = server_link.listen(Kind.ROUTER, "127.0.0.1")
    dealer = links().connect(Kind.DEALER, server.address)
    dealer.send(_hello("x"))
    _until(server, lambda x: isinstance(x, Inbound))
    server_link.close()
    assert _until(dealer, lambda x: isinstance(x, PeerEvent)).kind is Event.DISCONNECTED


def test_outbound_carries_a_segment_s_tensors_to_inbound_and_they_decode_equal(links):
    inbound = links().listen(Kind.INBOUND, "127.0.0.1")
    out = links().connect(Kind.OUTBOUND, inbound.address)
    hidden = torch.randn(3, 8)
    seg = p.Segment(run_id=4, round_id=0, seq=1, prune_version=0, kind="prefill", sent_at_step=0,
                    node_ids=torch.empty(0, dtype=torch.long), parent_ids=torch.empty(0, dtype=torch.long),
                    positions=torch.arange(3), hidden=hidden, hidden_wire="float32")
    out.send(seg)
    back = p.decode(inbound.next_message(5.0).frames)
    assert isinstance(back, p.Segment) and torch.equal(back.hidden, hidden) and back.run_id == 4


def test_a_taken_port_moves_to_the_next_of_the_range_then_is_address_in_use(links):
    lo = free_port_pair()
    first = links().listen(Kind.INBOUND, "127.0.0.1", (lo, lo + 1))
    second = links().listen(Kind.INBOUND, "127.0.0.1", (lo, lo + 1))
    assert (port_of(first.address), port_of(second.address)) == (lo, lo + 1)
    with pytest.raises(AddressInUse, match=f"any port of {lo}-{lo + 1}"):
        links().listen(Kind.INBOUND, "127.0.0.1", (lo, lo + 1))


def test_wait_names_the_readable_endpoints_and_honours_its_deadline(links):
    link = links()
    quiet, busy = link.listen(Kind.INBOUND, "127.0.0.1"), link.listen(Kind.INBOUND, "127.0.0.1")
    t0 = time.monotonic()
    assert link.wait([quiet, busy], 0.2) == []
    assert 0.15 <= time.monotonic() - t0 < 2.0
    links().connect(Kind.OUTBOUND, busy.address).send(p.StatusRequest())
    assert link.wait([quiet, busy], 5.0) == [busy]


def test_a_dealer_that_sends_before_its_server_listens_is_heard_once_it_does(links):
    port = free_port_pair()
    dealer = links().connect(Kind.DEALER, f"tcp://127.0.0.1:{port}")
    dealer.send(_hello("early"))
    server = links().listen(Kind.ROUTER, "127.0.0.1", (port, port))
    got = _until(server, lambda x: isinstance(x, Inbound))
    assert p.decode(got.frames).node_id == "early"
