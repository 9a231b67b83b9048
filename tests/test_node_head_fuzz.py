"""A whole head under fuzz: a real HeadNode and a real StageNode (tiny models, threads of this process,
real sockets) take random, truncated, mutated and well-formed-but-bogus frames on the head's control
port (from a client that said HELLO and from a stranger that never did) and on its pipeline return
port; the head must never raise (its thread lives) and must answer a real request afterwards exactly
as it did before the fuzz."""
from __future__ import annotations

import random
import threading
import time

import pytest
import torch
import zmq
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from cluster_helpers import flowedge_home, free_port_pair
from flowedge.client.sync_client import Client, wait_ready
from flowedge.errors import ProtocolError
from flowedge.node.node_config import NodeConfig
from flowedge.node.roots import build_head, build_stage
from flowedge.transport import protocol as p
from flowedge.transport.channel import hello_exchange, recv_msg, send_msg
from stage_fuzz_helpers import random_message
from test_transport_fuzz import schema_frames

H = 64          # the tiny model's hidden width
PROMPT = "abc def ghi"
MAX_NEW = 12


class Cluster:
    """Head + one stage in threads; remembers an exception that escapes either."""

    def __init__(self, base, draft, port: int) -> None:
        common = dict(head=f"127.0.0.1:{port}", model=str(base), draft=str(draft), stages=1, insecure=True,
                      threads=1, wire_dtype="float32", quant="none", stage_timeout_s=10.0, client_timeout_s=10.0)
        self.head = build_head(NodeConfig(role="head", node_id="fz-head", **common))
        self.stage = build_stage(NodeConfig(role="stage", node_id="fz-stage", same_host=True, **common))
        self.errors: list[BaseException] = []
        self.threads = [threading.Thread(target=self._run, args=(n,), daemon=True) for n in (self.head, self.stage)]
        for t in self.threads:
            t.start()

    def _run(self, node) -> None:
        try:
            node.run()
        except BaseException as err:  # noqa: BLE001 - the test asserts there is none
            self.errors.append(err)

    def stop(self) -> None:
        self.stage.stop.set()
        self.head.stop.set()
        for t in self.threads:
            t.join(10)


@pytest.fixture(scope="module")
def cluster(tiny_pair, tmp_path_factory):
    base, draft = tiny_pair
    with flowedge_home(tmp_path_factory.mktemp("head-fuzz-home")):
        port = free_port_pair()
        c = Cluster(base, draft, port)
        try:
            wait_ready(f"127.0.0.1:{port}", 120, insecure=True)
            with Client(f"127.0.0.1:{port}", insecure=True, timeout_s=60) as client:
                c.reference = client.generate(PROMPT, max_new_tokens=MAX_NEW, strategy="flowspec")["token_ids"]
            c.port = port
            yield c
        finally:
            c.stop()


# ---- what the fuzzer sends ---------------------------------------------------------------------------
def _bogus_but_valid(rng: random.Random) -> p.Message:
    """Messages that decode fine but make no sense from a client (or ask for little work)."""
    try:
        return _bogus(rng)
    except ProtocolError:   # a combination the constructor refuses: nothing to send
        return p.StatusRequest()


def _bogus(rng: random.Random) -> p.Message:
    pick = rng.randrange(9)
    if pick == 0:
        return p.Ready(stage_index=rng.randrange(1, 9))
    if pick == 1:
        return p.ShardRequest(offset=rng.randrange(1 << 40), sha256=rng.choice(["", "ab" * 32]))
    if pick == 2:
        return p.Heartbeat(node_id="x" * rng.randrange(300), load=rng.random() * 1e6, rss_bytes=rng.randrange(1 << 40),
                           stats={"dropped": {"x": -1}, "steps": "many"})
    if pick == 3:
        return p.Cancel(request_id=rng.randrange(1 << 20))
    if pick == 4:
        return p.Refuse(reason="r" * rng.randrange(6000))
    if pick == 5:
        return p.Hello(node_id="fz-stage", role=rng.choice(["stage", "head", "client"]), device="cpu",
                       free_memory_bytes=1, capabilities={"data_addr": "tcp://127.0.0.1:1"})
    if pick == 6:
        return p.StatusRequest()
    strategy = rng.choice(["flowspec", "ar-pp", "nonsense", "", "auto"])
    return p.PromptRequest(request_id=rng.randrange(1 << 31), text=rng.choice(["", "x", "é" * 50]),
                           max_new_tokens=rng.randrange(1, 4), strategy=strategy,
                           temperature=rng.choice([0.0, 0.7, 99.0]), seed=rng.randrange(100))


def _mutated(msg: p.Message, rng: random.Random) -> list[bytes]:
    frames = [bytearray(memoryview(f).cast("B")) for f in p.encode(msg)]
    target = frames[rng.randrange(len(frames))]
    del target[rng.randrange(len(target) + 1):]
    for _ in range(rng.randrange(4)):
        if target:
            target[rng.randrange(len(target))] = rng.randrange(256)
    return [bytes(f) for f in frames]


def _sendable(frames: list[bytes]) -> bool:
    """Everything but a well-formed Shutdown (`flowedge down`, a key holder's right) and a frame list
    ZeroMQ cannot carry."""
    if not frames:
        return False
    try:
        return not isinstance(p.decode(frames), p.Shutdown)
    except ProtocolError:
        return True


def _ctrl_frames(rng: random.Random, schema: list[bytes], raw: list[bytes]) -> list[bytes]:
    pick = rng.randrange(4)
    if pick == 0:
        return schema
    if pick == 1:
        return raw
    msg = _bogus_but_valid(rng)
    return _mutated(msg, rng) if pick == 2 else [bytes(memoryview(f)) for f in p.encode(msg)]


def _return_frames(rng: random.Random, raw: list[bytes], live_id: int) -> list[bytes]:
    msg = None
    while msg is None:
        msg = random_message(rng, H if rng.random() < 0.8 else H + 1)
    if isinstance(msg, p.Segment) and rng.random() < 0.8:   # aim at the request most likely running
        msg = p.decode([bytes(memoryview(f)) for f in p.encode(msg)])
        object.__setattr__(msg, "run_id", live_id)
    choice = rng.randrange(3)
    return raw if choice == 0 else _mutated(msg, rng) if choice == 1 else [bytes(memoryview(f)) for f in p.encode(msg)]


class Fuzzer:
    """A client that said HELLO, a stranger that never did, and a pusher on the return port."""

    def __init__(self, port: int, live_id) -> None:
        self.live_id = live_id   # the engine id of the head's newest run (aimed at, never asserted on)
        self.ctx = zmq.Context()
        self.client = self._socket(zmq.DEALER, f"tcp://127.0.0.1:{port}")
        hello_exchange(self.client, p.Hello(node_id="fuzzer", role="client", device="cpu", free_memory_bytes=0), 5000)
        self.stranger = self._socket(zmq.DEALER, f"tcp://127.0.0.1:{port}")
        self.ret = self._socket(zmq.PUSH, f"tcp://127.0.0.1:{port + 1}")

    def _socket(self, kind: int, addr: str) -> zmq.Socket:
        sock = self.ctx.socket(kind)
        sock.linger = 0
        sock.sndtimeo = 2000
        sock.connect(addr)
        return sock

    def sync(self, timeout_s: float = 10.0) -> None:
        """Wait until the head has handled everything the client sent (its answers come in order)."""
        send_msg(self.client, p.StatusRequest())
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            try:
                if isinstance(recv_msg(self.client, 200), p.StatusReply):
                    return
            except ProtocolError:
                continue
        raise AssertionError(f"the head did not answer a status request within {timeout_s} s")

    def close(self) -> None:
        for sock in (self.client, self.stranger, self.ret):
            sock.close(0)
        self.ctx.term()


@settings(deadline=None, max_examples=120, suppress_health_check=list(HealthCheck))
@given(seed=st.integers(0, 2**32 - 1), schema=schema_frames(), raw=st.lists(st.binary(max_size=64), max_size=4))
def _fuzz_round(fuzzer: Fuzzer, seed: int, schema: list[bytes], raw: list[bytes]) -> None:
    rng = random.Random(seed)
    if rng.random() < 0.5:   # a real request for the return-port frames to meet
        send_msg(fuzzer.client, p.PromptRequest(request_id=seed, text=PROMPT, max_new_tokens=8,
                                                strategy=rng.choice(["flowspec", "ar-pp"])))
    for _ in range(rng.randrange(1, 7)):
        where = rng.randrange(3)
        frames = _return_frames(rng, raw, fuzzer.live_id()) if where == 2 else _ctrl_frames(rng, schema, raw)
        if _sendable(frames):
            sock = (fuzzer.client, fuzzer.stranger, fuzzer.ret)[where]
            sock.send_multipart(frames)
    fuzzer.sync()


def test_the_head_survives_fuzzed_control_and_return_frames_and_serves_on(cluster):
    fuzzer = Fuzzer(cluster.port, lambda: cluster.head.requests.keys)   # the latest request key: its first engine id
    try:
        _fuzz_round(fuzzer)   # hypothesis draws the examples; every one ends with a status round trip
        time.sleep(0.5)       # let the return-port frames drain
    finally:
        fuzzer.close()
    assert not cluster.errors and all(t.is_alive() for t in cluster.threads), cluster.errors
    drops = cluster.head.drops.counts
    assert drops.get("malformed", 0) > 0, drops   # the fuzz reached the checks (return_* too, most runs)
    with Client(f"127.0.0.1:{cluster.port}", insecure=True, timeout_s=60) as client:
        again = client.generate(PROMPT, max_new_tokens=MAX_NEW, strategy="flowspec")["token_ids"]
    assert again == cluster.reference
    assert not cluster.errors and all(t.is_alive() for t in cluster.threads), cluster.errors
