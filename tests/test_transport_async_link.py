"""transport/async_link.py: an awaited DEALER talks to a (polled) ROUTER, on ZeroMQ and in memory; a
closed dealer's receive ends in LinkError."""
from __future__ import annotations

import asyncio

import pytest

from flowedge.errors import LinkError
from flowedge.transport import protocol as p
from flowedge.transport.async_link import MemoryAsyncLink, ZmqAsyncLink
from flowedge.transport.link import Inbound, Kind
from flowedge.transport.memory_link import MemoryNetwork
from flowedge.transport.zmq_link import ZmqLink


@pytest.fixture(params=["zmq", "memory"])
def links(request):
    """(a link for the server, an async link for the client) on one network."""
    net = MemoryNetwork()
    server = ZmqLink(insecure=True) if request.param == "zmq" else net.link()
    client = ZmqAsyncLink(insecure=True) if request.param == "zmq" else MemoryAsyncLink(net)
    yield server, client
    client.close()
    server.close()


def test_an_awaited_dealer_gets_its_answer_and_a_closed_one_ends_in_link_error(links):
    server_link, client_link = links
    router = server_link.listen(Kind.ROUTER, "127.0.0.1")

    async def exchange():
        dealer = client_link.dealer(router.address)
        await dealer.send(p.Hello(node_id="a", role="client", device="client", free_memory_bytes=0, capabilities={}))
        got = await asyncio.to_thread(router.next_message, 5.0)
        assert p.decode(got.frames).node_id == "a"
        router.send(p.Welcome(node_id="head", heartbeat_interval_ms=100), got.peer)
        reply = await asyncio.wait_for(dealer.receive(), 5.0)
        dealer.close()
        with pytest.raises(LinkError):
            await asyncio.wait_for(dealer.receive(), 5.0)
        return reply

    reply = asyncio.run(exchange())
    assert isinstance(reply, Inbound) and isinstance(p.decode(reply.frames), p.Welcome)



def test_every_socket_monitor_has_an_address_of_its_own(monkeypatch):
    """A socket's monitor listens on an inproc address. pyzmq's default names it after the socket's file
    descriptor, and a new socket that reuses the descriptor while libzmq still holds the closed one's address
    fails with "Address already in use" (seen as an HTTP front answering 500 now and then; a loop of 3000
    open-and-close dealers hit it in about half the runs). Every monitor the links open has a name of its own."""
    import zmq

    names: list[str] = []
    monitor = zmq.Socket.monitor

    def recording(sock, addr, events=zmq.EVENT_ALL):
        names.append(addr)
        return monitor(sock, addr, events)

    monkeypatch.setattr(zmq.Socket, "monitor", recording)
    sync_link, async_link = ZmqLink(insecure=True), ZmqAsyncLink(insecure=True)
    try:
        sync_link.listen(Kind.ROUTER, "127.0.0.1").close()
        for _ in range(3):
            async_link.dealer("tcp://127.0.0.1:1").close()
            sync_link.connect(Kind.DEALER, "tcp://127.0.0.1:1").close()
    finally:
        async_link.close()
        sync_link.close()
    assert len(names) == 7 and len(set(names)) == 7, names
    assert all(n.startswith("inproc://flowedge-monitor-") for n in names), names
