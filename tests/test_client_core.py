"""The client core driven by events: no socket, the time passed in."""
from __future__ import annotations

import pytest

from flowedge.client.client_core import (CONTROL, DEFAULT_MAX_NEW_TOKENS, HELLO_TIMEOUT_S, ClientCore, Done, Failed,
                                         Piece, Send, Status, Welcomed, prompt_request)
from flowedge.errors import ContextOverflow, FlowedgeError, HeadUnreachable, ProtocolError, RequestFailed
from flowedge.transport import protocol as proto

ADDR = "10.0.0.1:5555"


def welcomed(timeout_s: float = 300.0, head_timeout_s: float = 5.0) -> ClientCore:
    core = ClientCore(ADDR, timeout_s=timeout_s, head_timeout_s=head_timeout_s, node_id="client-test")
    core.hello(0.0)
    assert core.receive(proto.Welcome(node_id="head", heartbeat_interval_ms=500), 0.1) == [Welcomed()]
    return core


def opened(core: ClientCore, now: float, **kwargs) -> int:
    return core.start(core.request("hi", max_new_tokens=8, **kwargs), now).request_id


def chunk(rid: int, ids: list[int], text: str, done: bool = False, stats: dict | None = None) -> proto.TokenChunk:
    return proto.TokenChunk(request_id=rid, token_ids=ids, text=text, done=done, stats=stats)


# ---- handshake -------------------------------------------------------------------------------------
def test_hello_is_sent_once_and_welcome_admits():
    core = ClientCore(ADDR, node_id="client-7")
    hello = core.hello(0.0)
    assert isinstance(hello, proto.Hello) and hello.role == "client" and hello.node_id == "client-7"
    assert hello.capabilities == {"heartbeat": True}
    assert not core.welcomed
    assert core.receive(proto.Welcome(node_id="head", heartbeat_interval_ms=500), 0.5) == [Welcomed()]
    assert core.welcomed and core.next_deadline() is None


@pytest.mark.parametrize("reply, why", [
    (proto.Refuse(reason="a head is already connected"), "refused by peer: a head is already connected"),
    (proto.StatusReply(nodes=[]), "expected WELCOME after HELLO, got status"),
    (proto.Welcome(node_id="head", heartbeat_interval_ms=500, version=(99, 0)), "protocol 99"),
])
def test_a_bad_answer_to_hello_fails_the_handshake(reply, why):
    core = ClientCore(ADDR)
    core.hello(0.0)
    [event] = core.receive(reply, 0.1)
    assert isinstance(event, Failed) and event.request_id == CONTROL and isinstance(event.error, HeadUnreachable)
    assert str(event.error).startswith(f"cannot reach a flowedge head at {ADDR}: ") and why in str(event.error)
    assert not core.welcomed and core.next_deadline() is None


def test_a_silent_head_fails_hello_after_the_short_hello_timeout():
    core = ClientCore(ADDR, timeout_s=300.0)
    core.hello(10.0)
    assert core.next_deadline() == 10.0 + HELLO_TIMEOUT_S
    assert core.expire(10.0 + HELLO_TIMEOUT_S - 0.01) == []
    [event] = core.expire(10.0 + HELLO_TIMEOUT_S)
    assert event.request_id == CONTROL and isinstance(event.error, HeadUnreachable)
    assert "cannot reach a flowedge head" in str(event.error)
    short = ClientCore(ADDR, timeout_s=0.5)
    short.hello(0.0)
    assert short.next_deadline() == 0.5   # a client's own shorter timeout wins


# ---- requests ------------------------------------------------------------------------------------
def test_chunks_become_pieces_then_done_with_the_typed_answer():
    core = welcomed()
    rid = opened(core, 1.0)
    assert core.receive(chunk(rid, [5], "Hel"), 1.5) == [Piece(rid, "Hel", (5,))]
    assert core.receive(chunk(rid, [6], ""), 1.7) == [Piece(rid, "", (6,))]   # tokens without text yet
    stats = {"finish_reason": "length", "prompt_tokens": 9, "strategy": "flowspec", "mean_accept_len": 2.5,
             "tree_depth": 4}
    events = core.receive(chunk(rid, [7, 8], "lo", done=True, stats=stats), 3.0)
    assert events[0] == Piece(rid, "lo", (7, 8))
    assert isinstance(events[1], Done) and events[1].request_id == rid
    answer = events[1].answer
    assert answer.text == "Hello" and answer.token_ids == (5, 6, 7, 8) and answer.finish_reason == "length"
    assert (answer.usage.prompt_tokens, answer.usage.completion_tokens, answer.usage.total_tokens) == (9, 4, 13)
    assert answer.stats.strategy == "flowspec" and answer.stats.mean_accept_len == 2.5
    assert answer.stats.figures["tree_depth"] == 4
    assert answer.client_wall_s == 2.0 and answer.first_token_s == 0.5 and answer.wall_tokens_per_s == 2.0
    assert rid not in core.open and core.cancel(rid) is None   # finished: nothing left to cancel


def test_an_answer_still_reads_as_the_dict_it_was():
    core = welcomed()
    rid = opened(core, 1.0)
    [_, done] = core.receive(chunk(rid, [5, 6], "Hi", done=True, stats={"new_tokens": 2, "auto": {"a": 1}}), 2.0)
    answer = done.answer
    assert answer.to_dict() == {"new_tokens": 2, "auto": {"a": 1}, "text": "Hi", "token_ids": [5, 6],
                                "client_wall_s": 1.0, "wall_tokens_per_s": 2.0, "first_token_s": 1.0}
    assert answer["token_ids"] == [5, 6] and answer.get("auto") == {"a": 1} and answer.get("nope", 3) == 3
    assert answer.finish_reason == "stop" and answer.stats.strategy == ""   # a head that sent neither


def test_the_heads_error_reply_is_typed():
    core = welcomed()
    rid = opened(core, 0.0)
    [event] = core.receive(proto.ErrorReply(request_id=rid, message="context overflow: 70 > 64"), 0.1)
    assert isinstance(event.error, ContextOverflow) and rid not in core.open
    rid = opened(core, 0.2)
    [event] = core.receive(proto.ErrorReply(request_id=rid, message="cluster not ready"), 0.3)
    assert type(event.error) is RequestFailed and str(event.error) == "cluster not ready"


def test_several_requests_are_kept_apart_and_late_replies_dropped():
    core = welcomed()
    a, b = opened(core, 0.0), opened(core, 0.0)
    assert a != b and CONTROL not in (a, b)
    assert core.receive(chunk(b, [1], "b"), 0.1) == [Piece(b, "b", (1,))]
    assert core.receive(chunk(a, [2], "a"), 0.2) == [Piece(a, "a", (2,))]
    assert core.cancel(a) == proto.Cancel(request_id=a)
    assert core.cancel(a) is None
    assert core.receive(chunk(a, [3], "late", done=True), 0.3) == []   # abandoned: dropped
    assert core.receive(chunk(99, [3], "never asked", done=True), 0.3) == []
    assert [type(e) for e in core.receive(chunk(b, [4], "", done=True), 0.4)] == [Piece, Done]
    assert core.receive(chunk(b, [], "", done=True), 0.5) == []   # b is finished too


def test_heartbeats_are_answered_only_while_a_request_is_open():
    core = welcomed()
    beat = proto.Heartbeat(node_id="head", load=0.5, rss_bytes=1)
    assert core.receive(beat, 0.2) == []
    opened(core, 0.3)
    [send] = core.receive(beat, 0.4)
    assert isinstance(send, Send) and isinstance(send.msg, proto.Heartbeat) and send.msg.node_id == core.node_id


def test_a_silent_head_fails_the_open_request_after_head_timeout():
    core = welcomed(head_timeout_s=5.0)
    rid = opened(core, 10.0)
    assert core.next_deadline() == 15.0
    core.receive(proto.Heartbeat(node_id="head", load=0.0, rss_bytes=0), 13.0)   # the head is alive
    assert core.next_deadline() == 18.0 and core.expire(17.9) == []
    [event] = core.expire(18.0)
    assert event.request_id == rid and "went silent for 5.0 s" in str(event.error)
    assert core.open == {} and core.next_deadline() is None


def test_timeout_s_bounds_the_wait_for_an_answer_even_with_heartbeats():
    core = welcomed(timeout_s=4.0, head_timeout_s=5.0)
    rid = opened(core, 0.0)
    for t in (1.0, 2.0, 3.0):
        core.receive(proto.Heartbeat(node_id="head", load=0.0, rss_bytes=0), t)
    assert core.next_deadline() == 4.0
    [event] = core.expire(4.0)
    assert event.request_id == rid and "gave no answer for 4 s" in str(event.error)


def test_a_lost_connection_fails_every_waiter_but_not_before_the_handshake():
    core = ClientCore(ADDR)
    core.hello(0.0)
    assert core.lost_connection(0.1) == []   # zmq retries a connect by itself
    core.receive(proto.Welcome(node_id="head", heartbeat_interval_ms=500), 0.2)
    a, b = opened(core, 1.0), opened(core, 1.0)
    events = core.lost_connection(2.0)
    assert {e.request_id for e in events} == {a, b}
    assert all("lost the connection to the head" in str(e.error) for e in events)
    assert not core.welcomed and core.open == {}


def test_a_malformed_frame_fails_every_waiter():
    core = welcomed()
    rid = opened(core, 0.0)
    core.status(0.0)
    events = core.malformed(ProtocolError("unknown message type 'x'"), 0.5)
    assert {e.request_id for e in events} == {rid, CONTROL}
    assert all(isinstance(e.error, ProtocolError) for e in events)


# ---- status --------------------------------------------------------------------------------------
def test_status_waits_for_the_status_reply():
    core = welcomed(timeout_s=3.0)
    assert core.status(1.0) == proto.StatusRequest()
    assert core.next_deadline() == 4.0
    assert core.receive(proto.Welcome(node_id="head", heartbeat_interval_ms=500), 1.1) == []
    nodes = [{"node_id": "head", "ready": True}]
    assert core.receive(proto.StatusReply(nodes=nodes), 1.2) == [Status(nodes)]
    assert core.receive(proto.StatusReply(nodes=nodes), 1.3) == []   # nobody asked
    core.status(5.0)
    [event] = core.expire(8.0)
    assert event.request_id == CONTROL and "gave no answer for 3 s" in str(event.error)


# ---- the request message -------------------------------------------------------------------------
def test_prompt_request_builds_the_message_and_refuses_what_cannot_be_sent():
    req = prompt_request(3, "hi", system="be brief", stop="\n", top_k=0, top_p=1.0)
    assert req.request_id == 3 and req.text is None and req.stop == ["\n"]
    assert req.messages == [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]
    assert req.top_k is None and req.top_p is None
    assert prompt_request(1, [1, 2, 3]).token_ids == (1, 2, 3)
    for bad in (dict(prompt=None), dict(prompt="x", messages=[{"role": "user", "content": "y"}]),
                dict(prompt="x", raw=True, system="s"), dict(prompt=[1, 2], system="s")):
        with pytest.raises(FlowedgeError):
            prompt_request(1, bad.pop("prompt"), **bad)
    with pytest.raises(ProtocolError):
        prompt_request(1, "x", max_new_tokens=-1)


def test_max_tokens_is_max_new_tokens_by_its_openai_name():
    assert prompt_request(1, "x").max_new_tokens == DEFAULT_MAX_NEW_TOKENS
    assert prompt_request(1, "x", max_tokens=9).max_new_tokens == 9
    assert prompt_request(1, "x", max_new_tokens=9).max_new_tokens == 9
    assert prompt_request(1, "x", max_new_tokens=9, max_tokens=9).max_new_tokens == 9   # agreeing: fine
    with pytest.raises(FlowedgeError, match="max_tokens=8 and max_new_tokens=9 disagree"):
        prompt_request(1, "x", max_new_tokens=9, max_tokens=8)


def test_messages_may_be_any_sequence_of_mappings():
    turns = ({"role": "user", "content": "hi"},)
    assert prompt_request(1, None, messages=turns).messages == [{"role": "user", "content": "hi"}]
    assert prompt_request(1, None, messages=[], system="s").messages == [{"role": "system", "content": "s"}]


def test_request_ids_count_up_and_an_open_id_cannot_be_reused():
    core = welcomed()
    first, second = core.request("a"), core.request("b")
    assert (first.request_id, second.request_id) == (1, 2)
    core.start(first, 0.0)
    with pytest.raises(FlowedgeError, match="already in use"):
        core.start(first, 0.1)
