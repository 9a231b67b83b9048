"""transport/connections.py: a closed connection ends the peers of that connection only, however late
its socket-monitor event is read. Unit tests on the tracker, then a real head (real sockets, the
ZeroMQ link's ROUTER) whose descriptors the kernel reuses under churn: once driven by hand (the new
connection's HELLO waiting on the socket while the old connection's DISCONNECTED waits in the
monitor), once with the head's own loop and several clients reconnecting at once."""
from __future__ import annotations

import threading
import time

import pytest
import zmq

from cluster_helpers import flowedge_home, free_port_pair
from flowedge.node.node_config import NodeConfig
from flowedge.node.roots import build_head
from flowedge.transport import protocol as p
from flowedge.transport.channel import recv_msg, send_msg
from flowedge.transport.connections import GONE_REMEMBERED, ConnectionTracker


# ---- the tracker ---------------------------------------------------------------------------------
def test_a_late_disconnect_ends_the_old_connection_s_peer_not_the_new_one_s():
    t = ConnectionTracker()
    t.accepted(7)
    assert t.bind(7, b"old")
    assert t.closed(7) == [b"old"]
    t.accepted(7)                    # the kernel reused descriptor 7
    assert t.bind(7, b"new")
    assert t.closed(7) == [b"new"]
    assert t.closed(7) == []         # a duplicate event names nobody


def test_a_message_that_outlived_its_connection_is_refused_and_its_identity_stays_gone():
    t = ConnectionTracker()
    t.accepted(5)
    t.closed(5)
    assert not t.bind(5, b"late")    # nobody accepted on 5 since: its connection is closed
    t.accepted(5)
    assert t.bind(5, b"a")
    t.closed(5)
    t.accepted(5)
    assert not t.bind(5, b"a")       # a closed identity never binds to the next connection
    assert t.knows(b"a") and not t.knows(b"b")


def test_a_missed_disconnect_is_made_up_by_the_next_accept_on_the_descriptor():
    t = ConnectionTracker()
    t.accepted(9)
    t.bind(9, b"x")
    assert t.accepted(9) == [b"x"]


def test_connections_accepted_before_the_monitor_started_are_tracked_and_memory_stays_bounded():
    t = ConnectionTracker()
    assert t.bind(4, b"early") and t.closed(4) == [b"early"]
    for k in range(GONE_REMEMBERED + 10):
        t.accepted(3)
        t.bind(3, k.to_bytes(4, "big"))
        t.closed(3)
    assert len(t.gone) == GONE_REMEMBERED and not t.connection_of and len(t.newest) == 2


# ---- a real head, descriptors reused ------------------------------------------------------------
@pytest.fixture
def head(tmp_path):
    with flowedge_home(tmp_path):
        port = free_port_pair()
        node = build_head(NodeConfig(role="head", node_id="conn-head", head=f"127.0.0.1:{port}", insecure=True,
                                   stages=1))
        node.test_addr = f"tcp://127.0.0.1:{port}"
        try:
            yield node
        finally:
            node.close()


def _hello(name: str) -> p.Hello:
    return p.Hello(node_id=name, role="client", device="client", free_memory_bytes=0, capabilities={})


def _wait_readable(sock: zmq.Socket, timeout_s: float = 5.0) -> None:
    assert sock.poll(int(timeout_s * 1000), zmq.POLLIN), "nothing arrived"


def test_a_reused_descriptor_s_late_disconnect_does_not_remove_the_new_peer(head):
    """Churn by hand: each round a client says HELLO and closes, the next connects (the kernel gives
    it the closed descriptor) and its HELLO waits on the socket while the old DISCONNECTED waits in
    the monitor. The new peer must stay and be answered; the old one must go."""
    ctx = zmq.Context.instance()
    fds: list[int] = []

    def connect(name: str) -> zmq.Socket:
        sock = ctx.socket(zmq.DEALER)
        sock.linger = 0
        sock.connect(head.test_addr)
        before = set(head.members.peers)
        send_msg(sock, _hello(name))
        _wait_readable(head.ctrl.sock)
        head._drain(head.ctrl, head._on_ctrl)   # the HELLO, with the monitor's events read before it
        assert isinstance(recv_msg(sock, 5000), p.Welcome)
        (joined,) = set(head.members.peers) - before
        fds.append(head.ctrl.connections.connection_of[joined].fd)
        return sock

    old = connect("c0")
    reused = 0
    for k in range(1, 21):
        before = set(head.members.peers)
        old.close(0)
        _wait_readable(head.ctrl.monitor)           # its DISCONNECTED is waiting, unread
        time.sleep(0.05)                            # the head's side of the socket is closed by now
        new = connect(f"c{k}")
        reused += fds[-1] == fds[-2]
        head._drain(head.ctrl, head._on_ctrl)
        assert len(set(head.members.peers) - before) == 1, f"round {k}: the new peer was removed"
        assert not before & set(head.members.peers), f"round {k}: the old peer was not removed"
        send_msg(new, p.StatusRequest())
        _wait_readable(head.ctrl.sock)
        head._drain(head.ctrl, head._on_ctrl)
        assert isinstance(recv_msg(new, 5000), p.StatusReply), f"round {k}: the new peer was refused"
        old = new
    old.close(0)
    assert reused >= 10, f"the kernel reused a descriptor in only {reused} of 20 rounds"


def test_clients_reconnecting_at_once_are_never_refused_by_a_running_head(head):
    """The head's own loop; 4 threads each open a connection, say HELLO, ask for status, close, 40 times."""
    errors: list[str] = []
    runner = threading.Thread(target=head._loop, daemon=True)
    runner.start()

    def churn(t: int) -> None:
        ctx = zmq.Context()
        for k in range(40):
            sock = ctx.socket(zmq.DEALER)
            sock.linger = 0
            sock.connect(head.test_addr)
            send_msg(sock, _hello(f"t{t}-{k}"))
            send_msg(sock, p.StatusRequest())
            replies = [recv_msg(sock, 10_000), recv_msg(sock, 10_000)]
            if not (isinstance(replies[0], p.Welcome) and isinstance(replies[1], p.StatusReply)):
                errors.append(f"thread {t} round {k}: {replies}")
            sock.close(0)
        ctx.term()

    threads = [threading.Thread(target=churn, args=(t,)) for t in range(4)]
    for th in threads:
        th.start()
    for th in threads:
        th.join(120)
    deadline = time.monotonic() + 10
    while head.members.peers and time.monotonic() < deadline:   # every closed connection ends its peer
        time.sleep(0.05)
    head.stop.set()
    runner.join(10)
    assert not errors, errors[:3]
    assert not head.members.peers
