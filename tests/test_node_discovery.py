"""Discovery (flowedge/node/discovery.py): a head whose name another responder holds announces itself
under another and is found; a stage that found an impostor moves on to the real head once it is announced
(real zeroconf on this host's own interface); no announcer error ends the head; and a real `flowedge join`
with no address in one network namespace finding by mDNS a head in another (a veth pair with 10.x
addresses inside the two namespaces only)."""
from __future__ import annotations

import functools
import json
import logging
import os
import shutil
import subprocess
import sys
import threading
import time
from contextlib import contextmanager
from pathlib import Path

import pytest
from click.testing import CliRunner
from zeroconf import NonUniqueNameException, ServiceInfo, Zeroconf

from flowedge.node import discovery, node_base
from flowedge.node.node_config import NodeConfig
from flowedge.transport import protocol as proto
from flowedge.transport import security
from flowedge.transport.handshake import answer_hello
from flowedge.transport.link import Inbound, Kind, port_of
from flowedge.transport.zmq_link import ZmqLink

LAB = f"lab.{discovery.SERVICE_TYPE}"
pytestmark = pytest.mark.serial   # mDNS on this host's LAN: no other worker announcing meanwhile (Makefile)


def _lan_ip() -> str:
    """An address of this host that mDNS announces (the head binds to it), or the test is skipped."""
    ips = discovery.lan_addresses("0.0.0.0")
    if not ips:
        pytest.skip("no non-loopback IPv4 interface to announce on")
    return ips[0]


@contextmanager
def _impostor(ip: str, port: int):
    """Anyone on the LAN announcing the name `lab`, with no keys and no flowedge."""
    zc = Zeroconf()
    info = ServiceInfo(discovery.SERVICE_TYPE, LAB, port=port, parsed_addresses=[ip])
    try:
        zc.register_service(info)
        yield info
    finally:
        zc.unregister_service(info)
        zc.close()


def test_a_head_whose_name_is_taken_announces_itself_under_another_and_is_found(caplog):
    ip = _lan_ip()
    with _impostor(ip, 40001), caplog.at_level(logging.WARNING, logger=discovery.__name__):
        real = discovery.Announcer("lab", ip, 40002, "qwen2.5-coder-1.5b")   # today: NonUniqueNameException
        try:
            assert real.info.name != LAB and real.info.name.startswith("lab")
            assert "already announces" in caplog.text and real.info.name in caplog.text
            heads = discovery.browse(3.0, settle_s=0.5)
            assert {h.addr for h in heads if h.cluster == "lab"} == {f"{ip}:40001", f"{ip}:40002"}, heads
            assert [h.model for h in heads if h.port == 40002] == ["qwen2.5-coder-1.5b"]
        finally:
            real.close()


class FakeHead:
    """A head's control port with the cluster's keys: WELCOMEs every HELLO and keeps them."""

    def __init__(self, keys: Path, ip: str) -> None:
        self.link = ZmqLink(keys)
        self.router = self.link.listen(Kind.ROUTER, ip)
        self.addr = f"{ip}:{port_of(self.router.address)}"
        self.hellos: list[proto.Hello] = []
        self.done = threading.Event()
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    def _serve(self) -> None:
        while not self.done.is_set():
            got = self.router.receive(0.05)
            if isinstance(got, Inbound) and isinstance(proto.decode(got.frames), proto.Hello):
                welcome = proto.Welcome(node_id="head", heartbeat_interval_ms=100)
                self.hellos.append(answer_hello(self.router, got.peer, got.frames, welcome))

    def close(self) -> None:
        self.done.set()
        self.thread.join(5)
        self.link.close()


def test_a_stage_that_found_an_impostor_moves_on_to_the_head_announced_later(monkeypatch, tmp_path):
    """`flowedge join --cluster lab` finds only the impostor (a listener without the keys); the impostor
    withdraws its name and the real head takes it: the stage's HELLOs reach the real head."""
    from flowedge.launch import cluster_commands
    from flowedge.node.roots import build_node

    ip = _lan_ip()
    monkeypatch.setattr(node_base, "HELLO_TIMEOUT_S", 0.5)
    monkeypatch.setattr(discovery, "browse", functools.partial(discovery.browse, settle_s=0.3))
    monkeypatch.setenv("FLOWEDGE_HOME", str(tmp_path / "home"))
    keys = tmp_path / "keys"
    security.init_keys(keys)
    keyless = ZmqLink(insecure=True)
    rogue_port = port_of(keyless.listen(Kind.ROUTER, ip).address)
    head, stop, announcer, nodes = FakeHead(keys, ip), threading.Event(), None, []

    def run_here(cfg, *found) -> None:   # the node the CLI built, in a thread of this test
        nodes.append(build_node(cfg, stop, None, *found))
        nodes.append(threading.Thread(target=nodes[0].run, daemon=True))
        nodes[1].start()

    monkeypatch.setattr(cluster_commands, "_run_node", run_here)
    try:
        with _impostor(ip, rogue_port):
            out = CliRunner().invoke(cluster_commands.join, ["--cluster", "lab", "--discover-timeout", "5",
                                                     "--keys", str(keys), "--node-id", "edge-1", "--threads", "1"])
            assert out.exit_code == 0 and f"at {ip}:{rogue_port}" in out.output, out.output
        announcer = discovery.Announcer("lab", ip, port_of(head.router.address))   # the impostor still listens
        deadline = time.monotonic() + 15
        while not head.hellos and time.monotonic() < deadline and nodes[1].is_alive():
            time.sleep(0.1)
        assert [h.node_id for h in head.hellos[:1]] == ["edge-1"], nodes[0].phase
        assert nodes[0].config.head == head.addr
    finally:
        stop.set()
        if len(nodes) == 2:
            nodes[1].join(10)
        if announcer is not None:
            announcer.close()
        head.close()
        keyless.close()


@pytest.mark.parametrize("error", [NonUniqueNameException(), RuntimeError("zeroconf event loop blocked"),
                                   OSError("no multicast"), ImportError("no zeroconf")])
def test_no_announcer_error_ends_the_head(monkeypatch, caplog, error):
    from flowedge.node.head_node import HeadNode

    def failing(*args):
        raise error

    monkeypatch.setattr(discovery, "Announcer", failing)
    node = HeadNode.__new__(HeadNode)   # only what _announce reads: no sockets, no model
    node.host, node.port, node.announcer = "10.0.0.1", 5555, None
    node.config = NodeConfig(cluster="lab")
    with caplog.at_level(logging.WARNING):
        node._announce()
    assert node.announcer is None
    assert "cannot announce on the LAN" in caplog.text and "flowedge join" in caplog.text


def test_a_loopback_head_is_not_announced():
    assert discovery.lan_addresses("127.0.0.1") == [] and discovery.lan_addresses("localhost") == []
    assert discovery.lan_addresses("10.1.2.3") == ["10.1.2.3"]
    assert all(not a.startswith("127.") for a in discovery.lan_addresses("0.0.0.0"))


# ---- two network namespaces ------------------------------------------------------------------------
def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(["ip", *args], capture_output=True, text=True, timeout=30, check=check)


@pytest.fixture()
def namespaces():
    """Two namespaces joined by a veth pair: 10.231.N.1 in the first, 10.231.N.2 in the second."""
    if os.geteuid() != 0 or shutil.which("ip") is None:
        pytest.skip("network namespaces need root and iproute2's `ip`")
    tag = os.getpid() % 10000
    a, b, net = f"fe-disc-{tag}-a", f"fe-disc-{tag}-b", f"10.231.{tag % 250}"
    if _ip("netns", "add", a, check=False).returncode != 0:
        pytest.skip("cannot create a network namespace here (`ip netns add` failed)")
    try:
        _ip("netns", "add", b)
        _ip("link", "add", f"fe{tag}a", "type", "veth", "peer", "name", f"fe{tag}b")
        for ns, dev, host in ((a, f"fe{tag}a", 1), (b, f"fe{tag}b", 2)):
            _ip("link", "set", dev, "netns", ns)
            _ip("-n", ns, "addr", "add", f"{net}.{host}/24", "dev", dev)
            _ip("-n", ns, "link", "set", dev, "up", "multicast", "on")
            _ip("-n", ns, "link", "set", "lo", "up")
        yield a, b, net
    finally:
        _ip("netns", "del", a, check=False)   # takes its end of the veth pair, and so the pair, with it
        _ip("netns", "del", b, check=False)


def _in(ns: str, args: list[str], env: dict, log: Path) -> subprocess.Popen:
    with open(log, "ab") as out:
        return subprocess.Popen(["ip", "netns", "exec", ns, sys.executable, "-m", "flowedge", "-v", *args],
                                stdout=out, stderr=subprocess.STDOUT, env={**os.environ, **env})


def _stop(*procs: subprocess.Popen) -> None:
    for p in procs:
        if p.poll() is None:
            p.terminate()
    for p in procs:
        try:
            p.wait(20)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()


def test_join_without_an_address_finds_the_head_by_mdns(namespaces, tiny_pair, tmp_path):
    ns_head, ns_stage, net = namespaces
    base, draft = tiny_pair
    head_home, stage_home = tmp_path / "head-home", tmp_path / "stage-home"
    security.init_keys(head_home / "keys")
    addr = f"{net}.1:5555"
    cfg = tmp_path / "head.toml"
    cfg.write_text(f'role = "head"\nhead = "{addr}"\nmodel = "{base}"\ndraft = "{draft}"\nstages = 1\n'
                   f'threads = 1\nwire_dtype = "float32"\ncluster = "lab"\n')
    head = _in(ns_head, ["serve", "--config", str(cfg)], {"FLOWEDGE_HOME": str(head_home)}, tmp_path / "head.log")
    stage = _in(ns_stage, ["join", "--cluster", "lab", "--discover-timeout", "90", "--keys", str(head_home / "keys"),
                           "--node-id", "edge-1", "--threads", "1"],
                {"FLOWEDGE_HOME": str(stage_home)}, tmp_path / "stage.log")
    logs = lambda: "\n".join(  # noqa: E731
        f"== {p.name}\n{p.read_text()[-3000:]}" for p in sorted(tmp_path.glob("*.log")))
    try:
        deadline, nodes = time.monotonic() + 150, []
        while time.monotonic() < deadline and head.poll() is None and stage.poll() is None:
            status = subprocess.run(["ip", "netns", "exec", ns_head, sys.executable, "-m", "flowedge", "status",
                                     "--head", addr, "--json"], capture_output=True, text=True, timeout=60,
                                    env={**os.environ, "FLOWEDGE_HOME": str(head_home)})
            nodes = json.loads(status.stdout) if status.returncode == 0 else []
            if nodes and nodes[0].get("ready"):
                break
            time.sleep(1.0)
        assert nodes and nodes[0].get("ready"), logs()
        assert [n.get("node_id") for n in nodes[1:]] == ["edge-1"] and nodes[1]["ready"]
        assert nodes[1]["address"].startswith(f"tcp://{net}.2:"), nodes[1]
        said = (tmp_path / "stage.log").read_text()
        assert f"found head of cluster 'lab' at {addr}" in said, said[-3000:]
    finally:
        _stop(stage, head)


def test_no_discovery_keeps_the_head_quiet(monkeypatch):
    from flowedge.node.node_config import NodeConfig
    from flowedge.launch.config_file import load_node_config
    from flowedge.node.head_node import HeadNode

    made = []
    monkeypatch.setattr(discovery, "Announcer", lambda *args: made.append(args))
    node = HeadNode.__new__(HeadNode)   # only what _announce reads: no sockets, no model
    node.host, node.port, node.announcer = "10.0.0.1", 5555, None
    node.config = load_node_config(None, discovery=False)
    node._announce()
    assert made == []
    node.config = NodeConfig(cluster="lab", model="qwen2.5-coder-1.5b")
    node._announce()
    assert made == [("lab", "10.0.0.1", 5555, "qwen2.5-coder-1.5b")]
