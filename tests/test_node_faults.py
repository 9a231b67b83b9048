"""Faults on real processes (tiny models, loopback, CurveZMQ on), driven by the operator's drill script
`tools/fault_inject.py`: a stage kill -9'ed and restarted mid-request, a stage that never comes back, a
SIGSTOPped stage, 8 clients queued through a stage kill, and a head kill -9'ed and restarted."""
from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

from cluster_helpers import flowedge_home, free_port_pair, logs, start_cluster
from flowedge.launch.local_cluster import LocalClusterSpec

RECOVERY_S = 30.0   # > a stage's restart on a loaded 2-core box (python, torch, layers: up to ~20 s seen)
MAX_NEW = 120
STAGE = 2   # the last stage: it holds the lm_head and returns to the head


def _load_tool():
    path = Path(__file__).resolve().parents[1] / "tools" / "fault_inject.py"
    spec = importlib.util.spec_from_file_location("fault_inject", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules["fault_inject"] = module
    spec.loader.exec_module(module)
    return module


fi = _load_tool()


@pytest.fixture(scope="module")
def nodes(tiny_pair, tmp_path_factory):
    base, draft = tiny_pair
    with flowedge_home(tmp_path_factory.mktemp("home")):
        spec = LocalClusterSpec(nodes=3, model=str(base), draft=str(draft), port=free_port_pair(), threads=1,
                                wire_dtype="float32", recovery_s=RECOVERY_S,
                                replan_on_loss=False)   # the never-back drill: the slot stays empty
        cluster = start_cluster(spec)
        try:
            yield fi.Nodes.of(cluster)
        except BaseException:
            print(logs(cluster.run_dir))
            raise
        finally:
            cluster.stop()


def _drill(nodes, name: str, strategy: str = "ar-pp") -> dict:
    return fi.run_drills(nodes, [name], max_new=MAX_NEW, gap_s=2.0, recovery_s=RECOVERY_S, stage=STAGE,
                         strategy=strategy)[name]


@pytest.mark.parametrize("strategy", ["ar-pp", "flowspec", "auto"])
def test_a_stage_killed_mid_request_and_restarted_2s_later_changes_nothing_in_the_answer(nodes, strategy):
    """flowspec and auto (what users run) are killed with a round's segments in flight, as ar-pp is."""
    fig = _drill(nodes, "kill-restart", strategy)
    assert fig["error"] is None and fig["tokens"] >= 60, (fig, logs(nodes.run_dir))
    assert fig["identical"] and fig["replays"] >= 1, fig
    # from the head's log stamp: the kill closes the stage's connection, so this is the head's own latency
    assert fig["detected_s"] is not None and fig["detected_s"] <= 3.0, fig


def test_a_sigstopped_stage_is_detected_within_3s(nodes):
    fig = _drill(nodes, "sigstop")
    # the head's drop line vs the SIGSTOP: stage_timeout_s (2 s) + one heartbeat (0.5 s) + margin for 2 busy cores
    assert fig["detected_s"] is not None and fig["detected_s"] <= 3.5, fig
    assert fig["back_after_s"] is not None, fig   # after SIGCONT it rejoins by itself


def test_8_clients_queued_through_a_stage_kill_are_all_answered_right_and_in_order(nodes):
    """8 clients > max_concurrent (4): four run and four wait in the queue when the stage is killed."""
    fig = _drill(nodes, "clients", "auto")
    assert fig["silent"] == 0 and fig["answered"] + fig["errored"] == 8, fig
    assert fig["answered"] == 8, fig   # the stage was back within the recovery deadline
    assert fig["identical"] == 8, fig   # every answer is the undisturbed one (T=0)
    assert fig["replays"] >= 1, fig     # the kill did land mid-run: something was replayed
    assert len(fig["first_starts"]) == 8 and fig["fifo"], fig   # started in arrival order


def test_a_stage_that_never_comes_back_fails_the_request_within_the_deadline_and_the_head_serves_on(nodes):
    fig = _drill(nodes, "never-back")
    assert not fig["answered"] and "no node took its place" in fig["error"], fig
    assert fig["error_after_s"] <= RECOVERY_S + 3.0, fig
    assert fig["next_request_tokens"] > 0, fig


def test_a_restarted_head_gets_its_stages_back_and_its_client_is_told_within_5s(nodes):
    fig = _drill(nodes, "head-restart")
    assert fig["error"] is not None and fig["client_told_s"] <= 5.0, fig
    assert fig["next_request_tokens"] > 0, fig


def test_a_client_that_leaves_mid_answer_has_its_request_dropped(nodes):
    """Regression: the head spent its time on requests whose clients had left."""
    from flowedge.client.sync_client import Client

    fi.wait_ready(nodes.addr, 120)
    for leave in ("disconnect", "cancel"):
        client = Client(nodes.addr, timeout_s=60)
        before = client.status()[0]["served"]["cancelled"]
        stream = client.stream(fi.PROMPT, max_new_tokens=MAX_NEW, strategy="ar-pp")
        next(stream)
        if leave == "cancel":
            stream.close()   # closing the stream generator sends Cancel
        else:
            client.core.forget(client.in_flight)   # no Cancel: only the connection closes (as when a client dies)
        client.close()
        with Client(nodes.addr, timeout_s=10) as probe:
            took = fi.wait_until(lambda: probe.status()[0]["served"]["cancelled"] > before, 5.0)
            assert took is not None, leave
            assert probe.status()[0]["queue"] == 0


def test_a_bogus_returned_segment_is_dropped_and_the_request_completes(nodes):
    """Regression: a returned segment for an unknown node id ended the head."""

    import torch
    import zmq

    from flowedge.transport import protocol as proto
    from flowedge.transport import security

    fi.wait_ready(nodes.addr, 120)
    ref = fi.reference(nodes.addr, MAX_NEW)
    ask = fi.Asker(nodes.addr, MAX_NEW)
    ask.start()
    ask.first.wait(60)
    host, port = nodes.addr.rsplit(":", 1)
    ctx = zmq.Context()
    sock = ctx.socket(zmq.PUSH)
    sock.linger = 0
    security.secure_client(sock, security.load_keys())
    sock.connect(f"tcp://{host}:{int(port) + 1}")
    none = torch.empty(0, dtype=torch.long)
    for rid in range(1, 200):   # whichever run is live gets a prefill row of the wrong width
        bogus = proto.Segment(run_id=rid, round_id=0, seq=1, prune_version=0, kind="prefill", sent_at_step=1,
                              node_ids=none, parent_ids=none, positions=torch.tensor([0]),
                              hidden=torch.zeros(1, 8))
        sock.send_multipart(bogus.to_frames())
    sock.close(0)
    ctx.term()
    ask.join(60)
    assert ask.error is None and ask.result["token_ids"] == ref, ask.error
    from flowedge.client.sync_client import Client

    with Client(nodes.addr, timeout_s=10) as c:
        head = c.status()[0]
    assert head["dropped"].get("return_ids", 0) + head["dropped"].get("return_width", 0) >= 1, head["dropped"]
