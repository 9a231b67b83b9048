"""The head's fair queue end to end, on an in-process cluster (the memory link, tiny pair; see
test_node_in_memory.py): one client floods the head, over ZeroMQ and over the HTTP API, and another
client's short request is answered about as soon as a slot frees, not after the flood's whole queue;
the flood past its cap is told "busy" (ZeroMQ: an error reply; HTTP: 429 with Retry-After). The fair
queue's own rules are tested without a cluster in test_engine_fair_queue.py."""
from __future__ import annotations

import asyncio
import statistics
import time

import httpx
import pytest

from cluster_helpers import flowedge_home
from flowedge.api.app import create_app
from flowedge.api.clients import key_client
from flowedge.api.settings import ApiSettings
from flowedge.client.async_client import AsyncClient
from flowedge.errors import Busy, ConfigError
from flowedge.launch.status_view import render
from flowedge.node.node_config import NodeConfig
from flowedge.transport.async_link import MemoryAsyncLink
from test_node_in_memory import HEAD, PROMPT, Cluster

RUNNING, CAP = 2, 8          # the head's max_concurrent and max_queued_per_client
FLOOD_TOKENS, POLITE_TOKENS = 64, 8
KEY_FLOOD, KEY_POLITE = "flood-key-0123456789", "polite-key-0123456789"


@pytest.fixture(scope="module")
def cluster(tiny_pair, tmp_path_factory):
    with flowedge_home(tmp_path_factory.mktemp("home")):
        c = Cluster(*tiny_pair, max_concurrent=RUNNING, max_queued_per_client=CAP,
                    client_weights={key_client(KEY_FLOOD): 0.5})
        try:
            c.wait_ready()
            yield c
        finally:
            c.stop()


async def _timed(coro) -> tuple[object, float, float]:
    """What `coro` returns (or raises), and when it started and ended."""
    t0 = time.monotonic()
    try:
        got = await coro
    except Exception as err:  # noqa: BLE001 - the test sorts them
        got = err
    return got, t0, time.monotonic()


async def _refused_then_first_answer(tasks: list, refused: int, is_refusal) -> float:
    """Wait until `refused` of the flood's `_timed` tasks were refused (the head has read the whole flood),
    then until one is answered; returns how long that one took."""
    while sum(t.done() and is_refusal(t.result()[0]) for t in tasks) < refused:
        await asyncio.sleep(0.01)
    while True:
        answered = [t.result() for t in tasks if t.done() and not is_refusal(t.result()[0])]
        if answered:
            return answered[0][2] - answered[0][1]
        await asyncio.sleep(0.01)


async def _flood_over_zmq(net) -> dict:
    """Idle figures first; then 60 requests on one connection, and one on another connection half-way through
    the flood's first answers (any time is fair game: half-way makes the bound a measurement, not a race)."""
    links = [MemoryAsyncLink(net), MemoryAsyncLink(net)]
    try:
        async with AsyncClient(HEAD, link=links[0], timeout_s=120) as flood, \
                AsyncClient(HEAD, link=links[1], timeout_s=120) as polite:
            idle = []
            for _ in range(3):
                answer, t0, t1 = await _timed(polite.generate(PROMPT, max_new_tokens=POLITE_TOKENS))
                idle.append(t1 - t0)
            tasks = [asyncio.create_task(_timed(flood.generate(PROMPT, max_new_tokens=FLOOD_TOKENS)))
                     for _ in range(60)]
            first_s = await _refused_then_first_answer(tasks, 60 - RUNNING - CAP, lambda r: isinstance(r, Exception))
            during = await polite.status()
            await asyncio.sleep(first_s / 2)
            answer, t0, t1 = await _timed(polite.generate(PROMPT, max_new_tokens=POLITE_TOKENS))
            return {"idle_s": statistics.median(idle), "polite": answer, "polite_s": t1 - t0, "polite_end": t1,
                    "flood": await asyncio.gather(*tasks), "during": during, "after": await polite.status()}
    finally:
        for link in links:
            link.close()


def test_a_zmq_flood_is_capped_and_another_client_is_answered_at_the_next_free_slot(cluster):
    got = asyncio.run(_flood_over_zmq(cluster.net))
    answered = [(a, t1) for a, _, t1 in got["flood"] if not isinstance(a, Exception)]
    refused = [a for a, _, _ in got["flood"] if isinstance(a, Exception)]
    assert all(isinstance(e, Busy) and "this client's queue is full" in str(e) for e in refused), refused[:3]
    assert len(answered) >= CAP and len(refused) >= 60 - 2 * (RUNNING + CAP), (len(answered), len(refused))
    assert len(got["polite"].token_ids) == POLITE_TOKENS
    running_s = max(a.stats.wall_s for a, _ in answered)   # one flood request's time from its start to its end
    assert got["polite_s"] <= 2 * got["idle_s"] + running_s, (got["polite_s"], got["idle_s"], running_s)
    # first come, first served would have run it after the flood's whole queue, with at most one of the
    # flood still running; here it went at the next free slot: the rest of the flood ends after it
    assert sum(t1 > got["polite_end"] for _, t1 in answered) >= 3
    (flood_row,) = [r for r in got["during"][0]["clients"] if r["queued"] + r["running"]]
    assert flood_row["client"].startswith("zmq:") and flood_row["queued"] >= 1
    line = next(x for x in render(got["after"]).splitlines() if x.startswith(flood_row["client"][:40]))
    assert line.split()[-1] == str(len(refused))   # `flowedge status`: the flood's refusals, by client


async def _flood_over_http(net) -> dict:
    settings = ApiSettings(head=HEAD, api_keys=(KEY_FLOOD, KEY_POLITE), requests_per_s_per_address=0,
                           insecure=True, request_timeout_s=120)
    app = create_app(settings)
    app.state.routes._link = MemoryAsyncLink(net)   # the app's one link to the head: the in-process cluster's
    body = {"messages": [{"role": "user", "content": PROMPT}], "temperature": 0}
    try:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://api", timeout=120) as web:
            def ask(key: str, tokens: int):
                return _timed(web.post("/v1/chat/completions", json=body | {"max_tokens": tokens},
                                       headers={"Authorization": f"Bearer {key}"}))

            tasks = [asyncio.create_task(ask(KEY_FLOOD, FLOOD_TOKENS)) for _ in range(3 * CAP)]
            first_s = await _refused_then_first_answer(tasks, 2 * CAP - RUNNING, lambda r: r.status_code == 429)
            async with AsyncClient(HEAD, link=app.state.routes._link) as watcher:
                during = await watcher.status()
            await asyncio.sleep(first_s / 2)
            polite, _, polite_end = await ask(KEY_POLITE, POLITE_TOKENS)
            status = await web.get("/v1/status", headers={"Authorization": f"Bearer {KEY_POLITE}"})
            return {"polite": polite, "polite_end": polite_end, "flood": await asyncio.gather(*tasks),
                    "during": during, "status": status}
    finally:
        app.state.routes.close_link()


def test_an_http_flood_gets_429_past_its_key_s_cap_and_another_key_is_served_first(cluster):
    got = asyncio.run(_flood_over_http(cluster.net))
    statuses = sorted(r.status_code for r, _, _ in got["flood"])
    assert set(statuses) == {200, 429} and statuses.count(429) >= CAP - RUNNING, statuses
    busy = next(r for r, _, _ in got["flood"] if r.status_code == 429)
    err = busy.json()["error"]
    assert err["type"] == "rate_limit_error" and err["code"] == "queue_full" and "queue is full" in err["message"]
    assert int(busy.headers["retry-after"]) >= 1
    assert got["polite"].status_code == 200 and got["polite"].json()["usage"]["completion_tokens"] == POLITE_TOKENS
    ends = [t1 for r, _, t1 in got["flood"] if r.status_code == 200]
    assert sum(t1 > got["polite_end"] for t1 in ends) >= 3   # as over ZeroMQ
    (flood_row,) = [r for r in got["during"][0]["clients"] if r["queued"] + r["running"]]
    assert flood_row["client"] == key_client(KEY_FLOOD) and KEY_FLOOD not in str(got["during"])   # named, not quoted
    rows = {r["client"]: r for r in got["status"].json()["nodes"][0]["clients"]}
    assert rows[key_client(KEY_FLOOD)]["refused"] == statuses.count(429)
    assert flood_row["weight"] == 0.5   # the head's client_weights, by the key's name


def test_the_fair_queue_settings_are_checked():
    assert NodeConfig(client_weights={"http:key-0123456789ab": 4, "batch": 0.5}).max_queued_per_client == 32
    for bad in ({"x": 0}, {"x": "2"}, {"x": float("nan")}, {"x": 1001}, ["x"]):
        with pytest.raises(ConfigError, match="client_weights"):
            NodeConfig(client_weights=bad)
    with pytest.raises(ConfigError, match="max_queued_per_client"):
        NodeConfig(max_queued_per_client=-1)
