"""A stage whose assignment fails stays up: a real StageNode (tiny model, in a thread) against a
scripted head on real sockets. Each bad Assign (a layer range the model lacks, a shard the manifest
does not name, a shard whose bytes fail their checksum) is answered with a Refuse naming why, the
heartbeats go on, and a good Assign afterwards makes it Ready and it runs a prefill."""
from __future__ import annotations

import threading
import time

import pytest
import torch
import zmq

from flowedge.models.shards import Manifest
from flowedge.models.split import split_model
from flowedge.node import model_check
from flowedge.node.node_config import NodeConfig
from flowedge.node.roots import build_stage
from flowedge.node.shard_fetch import SIDE_FILES, cached_dir, read_chunk, stage_files
from flowedge.transport import protocol as p
from flowedge.transport.channel import recv_msg, recv_routed, send_msg, send_routed

from cluster_helpers import free_port_pair

H = 64   # the tiny model's hidden width


class ScriptedHead:
    """The head's end of one stage connection, driven by the test."""

    def __init__(self, port: int) -> None:
        self.ctx = zmq.Context()
        self.ctrl = self.ctx.socket(zmq.ROUTER)
        self.ctrl.linger = 0
        self.ctrl.bind(f"tcp://127.0.0.1:{port}")
        self.ret = self.ctx.socket(zmq.PULL)
        self.ret.linger = 0
        self.ret.bind(f"tcp://127.0.0.1:{port + 1}")
        self.stage: bytes | None = None
        self.heartbeats = 0

    def welcome(self) -> p.Hello:
        hello = self.next_hello()
        send_routed(self.ctrl, self.stage, p.Welcome(node_id="scripted-head", heartbeat_interval_ms=100))
        return hello

    def next_hello(self, timeout_s: float = 20.0) -> p.Hello:
        """The next HELLO (heartbeats of an earlier connection skipped); its sender becomes `stage`."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            got = recv_routed(self.ctrl, 200)
            msg = p.decode(got[1]) if got is not None else None
            if isinstance(msg, p.Hello):
                self.stage = got[0]
                return msg
        raise AssertionError("the stage never said HELLO")

    def next_answer(self, assign: p.Assign, timeout_s: float = 30.0, serve=None) -> p.Message:
        """Send `assign`; the stage's first Refuse or Ready (ShardRequests go to `serve`)."""
        send_routed(self.ctrl, self.stage, assign)
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            got = recv_routed(self.ctrl, 200)
            if got is None:
                continue
            msg = p.decode(got[1])
            if isinstance(msg, p.Heartbeat):
                self.heartbeats += 1
                send_routed(self.ctrl, self.stage, p.Heartbeat(node_id="scripted-head", load=0.0, rss_bytes=0))
            elif isinstance(msg, p.ShardRequest) and serve is not None:
                send_routed(self.ctrl, self.stage, serve(msg))
            elif isinstance(msg, (p.Refuse, p.Ready)):
                return msg
        raise AssertionError(f"no Refuse or Ready within {timeout_s} s")

    def heartbeat(self, timeout_s: float = 5.0) -> p.Heartbeat:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            got = recv_routed(self.ctrl, 200)
            msg = p.decode(got[1]) if got is not None else None
            if isinstance(msg, p.Heartbeat):
                return msg
        raise AssertionError(f"no heartbeat within {timeout_s} s")

    def close(self) -> None:
        self.ctrl.close(0)
        self.ret.close(0)
        self.ctx.term()


@pytest.fixture()
def split(tiny_pair, tmp_path):
    out = tmp_path / "split"
    split_model(tiny_pair[0], 2, out, model_name="tiny", quant="none")
    return out


def _assign(split, *, sha=None, layers=None, source_dir=True, model="") -> p.Assign:
    shard = stage_files(split, 1)
    a, b = layers or (0, 2)
    return p.Assign(stage_index=1, layer_start=a, layer_end=b, shard_sha256=sha or shard.sha256,
                    shard_bytes=shard.size, next_addr="", model="tiny", hidden_wire="float16", quant="none",
                    side_files={k: v for k, v in shard.side_files.items() if k in SIDE_FILES},
                    source_dir=str(split) if source_dir else "", model_sha256=model)


def test_a_failing_assign_leaves_the_stage_up_and_a_later_one_is_served(split, tmp_path, monkeypatch):
    monkeypatch.setenv("FLOWEDGE_HOME", str(tmp_path / "home"))
    port = free_port_pair()
    head = ScriptedHead(port)
    stop = threading.Event()
    node = build_stage(NodeConfig(role="stage", head=f"127.0.0.1:{port}", node_id="edge-1", insecure=True,
                                  same_host=True, heartbeat_ms=100, stage_timeout_s=5.0, threads=1), stop)
    thread = threading.Thread(target=node.run, daemon=True)
    thread.start()
    try:
        assert head.welcome().node_id == "edge-1"
        wrong_range = head.next_answer(_assign(split, layers=(0, 99)))
        assert isinstance(wrong_range, p.Refuse) and "outside the model's" in wrong_range.reason
        unknown = head.next_answer(_assign(split, sha="ab" * 32, source_dir=False))
        assert isinstance(unknown, p.Refuse) and "not in the head's manifest" in unknown.reason
        shard = stage_files(split, 1)

        def garbage(req: p.ShardRequest) -> p.ShardChunk:   # chunks that hash right, a file that does not
            n = min(req.length, shard.size - req.offset)
            return p.ShardChunk.of(req.offset, bytes(n), shard.size)

        corrupt = head.next_answer(_assign(split, source_dir=False), serve=garbage)
        assert isinstance(corrupt, p.Refuse) and "ChecksumError" in corrupt.reason
        assert thread.is_alive() and head.heartbeat().node_id == "edge-1"   # still beating, unassigned
        assert node.phase.startswith("assignment failed")

        ready = head.next_answer(_assign(split))
        assert isinstance(ready, p.Ready) and ready.stage_index == 1
        none = torch.empty(0, dtype=torch.long)
        push = head.ctx.socket(zmq.PUSH)
        push.linger = 0
        push.connect(node.data_addr)
        send_msg(push, p.Segment(run_id=1, round_id=0, seq=1, prune_version=0, kind="prefill",
                                 sent_at_step=0, node_ids=none, parent_ids=none, positions=torch.arange(3),
                                 hidden=torch.randn(3, H).half()))
        out = recv_msg(head.ret, 20_000)   # stage 1 of 2 forwards its hidden states to the next hop
        push.close(0)
        assert isinstance(out, p.Segment) and out.run_id == 1 and tuple(out.hidden.shape) == (3, H)
        assert node.drops.counts.get("request_failed", 0) == 0
    finally:
        stop.set()
        thread.join(10)
        head.close()
    assert not thread.is_alive()


def test_a_stage_holding_another_model_s_layers_is_refused_at_join_drops_them_and_joins_again(split, tmp_path,
                                                                                               monkeypatch):
    """A head restarted on another model: the stage rejoins announcing the model of the layers it holds, is
    refused for it, drops them and joins holding none; the head's split on this host, cut from another model
    than the one assigned, is not read."""
    monkeypatch.setenv("FLOWEDGE_HOME", str(tmp_path / "home"))
    port = free_port_pair()
    head = ScriptedHead(port)
    stop = threading.Event()
    node = build_stage(NodeConfig(role="stage", head=f"127.0.0.1:{port}", node_id="edge-1", insecure=True,
                                  same_host=True, heartbeat_ms=100, stage_timeout_s=0.5, threads=1), stop)
    thread = threading.Thread(target=node.run, daemon=True)
    thread.start()
    served, other = Manifest.load(split).source_sha256, "c" * 64
    try:
        assert model_check.HELD_KEY not in head.welcome().capabilities
        assert isinstance(head.next_answer(_assign(split, model=served)), p.Ready)
        rejoin = head.next_hello()   # the head fell silent: the stage joins again, saying what it holds
        assert rejoin.capabilities[model_check.HELD_KEY] == served
        send_routed(head.ctrl, head.stage, p.Refuse(reason=model_check.join_refusal(rejoin.capabilities, other)))
        assert model_check.HELD_KEY not in head.welcome().capabilities and node.worker is None
        shard = stage_files(split, 1)
        fetched = head.next_answer(_assign(split, model=other), serve=lambda req: read_chunk(shard, req))
        assert isinstance(fetched, p.Ready) and cached_dir(tmp_path / "home", shard.sha256) is not None
        assert node.model_sha256 == other
    finally:
        stop.set()
        thread.join(10)
        head.close()
    assert not thread.is_alive()
