"""A stage killed (-9) under a real tiny cluster with the HTTP API in front: a request made while its slot is
empty is told so within the head's recovery deadline, over HTTP (503, Retry-After, an OpenAI error naming
the stage) and over ZeroMQ (ClusterNotReady naming the stage); once the stage is back, requests are
answered again. Before, both waited out their client's timeout (300 s) for "the head gave no answer"."""
from __future__ import annotations

import os
import signal
import threading
import time

import httpx
import pytest

from cluster_helpers import READY_TIMEOUT_S, flowedge_home, free_port_pair, logs
from flowedge.api.server import build_server
from flowedge.api.settings import ApiSettings
from flowedge.client.sync_client import Client, wait_ready
from flowedge.errors import ClusterNotReady, FlowedgeError
from flowedge.launch import local_cluster
from flowedge.launch.local_cluster import LocalClusterSpec

RECOVERY_S = 3.0
SLACK_S = 4.0    # a loaded 2-core box: the head's turn, the API's hop, the client's own start
STAGE = 2
CHAT = {"model": "base", "messages": [{"role": "user", "content": "zzzz"}], "max_tokens": 8, "temperature": 0}


@pytest.fixture(scope="module")
def outage(tiny_pair, tmp_path_factory):
    base, draft = tiny_pair
    with flowedge_home(tmp_path_factory.mktemp("home")):
        spec = LocalClusterSpec(nodes=3, model=str(base), draft=str(draft), port=free_port_pair(), threads=1,
                                wire_dtype="float32", recovery_s=RECOVERY_S,
                                replan_on_loss=False)   # the outage lasts: no re-plan around it
        cluster = local_cluster.start(spec)
        server = build_server(ApiSettings(head=spec.addr, request_timeout_s=60), "127.0.0.1", 0, log_level="warning")
        thread = threading.Thread(target=server.run, daemon=True)
        thread.start()
        try:
            try:
                wait_ready(spec.addr, READY_TIMEOUT_S, alive=cluster.alive)
            except FlowedgeError as err:
                raise AssertionError(f"cluster did not start: {err}\n{logs(cluster.run_dir)}") from None
            while not server.started:
                time.sleep(0.05)
            url = f"http://127.0.0.1:{server.servers[0].sockets[0].getsockname()[1]}"
            yield cluster, url
        finally:
            server.should_exit = True
            thread.join(10)
            cluster.stop()


def _slot_empty(addr: str, stage: int, timeout_s: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout_s
    with Client(addr, timeout_s=10) as c:
        while time.monotonic() < deadline:
            if any(n.get("stage") == stage and n.get("missing") for n in c.status()[1:]):
                return True
            time.sleep(0.1)
    return False


def test_a_request_while_a_stage_is_gone_is_told_within_recovery_and_answered_once_it_is_back(outage):
    cluster, url = outage
    addr = cluster.spec.addr
    assert httpx.post(url + "/v1/chat/completions", json=CHAT, timeout=60).status_code == 200
    os.kill(cluster.procs[STAGE].pid, signal.SIGKILL)
    cluster.procs[STAGE].wait(10)
    assert _slot_empty(addr, STAGE), logs(cluster.run_dir)

    t0 = time.monotonic()
    r = httpx.post(url + "/v1/chat/completions", json=CHAT, timeout=60)
    took = time.monotonic() - t0
    assert r.status_code == 503 and took <= RECOVERY_S + SLACK_S, (r.status_code, took, r.text)
    assert int(r.headers["retry-after"]) > 0
    err = r.json()["error"]
    assert err["code"] == "cluster_not_ready" and err["type"] == "service_unavailable", err
    assert f"stage {STAGE}" in err["message"] and f"within {RECOVERY_S:g} s" in err["message"], err

    with Client(addr, timeout_s=60) as c:
        t0 = time.monotonic()
        with pytest.raises(ClusterNotReady, match=f"waiting for stage {STAGE}"):
            c.generate("zzzz", max_new_tokens=8)
        assert time.monotonic() - t0 <= RECOVERY_S + SLACK_S
        assert c.status()[0]["served"]["failed"] == 2   # the cluster's fault, both times

    cluster.restart(STAGE)
    wait_ready(addr, READY_TIMEOUT_S, alive=cluster.alive)
    r = httpx.post(url + "/v1/chat/completions", json=CHAT, timeout=60)
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] > 0, r.text
    with Client(addr, timeout_s=60) as c:
        assert c.generate("zzzz", max_new_tokens=8)["new_tokens"] > 0
