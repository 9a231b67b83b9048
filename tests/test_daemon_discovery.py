"""Discovery (flowedge/daemon/discovery.py): choosing the head among those that answer, and a real
`flowedge join` with no address in one network namespace finding by mDNS a head in another
(a veth pair with 10.x addresses inside the two namespaces only)."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from flowedge.daemon import discovery
from flowedge.daemon.discovery import FoundHead
from flowedge.errors import ConfigError
from flowedge.transport import security


def test_the_only_head_or_the_named_one_is_chosen(monkeypatch):
    heads = [FoundHead("lab", "10.0.0.1", 5555), FoundHead("prod", "10.0.0.2", 6000)]
    monkeypatch.setattr(discovery, "browse", lambda timeout_s: list(heads))
    assert discovery.find_head("prod", 1).addr == "10.0.0.2:6000"
    with pytest.raises(ConfigError, match=r"several flowedge heads.*lab at 10.0.0.1:5555.*--cluster NAME"):
        discovery.find_head(None, 1)
    with pytest.raises(ConfigError, match=r"no flowedge head named 'nosuch'.*flowedge join HOST:PORT"):
        discovery.find_head("nosuch", 1)
    heads.pop()
    assert discovery.find_head(None, 1).cluster == "lab"


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
    logs = lambda: "\n".join(f"== {p.name}\n{p.read_text()[-3000:]}" for p in sorted(tmp_path.glob("*.log")))  # noqa: E731
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
    from flowedge.daemon.config import NodeConfig, load_node_config
    from flowedge.daemon.head_node import HeadNode

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
