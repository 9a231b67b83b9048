"""A whole cluster in one process on the in-memory link: a head and 2 stages (threads, built by the
composition roots exactly as the daemons are, tiny pair, fp32 stages and wire) and the clients (the sync
face, then the asyncio one). The answer
equals `generate --strategy ar`; then stage 2 is lost mid-answer (its link closed the moment the client
gets its first tokens) and a new stage joins: the request pauses, replays and completes token-identical,
with no error to the client."""
from __future__ import annotations

import asyncio
import shutil
import threading

import pytest

from cluster_helpers import flowedge_home
from memory_cluster import HEAD, MAX_NEW, PROMPT, Cluster, ask
from flowedge.client.async_client import AsyncClient
from flowedge.client.client_answer import Answer
from flowedge.generate import GenerateRequest, run_generate
from flowedge.transport import protocol as p
from flowedge.transport.async_link import MemoryAsyncLink
from flowedge.transport.link import Inbound, Kind
from flowedge.transport.memory_link import MemoryEndpoint, MemoryLink, MemoryNetwork



class Tripwire(MemoryEndpoint):
    """A client's DEALER that calls `trip` (once, in the sender's thread) when the first tokens reach it."""

    def __init__(self, net: MemoryNetwork, kind: Kind, address: str, trip) -> None:
        super().__init__(net, kind, address)
        self.trip = trip

    def _deliver(self, item) -> None:
        if isinstance(item, Inbound) and self.trip is not None:
            msg = p.decode(item.frames)
            if isinstance(msg, p.TokenChunk) and msg.token_ids and not msg.done:
                trip, self.trip = self.trip, None
                trip()
        super()._deliver(item)


class TrippingLink(MemoryLink):
    """A client's link whose DEALERs are tripwires."""

    def __init__(self, net: MemoryNetwork, trip) -> None:
        super().__init__(net)
        self.trip = trip

    def connect(self, kind: Kind, address: str) -> MemoryEndpoint:
        endpoint = Tripwire(self.net, kind, address, self.trip)
        with self.net.cond:
            self.net.dealers.append(endpoint)
        return self._keep(endpoint)


async def ask_async(net: MemoryNetwork) -> Answer:
    link = MemoryAsyncLink(net)
    try:
        async with AsyncClient(HEAD, link=link, timeout_s=300) as client:
            return await client.generate(PROMPT, max_new_tokens=MAX_NEW, strategy="flowspec")
    finally:
        link.close()


@pytest.fixture(scope="module")
def reference(tiny_pair):
    base, draft = tiny_pair
    return run_generate(GenerateRequest(PROMPT, str(base), str(draft), "ar", MAX_NEW, quant="none"))["token_ids"]


@pytest.fixture(params=["off", "idle"])   # and with pre-drafting in node 0's gaps (engine/predraft.py)
def cluster(tiny_pair, tmp_path, request):
    with flowedge_home(tmp_path):
        c = Cluster(*tiny_pair, predraft=request.param)
        try:
            c.wait_ready()
            yield c
        finally:
            c.stop()


def test_a_cluster_on_the_memory_link_answers_as_plain_greedy_and_rides_out_a_stage_loss(cluster, reference):
    def slots() -> list[str]:
        return [cluster.head.members.peers[i].name for i in cluster.head.members.stage_identities()]

    joined = slots()   # s1 and s2 race to join: either may hold stage 1
    first = ask(cluster.net.link())
    assert list(first.token_ids) == reference and first.stats.replays == 0
    assert len(reference) >= 20   # the comparison covers real decoding

    lost = threading.Event()

    def lose_stage_2() -> None:   # in the head's thread, as its first tokens of the answer leave it
        cluster.stages["s2"].link.close()
        lost.set()

    joiner = threading.Thread(target=lambda: lost.wait(300) and cluster.stages.update(s3=cluster.add_stage("s3")))
    joiner.start()
    second = ask(TrippingLink(cluster.net, lose_stage_2))
    joiner.join(10)
    assert lost.is_set(), "the loss never happened"
    assert list(second.token_ids) == reference
    assert second.stats.replays >= 1, second   # the loss landed mid-answer: the request was replayed
    cluster.threads["s2"].join(30)   # its run() notices the closed link on its own schedule
    assert "s2" in cluster.errors and not {"head", "s1", "s3"} & set(cluster.errors), cluster.errors
    assert slots() == ["s3" if name == "s2" else name for name in joined]   # s3 took the lost stage's place
    third = asyncio.run(ask_async(cluster.net))   # the asyncio face on the repaired cluster
    assert list(third.token_ids) == reference and third.stats.replays == 0


def test_pre_drafting_in_node_0s_gaps_answers_as_plain_greedy(tiny_pair, reference, tmp_path):
    """`predraft = "idle"` on the daemon: node 0 grows its draft tree between turns while segments are in
    flight (engine/predraft.py); answers stay token-identical, and the answer's stats say what it did."""
    with flowedge_home(tmp_path):
        c = Cluster(*tiny_pair, predraft="idle")
        try:
            c.wait_ready()
            answers = [ask(c.net.link()) for _ in range(2)]
        finally:
            c.stop()
    assert [list(a.token_ids) for a in answers] == [reference, reference]
    stats = answers[0].stats.figures["predraft"]
    # idle work reached the engine (on this tiny in-process cluster segments return faster than a draft call,
    # so most calls are rightly skipped: the gate's own tests are in test_engine_predraft.py)
    assert stats["jobs"] > 0 and stats["calls"] + stats["skipped_idle_calls"] > 0, str(stats)


def test_a_model_swapped_under_the_same_name_is_split_anew_and_answers_as_itself(tiny_pair, tmp_path):
    """One FLOWEDGE_HOME serves a/base, then b/base (other weights, same directory name), then new weights
    written over a/base: each cluster splits the model it was given and answers as that model's plain
    greedy, never from a split cached for the other one."""
    from flowedge.models.tiny import make_tiny_model

    draft = tiny_pair[1]
    a, b = tmp_path / "a" / "base", tmp_path / "b" / "base"
    answers, expected, splits = [], [], []
    for path, seed in ((a, 1), (b, 2), (a, 3)):
        shutil.rmtree(path, ignore_errors=True)
        make_tiny_model(path, seed=seed)
        request = GenerateRequest(PROMPT, str(path), str(draft), "ar", MAX_NEW, quant="none")
        expected.append(run_generate(request)["token_ids"])
        with flowedge_home(tmp_path / "home"):
            c = Cluster(path, draft)
            try:
                c.wait_ready()
                answers.append(ask(c.net.link(), strategy="ar-pp")["token_ids"])
                splits.append(c.head.members.plan.split_dir)
            finally:
                c.stop()
    assert len({tuple(e) for e in expected}) == 3   # three models that answer differently
    assert answers == expected
    assert len(set(splits)) == 3 and all(p.name.startswith("base-") for p in splits)   # a split each
