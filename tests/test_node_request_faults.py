"""A bug met while serving one request fails that request and nothing else: the head keeps serving.

A whole cluster in this process on the memory link (as in test_node_in_memory.py), with one
strategy's handler or one outgoing send made to raise."""
from __future__ import annotations

import pytest

from flowedge.client.sync_client import Client, RequestFailed
from flowedge.engine.strategies.ar_pp import ArPP
from memory_cluster import HEAD, MAX_NEW, PROMPT, ask, started
from test_node_in_memory import reference  # noqa: F401 - a fixture


@pytest.fixture(scope="module")
def cluster(tiny_pair, tmp_path_factory):
    with started(*tiny_pair, tmp_path_factory.mktemp("home")) as c:
        yield c


def _still_serving(cluster, reference) -> None:
    assert not cluster.errors, cluster.errors
    assert cluster.threads["head"].is_alive()
    assert ask(cluster.net.link())["token_ids"] == reference


def test_a_strategy_handler_that_raises_fails_its_request_and_the_head_serves_on(cluster, reference,
                                                                                 monkeypatch):
    def broken(self, view, live_nodes):
        raise RuntimeError("injected fault in a strategy's handler")

    monkeypatch.setattr(ArPP, "on_output", broken)
    with Client(HEAD, link=cluster.net.link(), timeout_s=60) as client:
        with pytest.raises(RequestFailed, match="injected fault"):
            client.generate(PROMPT, max_new_tokens=MAX_NEW, strategy="ar-pp")
    monkeypatch.undo()
    _still_serving(cluster, reference)


def test_a_send_that_raises_fails_its_request_and_the_head_serves_on(cluster, reference, monkeypatch):
    """The driver's side of an action (here the outbox's send to stage 1) raising, as the wire's own
    validation did for a segment phase it did not know."""
    def broken(action) -> None:
        raise ValueError("injected fault on the way to stage 1")

    monkeypatch.setattr(cluster.head.requests.out, "to_stages", broken)
    with Client(HEAD, link=cluster.net.link(), timeout_s=60) as client:
        with pytest.raises(RequestFailed, match="internal error: ValueError: injected fault"):
            client.generate(PROMPT, max_new_tokens=MAX_NEW, strategy="flowspec")
    monkeypatch.undo()
    _still_serving(cluster, reference)
