"""End to end over real processes and real sockets (loopback): `flowedge up` + `flowedge prompt`.

Tiny generated models; hidden states travel as float32 so the pipeline is bit-exact to one process
and the answer must be token-identical to `flowedge generate --strategy ar`.
"""
from __future__ import annotations

import json
import signal
import threading
import time

import msgpack
import pytest
import zmq

from cluster_helpers import (flowedge_cli, flowedge_home, free_port_pair, logs, spawn_join, start_cluster,
                            wait_for_text)
from flowedge.client.sync_client import Client, RequestFailed
from flowedge.core.config import STRATEGY_NAMES
from flowedge.errors import FlowedgeError
from flowedge.launch.local_cluster import LocalClusterSpec
from flowedge.generate import GenerateRequest, run_generate
from flowedge.transport import security
from flowedge.transport.channel import recv_msg, send_msg
from flowedge.transport.protocol import Hello, Refuse

PROMPTS = ["abc def ghi jkl", "The quick brown fox", "zzzz"]
MAX_NEW = 40


@pytest.fixture(scope="module")
def all_references(tiny_pair):
    """`flowedge generate --strategy ar` with the cluster's quantization: int4 (the default, W4A16
    stages) and none (the full-precision exactness check)."""
    base, draft = tiny_pair
    return {quant: {p: run_generate(GenerateRequest(p, str(base), str(draft), "ar", MAX_NEW, quant=quant))["token_ids"]
                    for p in PROMPTS} for quant in ("int4", "none")}


@pytest.fixture(scope="module")
def references(cluster, all_references):
    return all_references[cluster.spec.quant]


@pytest.fixture(scope="module", params=[(3, "int4"), (5, "int4"), (3, "none")], ids=["3-nodes", "5-nodes", "3-fp32"])
def cluster(request, tiny_pair, tmp_path_factory):
    base, draft = tiny_pair
    nodes, quant = request.param
    with flowedge_home(tmp_path_factory.mktemp("home")):
        spec = LocalClusterSpec(nodes=nodes, model=str(base), draft=str(draft), port=free_port_pair(),
                                threads=1, wire_dtype="float32", stage_timeout_s=4.0, quant=quant,
                                device="orin-nano-8gb")   # a GPU profile: `auto` keeps each strategy's placement
        c = start_cluster(spec)
        yield c
        c.stop()


@pytest.mark.parametrize("strategy", ["flowspec", "ar-pp", "auto"])
def test_cluster_answer_equals_plain_greedy(cluster, references, strategy):
    with Client(cluster.spec.addr, timeout_s=60) as client:
        for prompt in PROMPTS:
            pieces = list(client.stream(prompt, max_new_tokens=MAX_NEW, strategy=strategy))
            res = client.last_result
            assert res["token_ids"] == references[prompt], (prompt, logs(cluster.run_dir))
            assert "".join(pieces) == res["text"]
            assert res["strategy"] == strategy and res["wall_tokens_per_s"] > 0
            if strategy == "flowspec":   # sized from the orin profile: flat int4 segments, d0 = 1
                assert (res["tree_depth"], res["tree_nodes"]) == (1, 13), res
            if strategy == "auto":   # its choice and the reason, from the stages' profiles, in stats and status
                assert res["auto"]["choice"] in ("flowspec", "pipedec", "ar-pp") and res["auto"]["reason"], res
                assert "predicted_tok_s" in res["auto"]
                head = next(n for n in client.status() if n["role"] == "head")
                assert head["auto"] == res["auto"]
    assert max(len(r) for r in references.values()) >= 20   # the comparison covers real decoding


def test_every_strategy_the_daemon_accepts_answers_as_plain_greedy(cluster, references):
    """Every name the CLI and the HTTP API accept runs on the daemon (pipespec's "chain" segments once
    ended the head: the wire refused a phase its own strategy made)."""
    with Client(cluster.spec.addr, timeout_s=60) as client:
        for strategy in STRATEGY_NAMES:
            res = client.generate(PROMPTS[0], max_new_tokens=MAX_NEW, strategy=strategy)
            assert res["token_ids"] == references[PROMPTS[0]], (strategy, logs(cluster.run_dir))
        assert next(n for n in client.status() if n["role"] == "head")["ready"]


def test_sampling_params_reach_the_token_choosing_last_stage(cluster, references):
    """At a vanishing temperature the last stage's multinomial draw is the argmax: the sampled answer
    equals greedy, which checks that the request's sampling params crossed every hop."""
    with Client(cluster.spec.addr, timeout_s=60) as client:
        for strategy in ("flowspec", "naive-pp"):   # last-stage choice, node-0 choice
            res = client.generate(PROMPTS[1], max_new_tokens=MAX_NEW, strategy=strategy, temperature=1e-5, seed=7)
            assert res["token_ids"] == references[PROMPTS[1]], (strategy, logs(cluster.run_dir))
            by_stage = strategy == "flowspec"
            assert res["lm_head_at"] == ("last-stage" if by_stage else "head")
            assert (res["stage_chosen_tokens"] > 0) == by_stage


def test_prompt_cli_json_matches_generate_json(cluster, references):
    out = flowedge_cli("prompt", PROMPTS[0], "--head", cluster.spec.addr, "--max-new-tokens", str(MAX_NEW),
                       "--json", "--strategy", "flowspec")
    assert out.returncode == 0, out.stderr
    res = json.loads(out.stdout)
    assert res["token_ids"] == references[PROMPTS[0]]
    for key in ("text", "token_ids", "new_tokens", "wall_s", "tokens_per_s", "mean_accept_len",
                "wall_tokens_per_s"):
        assert key in res


def test_status_lists_every_node(cluster):
    out = flowedge_cli("status", "--head", cluster.spec.addr, "--json")
    assert out.returncode == 0, out.stderr
    nodes = json.loads(out.stdout)
    assert [n["role"] for n in nodes] == ["head"] + ["stage"] * (cluster.spec.nodes - 1)
    assert all(n["ready"] for n in nodes)
    ranges = [n["layers"] for n in nodes[1:]]
    assert ranges[0][0] == 0 and all(a[1] == b[0] for a, b in zip(ranges, ranges[1:]))
    text = flowedge_cli("status", "--head", cluster.spec.addr).stdout
    assert "stage-1" in text and "ready" in text


def test_bad_requests_get_one_line_errors_and_the_cluster_keeps_serving(cluster, references):
    with Client(cluster.spec.addr, timeout_s=30) as client:
        with pytest.raises(RequestFailed, match="context"):
            client.generate("x" * 10, max_new_tokens=10 ** 6)
        with pytest.raises(RequestFailed, match="unknown strategy|strategy"):
            client.generate("hi", strategy="warp-drive")
        with pytest.raises(FlowedgeError, match="temperature"):
            client.generate("hi", temperature=float("nan"))
        assert client.generate(PROMPTS[1], max_new_tokens=MAX_NEW)["token_ids"] == references[PROMPTS[1]]


def test_foreign_keys_and_wrong_version_are_refused_without_disturbing_a_request(cluster, references,
                                                                                   tmp_path):
    if cluster.spec.nodes != 5:
        pytest.skip("run once")
    addr = cluster.spec.addr
    result: dict = {}

    def long_request():
        with Client(addr, timeout_s=60) as c:
            result["ids"] = c.generate(PROMPTS[2], max_new_tokens=MAX_NEW)["token_ids"]

    worker = threading.Thread(target=long_request)
    worker.start()
    # 1. A node holding some other cluster's keys cannot even say HELLO.
    security.init_keys(tmp_path / "other-keys")
    with pytest.raises(FlowedgeError, match="cannot reach"):
        with Client(addr, keys_dir=tmp_path / "other-keys", timeout_s=2) as rogue:
            rogue.status()
    # 2. A stage joining with those keys is refused too, and the head logs it.
    join_log = tmp_path / "rogue-join.log"
    rogue_stage = spawn_join(addr, "--keys", str(tmp_path / "other-keys"), "--node-id", "rogue", log_path=join_log)
    try:
        assert wait_for_text(join_log, "no answer to HELLO", 30), join_log.read_text()
    finally:
        rogue_stage.send_signal(signal.SIGTERM)
        rogue_stage.wait(20)
    assert wait_for_text(cluster.run_dir / "head.log", "handshake failed", 10)
    # 3. A HELLO from another major protocol version gets a REFUSE naming both versions.
    ctx = zmq.Context()
    try:
        sock = ctx.socket(zmq.DEALER)
        sock.linger = 0
        security.secure_client(sock, security.load_keys())
        sock.connect(f"tcp://{addr}")
        hello = Hello(node_id="future", role="stage", device="x", free_memory_bytes=0)
        frames = hello.to_frames()
        header = msgpack.unpackb(frames[0])
        header["v"] = [2, 0]
        sock.send_multipart([msgpack.packb(header), *frames[1:]])
        reply = recv_msg(sock, 10_000)
        assert isinstance(reply, Refuse) and "protocol 2.0" in reply.reason
        # 4. Garbage frames are dropped with a log line.
        sock.send_multipart([b"\xc1not msgpack"])
        send_msg(sock, Hello(node_id="late", role="client", device="x", free_memory_bytes=0))
        assert recv_msg(sock, 10_000) is not None
        sock.close(0)
    finally:
        ctx.term()
    worker.join(60)
    assert result["ids"] == references[PROMPTS[2]]
    with Client(addr) as c:
        assert all(n["ready"] for n in c.status())


def test_bogus_peer_messages_are_dropped_counted_and_survived(cluster, references):
    """A key holder sends a 5,000-character message type to the head, and a self-parent segment, a
    wrong-width segment, a prune set and resets for the next two requests to stage 1's data port (prune
    sets and resets come only from the head, on its control connection: forged resets once poisoned the
    next requests' ids, which then hung): both answer or drop, `status` counts the stage's drops, and
    the next requests are answered at once and exact."""
    if cluster.spec.nodes != 3:
        pytest.skip("run once")
    import torch

    from flowedge.transport import protocol as proto

    ctx = zmq.Context()
    try:
        keys = security.load_keys()
        head = ctx.socket(zmq.DEALER)
        head.linger = 0
        security.secure_client(head, keys)
        head.connect(f"tcp://{cluster.spec.addr}")
        send_msg(head, Hello(node_id="fuzzer", role="client", device="x", free_memory_bytes=0))
        assert recv_msg(head, 10_000) is not None
        head.send_multipart([msgpack.packb({"v": [1, 2], "type": "x" * 5000, "tensors": {}})])
        reply = recv_msg(head, 10_000)
        assert isinstance(reply, proto.ErrorReply) and len(reply.message) < 300, reply
        with Client(cluster.spec.addr) as c:
            stage1 = next(n for n in c.status() if n.get("stage") == 1)
        data = ctx.socket(zmq.PUSH)
        data.linger = 0
        security.secure_client(data, keys)
        data.connect(stage1["address"])

        def seg(node, parent, width):
            return proto.Segment(run_id=99, round_id=0, seq=1, prune_version=0, kind="draft", sent_at_step=0,
                                 node_ids=torch.tensor([node]), parent_ids=torch.tensor([parent]),
                                 positions=torch.tensor([5]), hidden=torch.zeros(1, width),
                                 hidden_wire="float32")
        send_msg(data, seg(3, 3, 64))
        send_msg(data, seg(3, 1, 65))
        send_msg(data, proto.Prune(run_id=99, round_id=0, version=1, horizon=4,
                                   commit_ids=torch.tensor([1]), keep_ids=torch.tensor([1, 2])))
        upcoming = _next_run_id(cluster)
        for run_id in (upcoming, upcoming + 1):
            send_msg(data, proto.Reset(run_id=run_id))
        deadline = time.monotonic() + 20
        dropped: dict = {}
        while time.monotonic() < deadline and sum(dropped.values()) < 5:
            time.sleep(0.5)
            with Client(cluster.spec.addr) as c:
                dropped = next(n for n in c.status() if n.get("stage") == 1).get("dropped", {})
        assert dropped == {"segment_parents": 1, "segment_width": 1, "unexpected_type": 3}, dropped
        data.close(0)
        head.close(0)
    finally:
        ctx.term()
    text = flowedge_cli("status", "--head", cluster.spec.addr).stdout
    assert "dropped 5 (segment_parents 1, segment_width 1, unexpected_type 3)" in text, text
    with Client(cluster.spec.addr, timeout_s=20) as client:   # far below the head's stall timeout
        for _ in range(2):
            assert client.generate(PROMPTS[0], max_new_tokens=MAX_NEW)["token_ids"] == references[PROMPTS[0]]


def _next_run_id(cluster) -> int:
    """The id the head will give the next request (its log names every request it starts)."""
    import re

    head_log = (cluster.run_dir / "head.log").read_text()
    started = [int(n) for n in re.findall(r"request (\d+): \d+ prompt tokens", head_log)]
    return max(started, default=0) + 1


def test_bogus_returned_segments_never_reach_the_head_engine(cluster, references):
    """Segments on the head's return port naming nodes the head never sent (once: the head ended) are
    dropped and counted while a request runs; the request's answer is still exact."""
    if cluster.spec.nodes != 3:
        pytest.skip("run once")
    import torch

    from flowedge.transport import protocol as proto

    result: dict = {}

    def request():
        with Client(cluster.spec.addr, timeout_s=60) as c:
            result["ids"] = c.generate(PROMPTS[1], max_new_tokens=MAX_NEW, strategy="naive-pp")["token_ids"]

    ctx = zmq.Context()
    try:
        ret = ctx.socket(zmq.PUSH)
        ret.linger = 0
        security.secure_client(ret, security.load_keys())
        host, port = cluster.spec.addr.rsplit(":", 1)
        ret.connect(f"tcp://{host}:{int(port) + 1}")
        bogus = [proto.Segment(run_id=run_id, round_id=round_id, seq=1, prune_version=0, kind="draft",
                               sent_at_step=0, node_ids=torch.tensor([60_000]), parent_ids=torch.tensor([0]),
                               positions=torch.tensor([5]), hidden=torch.zeros(1, 64), hidden_wire="float32")
                 for run_id in [_next_run_id(cluster)] for round_id in range(MAX_NEW + 4)]
        frames = [m.to_frames() for m in bogus]
        worker = threading.Thread(target=request)
        worker.start()
        while worker.is_alive():
            for f in frames:
                ret.send_multipart(f)
            time.sleep(0.01)
        worker.join(60)
        ret.close(0)
    finally:
        ctx.term()
    assert result.get("ids") == references[PROMPTS[1]], logs(cluster.run_dir)
    with Client(cluster.spec.addr) as c:
        head = c.status()[0]
    assert head.get("dropped", {}).get("return_ids", 0) >= 1, (head, logs(cluster.run_dir))


def test_up_gives_every_process_every_core_with_idle_threads_asleep(monkeypatch):
    """The processes of one box take turns: each turn runs on all cores, and idle OpenMP threads sleep
    (spinning ones collapsed three concurrent requests to a sixth of the rate); a user's own wait policy
    and an explicit --threads win."""
    import os

    from flowedge.launch.local_cluster import node_env

    monkeypatch.setattr(os, "cpu_count", lambda: 6)
    assert LocalClusterSpec(nodes=3).per_process_threads() == 6
    assert LocalClusterSpec(nodes=3, threads=1).per_process_threads() == 1
    env = node_env(6, {"PATH": "/bin"})
    assert env == {"PATH": "/bin", "OMP_WAIT_POLICY": "passive", "OMP_NUM_THREADS": "6", "MKL_NUM_THREADS": "6"}
    assert node_env(2, {"OMP_WAIT_POLICY": "active"})["OMP_WAIT_POLICY"] == "active"
