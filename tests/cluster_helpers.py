"""Helpers for the daemon tests: free ports, a local cluster of real processes, log inspection, a head played
by the test on the in-memory link."""
from __future__ import annotations

import os
import subprocess
import sys
import time
from contextlib import contextmanager
from pathlib import Path

from flowedge.client.sync_client import wait_ready
from flowedge.launch import local_cluster
from flowedge.transport import addresses, protocol as proto
from flowedge.transport.link import Inbound, Kind, port_of
from flowedge.transport.memory_link import MemoryNetwork

READY_TIMEOUT_S = 180.0


def free_port_pair() -> int:
    """A port p with p and p + 1 both free (the head binds both)."""
    return free_port_run(2)


def free_port_run(span: int) -> int:
    """A port p with p .. p + span - 1 all free (a head binds two; a standby beside it, at p + 2, two more),
    below the ephemeral range so that no outgoing connection takes one before the cluster binds it."""
    return addresses.free_port_run(span)


@contextmanager
def flowedge_home(path: Path):
    """Point FLOWEDGE_HOME (read by this process and inherited by children) at `path`."""
    old = os.environ.get("FLOWEDGE_HOME")
    os.environ["FLOWEDGE_HOME"] = str(path)
    try:
        yield path
    finally:
        if old is None:
            os.environ.pop("FLOWEDGE_HOME", None)
        else:
            os.environ["FLOWEDGE_HOME"] = old


def start_cluster(spec: local_cluster.LocalClusterSpec) -> local_cluster.LocalCluster:
    cluster = local_cluster.start(spec)
    try:
        wait_ready(spec.addr, READY_TIMEOUT_S, insecure=spec.insecure, alive=cluster.alive, drafters=int(spec.drafter))
    except BaseException:
        cluster.stop(grace_s=2.0)
        raise AssertionError("cluster did not start:\n" + logs(cluster.run_dir)) from None
    return cluster


def logs(run_dir: Path) -> str:
    return "\n".join(f"== {p.name}\n{p.read_text()[-3000:]}" for p in sorted(Path(run_dir).glob("*.log")))


def flowedge_cli(*args: str, timeout: float = 120.0, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "flowedge", *args], capture_output=True, text=True,
                          timeout=timeout, env={**os.environ, **(env or {})})


def spawn_join(addr: str, *args: str, log_path: Path, env: dict | None = None) -> subprocess.Popen:
    logf = open(log_path, "ab")
    proc = subprocess.Popen([sys.executable, "-m", "flowedge", "-v", "join", addr, "--threads", "1", *args],
                            stdout=logf, stderr=subprocess.STDOUT, env={**os.environ, **(env or {})})
    logf.close()
    return proc


def wait_for_text(path: Path, text: str, timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if path.is_file() and text in path.read_text():
            return True
        time.sleep(0.2)
    return False


class ScriptedHead:
    """A head's ROUTER on the in-memory link, driven by the test: it reads what a node sends and answers."""

    def __init__(self, net: MemoryNetwork) -> None:
        self.link = net.link()
        self.router = self.link.listen(Kind.ROUTER, "127.0.0.1")
        self.addr = f"127.0.0.1:{port_of(self.router.address)}"

    def next(self, kind: type, timeout_s: float = 5.0) -> tuple[proto.Message, bytes]:
        """The next message of type `kind` (others skipped) and its sender."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            got = self.router.receive(0.05)
            if isinstance(got, Inbound):
                msg = proto.decode(got.frames)
                if isinstance(msg, kind):
                    return msg, got.peer
        raise AssertionError(f"no {kind.__name__} within {timeout_s} s")

    def welcome(self, heartbeat_ms: int = 40) -> tuple[proto.Hello, bytes]:
        """Wait for a HELLO and WELCOME it; the HELLO and its sender."""
        hello, peer = self.next(proto.Hello)
        self.router.send(proto.Welcome(node_id="head", heartbeat_interval_ms=heartbeat_ms), peer)
        return hello, peer
