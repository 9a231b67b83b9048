"""A whole cluster in this process on the in-memory link: a head and 2 stages in threads, built by the
composition roots exactly as the daemons are (tiny pair, fp32 stages and wire), for tests that drive a
real head without sockets or processes."""
from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from cluster_helpers import flowedge_home
from flowedge.client.client_answer import Answer
from flowedge.client.sync_client import Client
from flowedge.node.node_config import NodeConfig
from flowedge.node.roots import build_head, build_stage
from flowedge.transport.memory_link import MemoryNetwork

PROMPT = "abc def ghi jkl"
MAX_NEW = 40
HEAD = "127.0.0.1:5555"


class Cluster:
    """Nodes in threads of this process; remembers what escaped each node's `run`."""

    def __init__(self, base, draft, **extra) -> None:
        self.net = MemoryNetwork()
        self.common = dict(head=HEAD, model=str(base), draft=str(draft), stages=2, insecure=True, threads=1,
                           wire_dtype="float32", quant="none", stage_timeout_s=10.0, client_timeout_s=30.0,
                           recovery_s=120.0, discovery=False) | extra
        self.errors: dict[str, BaseException] = {}
        self.threads: dict[str, threading.Thread] = {}
        self.head = self._start("head", build_head(NodeConfig(role="head", node_id="head", **self.common),
                                                   link=self.net.link()))
        self.stages = {name: self.add_stage(name) for name in ("s1", "s2")}

    def add_stage(self, name: str):
        node = build_stage(NodeConfig(role="stage", node_id=name, same_host=True, **self.common), link=self.net.link())
        return self._start(name, node)

    def _start(self, name: str, node):
        def run() -> None:
            try:
                node.run()
            except BaseException as err:  # noqa: BLE001 - the test reads it
                self.errors[name] = err

        self.threads[name] = threading.Thread(target=run, name=name, daemon=True)
        self.threads[name].start()
        return node

    def wait_ready(self, timeout_s: float = 240.0) -> None:
        deadline = time.monotonic() + timeout_s
        while not self.head.members.cluster_ready():
            assert time.monotonic() < deadline and not self.errors, f"not ready: {self.errors}"
            time.sleep(0.1)

    def stop(self) -> None:
        for node in [*self.stages.values(), self.head]:
            node.stop.set()
        for t in self.threads.values():
            t.join(15)


def ask(link, strategy: str = "flowspec") -> Answer:
    """The sync client on `link`: one answer, as `flowedge prompt --json` gets it."""
    with Client(HEAD, link=link, timeout_s=300) as client:
        return client.generate(PROMPT, max_new_tokens=MAX_NEW, strategy=strategy)


@contextmanager
def started(base: Path, draft: Path, home: Path, **extra) -> Iterator[Cluster]:
    """A ready cluster with its own FLOWEDGE_HOME, stopped on the way out."""
    with flowedge_home(home):
        cluster = Cluster(base, draft, **extra)
        try:
            cluster.wait_ready()
            yield cluster
        finally:
            cluster.stop()
