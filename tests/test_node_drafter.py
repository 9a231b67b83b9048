"""The drafter role on real processes (tiny pair, loopback, CurveZMQ on): a head, two stages and a drafter
(`LocalClusterSpec(drafter=True)`, predraft = "drafter"). Flowspec's answers at T=0 equal plain greedy
decoding while the drafter answers jobs; a SIGSTOPped drafter silences no request and is dropped; a
drafter killed with -9 mid-request leaves the answer complete and identical, with no error, and the
next request runs without one. In this process, on the in-memory link against a head played by the test:
jobs are declined until a setup, a setup loads once what the head names, a model that cannot load is
reported and the drafter stays up; and a whole in-memory cluster whose drafter answers with huge K/V rows:
every answer is refused and every request still answers as plain greedy."""
from __future__ import annotations

import logging
import os
import signal
import threading
import time
from dataclasses import replace
from pathlib import Path

import msgpack
import pytest
import torch

from cluster_helpers import ScriptedHead, flowedge_home, free_port_pair, logs, spawn_join, start_cluster
from flowedge.client.sync_client import Client
from flowedge.launch.local_cluster import LocalClusterSpec
from flowedge.node.drafter_node import DrafterNode
from flowedge.node.droplog import DropLog
from flowedge.node.node_base import NodeParts
from flowedge.node.node_config import NodeConfig
from flowedge.node.peer_stats import clean_stats
from flowedge.node.roots import build_head, build_stage
from flowedge.generate import GenerateRequest, run_generate
from flowedge.transport import protocol as proto
from flowedge.transport.memory_link import MemoryNetwork

PROMPTS = ["abc def ghi jkl", "The quick brown fox"]
MAX_NEW = 120


@pytest.fixture(scope="module")
def references(tiny_pair):
    base, draft = tiny_pair
    return {p: run_generate(GenerateRequest(p, str(base), str(draft), "ar", MAX_NEW))["token_ids"] for p in PROMPTS}


@pytest.fixture(scope="module")
def cluster(tiny_pair, tmp_path_factory):
    base, draft = tiny_pair
    with flowedge_home(tmp_path_factory.mktemp("home")):
        spec = LocalClusterSpec(nodes=3, model=str(base), draft=str(draft), port=free_port_pair(), threads=1,
                                wire_dtype="float32", predraft="drafter", drafter=True, strategy="flowspec")
        c = start_cluster(spec)
        try:
            yield c
        except BaseException:
            print(logs(c.run_dir))
            raise
        finally:
            c.stop()


def _nodes(cluster) -> list[dict]:
    with Client(cluster.spec.addr, timeout_s=10) as c:
        return c.status()


def _drafter_row(cluster) -> dict | None:
    return next((n for n in _nodes(cluster) if n["role"] == "drafter"), None)


def _wait(cond, timeout_s: float, what: str, cluster) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if cond():
            return
        time.sleep(0.2)
    raise AssertionError(f"{what} within {timeout_s:g} s\n{logs(cluster.run_dir)}")


def _answer(cluster, prompt: str, on_first=None) -> tuple[dict, float]:
    """The answer's result and the longest silence between its chunks; `on_first` runs at its first tokens."""
    gaps, last = [], time.monotonic()
    with Client(cluster.spec.addr, timeout_s=60) as c:
        for i, _ in enumerate(c.stream(prompt, max_new_tokens=MAX_NEW, strategy="flowspec")):
            now = time.monotonic()
            gaps.append(now - last)
            last = now
            if i == 0 and on_first is not None:
                on_first()
        return c.last_result, max(gaps[1:], default=0.0)


def test_answers_equal_greedy_and_the_drafter_answers_jobs(cluster, references):
    _wait(lambda: (_drafter_row(cluster) or {}).get("ready"), 60, "the drafter ready", cluster)
    for prompt in PROMPTS:
        res, _ = _answer(cluster, prompt)
        assert res["token_ids"] == references[prompt], logs(cluster.run_dir)
        pre = res["predraft"]
        assert pre["jobs"] > 0 and pre["hits"] + pre["grafted_nodes"] > 0, pre
    head = _nodes(cluster)[0]
    assert head["drafter_jobs"]["answered"] > 0 and head["drafter_jobs"]["rejected"] == 0, head["drafter_jobs"]
    row = _drafter_row(cluster)
    assert row["stage"] is None and row["layers"] == "draft" and row["drafter"]["errors"] == 0, row
    assert [n["stage"] for n in _nodes(cluster) if n["role"] == "stage"] == [1, 2]


def test_concurrent_requests_each_get_their_own_replica_on_the_drafter(cluster, references):
    import threading

    results: dict = {}

    def ask(prompt: str) -> None:
        results[prompt] = _answer(cluster, prompt)[0]

    before = _nodes(cluster)[0]["drafter_jobs"]
    threads = [threading.Thread(target=ask, args=(p,)) for p in PROMPTS]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert {p: r["token_ids"] for p, r in results.items()} == references
    after = _nodes(cluster)[0]["drafter_jobs"]
    # each request's jobs ship only the rows its own replica lacks: none found another request's replica
    assert after["answered"] > before["answered"] and after["behind"] == before["behind"], (before, after)
    assert all(r["predraft"]["jobs"] > 0 for r in results.values())


def test_a_sigstopped_drafter_silences_no_request_and_is_dropped(cluster, references):
    drafter = cluster.procs[-1]
    try:
        res, longest = _answer(cluster, PROMPTS[0], on_first=lambda: os.kill(drafter.pid, signal.SIGSTOP))
        assert res["token_ids"] == references[PROMPTS[0]]
        assert longest < 3.0, f"the answer stalled {longest:.2f} s on a stopped drafter"
        _wait(lambda: _drafter_row(cluster) is None, 10, "the stopped drafter dropped", cluster)
        jobs = _nodes(cluster)[0]["drafter_jobs"]
        assert jobs["timed_out"] + jobs["drafter_lost"] >= 1, jobs
    finally:
        os.kill(drafter.pid, signal.SIGCONT)
    _wait(lambda: (_drafter_row(cluster) or {}).get("ready"), 30, "the resumed drafter back", cluster)


def test_a_drafter_killed_mid_request_changes_nothing_in_the_answer(cluster, references):
    _wait(lambda: (_drafter_row(cluster) or {}).get("ready"), 30, "the drafter ready", cluster)
    drafter = cluster.procs[-1]
    res, longest = _answer(cluster, PROMPTS[1], on_first=lambda: os.kill(drafter.pid, signal.SIGKILL))
    assert res["token_ids"] == references[PROMPTS[1]] and res["finish_reason"] == "length"
    assert longest < 3.0
    drafter.wait(10)
    _wait(lambda: _drafter_row(cluster) is None, 10, "the killed drafter dropped", cluster)
    before = _nodes(cluster)[0]["drafter_jobs"]
    res, _ = _answer(cluster, PROMPTS[0])   # no drafter at all now: node 0 drafts alone
    assert res["token_ids"] == references[PROMPTS[0]]
    after = _nodes(cluster)[0]["drafter_jobs"]
    # with no drafter in, the engine makes no job at all (no snapshot copied for nobody)
    assert after["jobs"] == before["jobs"] and after["sent"] == before["sent"], (before, after)
    assert res["predraft"].get("jobs", 0) == 0


def test_a_drafter_with_nothing_on_it_fetches_the_draft_model_from_the_head(cluster, references, tmp_path):
    """Its own FLOWEDGE_HOME (no models, no cache) and not on the head's host: it fetches the draft model's
    one-stage split from the head, checksummed, loads it, and its answers are grafted."""
    import shutil

    home = tmp_path / "bare"
    (home / "keys").mkdir(parents=True)
    for f in (Path(os.environ["FLOWEDGE_HOME"]) / "keys").iterdir():
        shutil.copy(f, home / "keys" / f.name)
    log = tmp_path / "bare-drafter.log"
    proc = spawn_join(cluster.spec.addr, "--drafter", "--node-id", "bare", log_path=log,
                      env={"FLOWEDGE_HOME": str(home)})
    try:
        _wait(lambda: any(n["node_id"] == "bare" and n["ready"] for n in _nodes(cluster) if n["role"] == "drafter"),
              60, "the bare drafter ready", cluster)
        text = log.read_text()
        assert "fetching the draft model" in text and list((home / "stage-cache").iterdir()), text
        res, _ = _answer(cluster, PROMPTS[0])
        assert res["token_ids"] == references[PROMPTS[0]] and res["predraft"]["unanswered"] < res["predraft"]["jobs"]
    finally:
        proc.kill()
        proc.wait(10)


# ---- the drafter node in this process, on the in-memory link, against a head played by the test ----------
def _memory_drafter(head: ScriptedHead, net: MemoryNetwork, tmp_path: Path,
                    loader) -> tuple[DrafterNode, threading.Thread]:
    cfg = NodeConfig(role="drafter", node_id="d1", head=head.addr, insecure=True, heartbeat_ms=50, stage_timeout_s=10.0)
    node = DrafterNode(cfg, NodeParts(net.link(), DropLog(logging.getLogger(__name__)), tmp_path), loader=loader)
    thread = threading.Thread(target=node.run, daemon=True)
    thread.start()
    return node, thread


def _job_frames() -> list[bytes]:
    """A message that says it is a job (the drafter hands it to its server whole)."""
    return [msgpack.packb({"v": list(proto.PROTOCOL_VERSION), "type": proto.DraftJob.TYPE})]


def test_in_memory_a_drafter_declines_jobs_until_set_up_then_loads_once_what_the_head_names(tiny_pair, tmp_path):
    from flowedge.node.drafter_node import load_draft

    loads = []

    def loader(spec, quant):
        loads.append((spec, quant))
        return load_draft(spec, quant)

    net = MemoryNetwork()
    head = ScriptedHead(net)
    node, thread = _memory_drafter(head, net, tmp_path, loader)
    try:
        hello, peer = head.welcome()
        assert hello.role == "drafter" and hello.capabilities == {"role": "drafter"}
        head.router.send_frames(_job_frames(), peer)
        declined, _ = head.next(proto.DraftDeclined)
        assert declined.why == "error" and "no draft model yet" in declined.detail
        setup = proto.DraftSetup(model=str(tiny_pair[1]), quant="none")   # no files served: the name is resolved here
        head.router.send(setup, peer)
        ready, _ = head.next(proto.DraftReady, 120)
        assert ready.error == "" and loads == [(str(tiny_pair[1]), "none")]
        beat, _ = head.next(proto.Heartbeat)
        assert beat.stats["phase"] == f"drafting with {tiny_pair[1]}" and beat.stats["drafter"]["jobs"] == 0
        assert clean_stats(beat.stats) == (beat.stats, [])   # the head keeps all of it (node/peer_stats.py)
        head.router.send(setup, peer)   # the same model again: ready at once, not loaded twice
        assert head.next(proto.DraftReady)[0].error == "" and len(loads) == 1
        head.router.send(proto.Shutdown(reason="done"), peer)
        thread.join(10)
        assert not thread.is_alive()
    finally:
        node.stop.set()


def test_in_memory_a_model_that_cannot_load_is_reported_and_the_drafter_stays_up(tmp_path):
    def loader(spec, quant):
        raise RuntimeError("no such model")

    net = MemoryNetwork()
    head = ScriptedHead(net)
    node, thread = _memory_drafter(head, net, tmp_path, loader)
    try:
        _, peer = head.welcome()
        head.router.send(proto.DraftSetup(model="missing", quant="none"), peer)
        ready, _ = head.next(proto.DraftReady)
        assert ready.error == "cannot load the draft model missing: RuntimeError: no such model"
        beat, _ = head.next(proto.Heartbeat)
        assert beat.stats["phase"] == ready.error and beat.stats["drafter"] is None
        assert thread.is_alive()
    finally:
        node.stop.set()
        thread.join(10)


# ---- a hostile drafter in a whole cluster on the in-memory link --------------------------------------
class HugeRowsDrafter(DrafterNode):
    """Answers every job with well-formed frames whose K/V rows are finite but huge (+-3e38): they passed
    the head's shape and finiteness checks, and node 0's attention over them drafted NaN scores."""

    def _to_head(self, msg: proto.Message) -> None:
        if isinstance(msg, proto.DraftAnswer):
            rows = torch.full_like(msg.rows, 3e38)
            rows[..., ::2] = -3e38
            msg = replace(msg, rows=rows)
        super()._to_head(msg)


def test_in_memory_a_drafter_answering_huge_rows_is_refused_and_every_request_answers(tiny_pair, references,
                                                                                       tmp_path):
    base, draft = tiny_pair
    net, nodes = MemoryNetwork(), []
    common = dict(head="127.0.0.1:5555", model=str(base), draft=str(draft), stages=2, insecure=True, threads=1,
                  wire_dtype="float32", stage_timeout_s=10.0, discovery=False, predraft="drafter",
                  strategy="flowspec")
    with flowedge_home(tmp_path):
        head = build_head(NodeConfig(role="head", node_id="head", **common), link=net.link())
        nodes = [head] + [build_stage(NodeConfig(role="stage", node_id=f"s{k}", same_host=True, **common),
                                      link=net.link()) for k in (1, 2)]
        nodes.append(HugeRowsDrafter(NodeConfig(role="drafter", node_id="d1", same_host=True, **common),
                                     NodeParts(net.link(), DropLog(logging.getLogger(__name__)), tmp_path)))
        threads = [threading.Thread(target=n.run, daemon=True) for n in nodes]
        for t in threads:
            t.start()
        try:
            deadline = time.monotonic() + 120
            while not (head.members.cluster_ready() and head.members.drafters()):
                assert time.monotonic() < deadline, "the cluster and its drafter did not get ready"
                time.sleep(0.1)
            for prompt in PROMPTS * 2:
                with Client(common["head"], link=net.link(), timeout_s=120) as c:
                    res = c.generate(prompt, max_new_tokens=MAX_NEW, strategy="flowspec")
                assert res["token_ids"] == references[prompt]
            jobs = head.drafts.counts
            assert jobs["rejected"] > 0 and jobs["answered"] == 0 and head.members.drafters(), jobs
            assert head.drops.snapshot().get("draft_answer") == jobs["rejected"]
        finally:
            for n in nodes:
                n.stop.set()
            for t in threads:
                t.join(15)
