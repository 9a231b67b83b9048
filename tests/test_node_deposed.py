"""A head that was only paused while its standby took over stands down and rejoins as the new head's
standby (real processes: the failover drill's head, standby with failover_s = 1 and two stages on the tiny
pair, CurveZMQ on). SIGSTOP the head past the failover, SIGCONT it: it finds the higher term at its
standby's address, and its process follows the new head as a standby at the old head's address, where it
refuses HELLOs naming the head that serves (a client listing the old head first is answered by the new
one). Then the new head is killed, and the old head's process takes over again, under the next term."""
from __future__ import annotations

import re
import signal

import pytest

from test_node_failover import MAX_NEW, hf, nodes  # noqa: F401 - `nodes` is the cluster fixture
from flowedge.client.sync_client import Client
from flowedge.errors import FlowedgeError

REJOIN_LIMIT_S = 20.0   # liveness (1 s) + PROBE_AFTER_S + a probe or two + the HELLO, on a busy 2-core box


def _standbys(addr: str) -> list[tuple[str, str]] | None:
    """The standbys the head at `addr` lists (node id, address); None when it does not answer as a head."""
    try:
        with Client(addr, timeout_s=2.0) as c:
            return [(r["node_id"], r["address"]) for r in c.status()[0].get("standbys") or []]
    except FlowedgeError:
        return None


def test_a_paused_head_replaced_by_its_standby_rejoins_as_its_standby_and_can_take_over_again(nodes, tiny_pair):
    ps = hf.prompts(1)
    ref = hf.references(tiny_pair[0], ps, MAX_NEW)[0]
    head = nodes.procs["head"]
    head.send_signal(signal.SIGSTOP)
    try:
        assert hf.wait_for(lambda: hf.serving(nodes.b), 60), nodes.logs()   # the standby took over, stages back
    finally:
        head.send_signal(signal.SIGCONT)
    # the old head's process follows the new head, as a standby that serves at the old head's address
    assert hf.wait_for(lambda: _standbys(nodes.b) == [("head", nodes.a)], REJOIN_LIMIT_S), nodes.logs()
    text = nodes.log_text("head")
    assert "this head was deposed" in text and "under fencing term 2" in text, text
    assert f"deposed by term 2 at {nodes.b}: rejoining as its standby" in text, text
    assert head.poll() is None   # the same process: it did not exit (systemd would only start it as the head)
    refusal = re.escape(f"head is a standby, not the head (the head is at {nodes.b}, term 2)")
    with pytest.raises(FlowedgeError, match=refusal):
        with Client(nodes.a, timeout_s=10) as c:
            c.generate(ps[0], max_new_tokens=4)
    with Client(f"{nodes.a},{nodes.b}", timeout_s=60) as c:   # the old head first, as a new client lists it
        assert c.generate(ps[0], max_new_tokens=MAX_NEW, strategy="ar-pp")["token_ids"] == ref
        assert c.addr == nodes.b
    # the new head lost: the rejoined standby takes over at the old head's address, under the next term
    nodes.procs["standby"].send_signal(signal.SIGKILL)
    nodes.procs["standby"].wait()
    assert hf.wait_for(lambda: hf.serving(nodes.a), 60), nodes.logs()
    assert f"TAKING OVER as the head at {nodes.a} under fencing term 3" in nodes.log_text("head"), nodes.logs()
    with Client(f"{nodes.a},{nodes.b}", timeout_s=60) as c:
        assert c.generate(ps[0], max_new_tokens=MAX_NEW, strategy="ar-pp")["token_ids"] == ref
        assert c.addr == nodes.a and c.status()[0]["term"] == 3
