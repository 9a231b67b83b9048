"""Requests at the context's edge: every strategy answers them, token-identical to plain greedy.

A draft tree sends rows past the committed prefix; near the end of the model's context (2,048 positions
on the tiny pair) those rows once overflowed a stage's KV cache, the stage dropped the segment and the
request waited forever. The head now sends no more rows in a round than the stages have room for, and a
stage that still gives up on a run says so, so that its request fails at once with the reason.

A whole cluster in this process on the memory link (the stages' real boundary checks included),
fp32 stages and wire, so answers are compared with transformers' own greedy decoding."""
from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

from flowedge.client.sync_client import Client, RequestFailed
from flowedge.core.config import STRATEGY_NAMES
from flowedge.core.sampling import SamplingParams
from flowedge.engine.local import generate_ar
from flowedge.node import stage_inbox
from flowedge.transport import protocol as p
from memory_cluster import HEAD, started

CONTEXT = 2048          # the tiny pair's max_position_embeddings
PROMPT_LENGTHS = (CONTEXT - 70, CONTEXT - 23, CONTEXT - 9, CONTEXT - 2)


def prompt_of(length: int) -> list[int]:
    """Byte tokens (no eos 256 / bos 257), a repeating text-like pattern so drafts are often accepted."""
    return [97 + (i * 7 + i // 5) % 26 for i in range(length)]


@pytest.fixture(scope="module")
def references(tiny_pair) -> dict[int, list[int]]:
    """Plain greedy to the context's end, once per prompt length (a shorter answer is its prefix)."""
    base, _ = tiny_pair
    return {n: generate_ar(base, prompt_of(n), CONTEXT - n, SamplingParams()).token_ids for n in PROMPT_LENGTHS}


@pytest.fixture(scope="module")
def cluster(tiny_pair, tmp_path_factory):
    with started(*tiny_pair, tmp_path_factory.mktemp("home")) as c:
        yield c


@settings(max_examples=16, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(length=st.sampled_from(PROMPT_LENGTHS), short_by=st.integers(0, 3), strategy=st.sampled_from(STRATEGY_NAMES))
def test_requests_at_the_context_edge_answer_as_plain_greedy(cluster, references, length, short_by, strategy):
    room = CONTEXT - length
    max_new = max(1, room - short_by * room // 4)   # up to the very last position, or a little short of it
    with Client(HEAD, link=cluster.net.link(), timeout_s=60) as client:
        res = client.generate(prompt_of(length), raw=True, max_new_tokens=max_new, strategy=strategy)
    assert res["token_ids"] == references[length][:max_new], (length, max_new, strategy)
    assert not cluster.errors, cluster.errors


def test_a_stage_that_gives_up_on_a_run_fails_its_request_at_once(cluster, references, monkeypatch):
    """A stage that frees a run (here: its KV bound cut to 20 entries) tells the head, and the request ends
    with the stage's reason instead of waiting for segments that never come."""
    monkeypatch.setattr(stage_inbox, "KV_ROOM_CONTEXTS", 20 / CONTEXT)
    with Client(HEAD, link=cluster.net.link(), timeout_s=20) as client:
        with pytest.raises(RequestFailed, match="gave up on it.*KV cache would pass 20"):
            client.generate(prompt_of(12), raw=True, max_new_tokens=30, strategy="flowspec")
    monkeypatch.undo()
    with Client(HEAD, link=cluster.net.link(), timeout_s=60) as client:   # and the cluster serves on
        n = PROMPT_LENGTHS[-1]
        assert client.generate(prompt_of(n), raw=True, max_new_tokens=2)["token_ids"] == references[n][:2]


def test_request_dropped_is_a_wire_message():
    msg = p.RequestDropped(run_id=7, reason="stage-1: its KV cache would pass the context of 16")
    assert p.decode(msg.to_frames()) == msg


def test_a_stop_string_ends_every_strategy_at_the_same_token(cluster):
    """With a stop string, strategies that accept several tokens at once once handed out (and counted)
    tokens past the stop that `ar-pp` never made: the text agreed, the token ids and usage did not."""
    with Client(HEAD, link=cluster.net.link(), timeout_s=60) as client:
        plain = client.generate("The quick brown fox", raw=True, max_new_tokens=40, strategy="ar-pp")
        stop = next(ch for ch in plain.text[2:] if ch.isascii() and ch.isprintable())   # a byte-level model's text
        answers = {s: client.generate("The quick brown fox", raw=True, max_new_tokens=40, strategy=s, stop=[stop])
                   for s in STRATEGY_NAMES}
    first = answers["ar-pp"]
    assert first.text == plain.text[:plain.text.find(stop)] and len(first.token_ids) < len(plain.token_ids)
    for strategy, answer in answers.items():
        assert (answer.text, list(answer.token_ids)) == (first.text, list(first.token_ids)), strategy
