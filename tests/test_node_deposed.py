"""A head that was only paused while its standby took over stands down (real processes: the failover
drill's head, standby with failover_s = 1 and two stages on the tiny pair, CurveZMQ on). SIGSTOP the head
past the failover, SIGCONT it: it finds the higher term at its standby's address, refuses every HELLO
naming the head that serves, and a client listing the old head first is answered by the new one instead
of waiting at a head with no stages."""
from __future__ import annotations

import signal

import pytest

from test_node_failover import MAX_NEW, hf, nodes  # noqa: F401 - `nodes` is the cluster fixture
from flowedge.client.sync_client import Client
from flowedge.errors import FlowedgeError

STAND_DOWN_LIMIT_S = 20.0   # liveness (1 s) + PROBE_AFTER_S + a probe or two, on a busy 2-core box


def test_a_paused_head_replaced_by_its_standby_stands_down_and_clients_move_on(nodes, tiny_pair):
    ps = hf.prompts(1)
    ref = hf.references(tiny_pair[0], ps, MAX_NEW)[0]
    head = nodes.procs["head"]
    head.send_signal(signal.SIGSTOP)
    try:
        assert hf.wait_for(lambda: hf.serving(nodes.b), 60), nodes.logs()   # the standby took over, stages back
    finally:
        head.send_signal(signal.SIGCONT)
    assert hf.wait_for(lambda: "this head was deposed" in nodes.log_text("head"), STAND_DOWN_LIMIT_S), nodes.logs()
    assert "under fencing term 2" in nodes.log_text("head")
    with Client(f"{nodes.a},{nodes.b}", timeout_s=60) as c:   # the old head first, as a new client lists it
        assert c.generate(ps[0], max_new_tokens=MAX_NEW, strategy="ar-pp")["token_ids"] == ref
        assert c.addr == nodes.b
    with pytest.raises(FlowedgeError, match="this head was deposed.*restart this board as a standby"):
        with Client(nodes.a, timeout_s=10) as c:
            c.generate(ps[0], max_new_tokens=4)
    assert head.poll() is None   # it stood down; it did not exit (systemd would only start it as the head again)
