"""Both client faces (`Client`, `AsyncClient`) against a head played by the test on the in-memory link:
typed answers and chunks, the keyword arguments each method names, `max_tokens` as an alias."""
from __future__ import annotations

import asyncio
import inspect
import json
import threading
import time
from collections.abc import Callable

import pytest

from cluster_helpers import ScriptedHead
from flowedge import Answer, AsyncClient, Chunk, Client, FlowedgeError
from flowedge.client.client_core import prompt_request
from flowedge.transport import protocol as proto
from flowedge.transport.async_link import MemoryAsyncLink
from flowedge.transport.link import Inbound
from flowedge.transport.memory_link import MemoryNetwork

STATS = {"prompt_tokens": 3, "new_tokens": 3, "finish_reason": "length", "strategy": "flowspec", "steps": 2,
         "mean_accept_len": 1.5, "wall_s": 0.2, "tokens_per_s": 15.0, "replays": 0, "tree_depth": 4}
Replies = Callable[[proto.PromptRequest], list[proto.TokenChunk]]


def hello_answer(req: proto.PromptRequest) -> list[proto.TokenChunk]:
    """'Hello' in three chunks, the middle one tokens without text; `req.max_new_tokens` tokens in all."""
    ids = list(range(10, 10 + req.max_new_tokens))
    return [proto.TokenChunk(request_id=req.request_id, token_ids=ids[:1], text="Hel", done=False),
            proto.TokenChunk(request_id=req.request_id, token_ids=ids[1:2], text="", done=False),
            proto.TokenChunk(request_id=req.request_id, token_ids=ids[2:], text="lo", done=True,
                             stats={**STATS, "new_tokens": len(ids)})]


def first_chunk_only(req: proto.PromptRequest) -> list[proto.TokenChunk]:
    return hello_answer(req)[:1]


class Head(threading.Thread):
    """WELCOMEs every client and answers each PromptRequest with `replies(request)`; keeps what it got."""

    def __init__(self, net: MemoryNetwork, replies: Replies = hello_answer) -> None:
        super().__init__(daemon=True)
        self.scripted, self.replies = ScriptedHead(net), replies
        self.got: list[proto.Message] = []
        self.done = threading.Event()

    @property
    def addr(self) -> str:
        return self.scripted.addr

    def run(self) -> None:
        router = self.scripted.router
        while not self.done.is_set():
            got = router.receive(0.02)
            if not isinstance(got, Inbound):
                continue
            msg = proto.decode(got.frames)
            self.got.append(msg)
            if isinstance(msg, proto.Hello):
                router.send(proto.Welcome(node_id="head", heartbeat_interval_ms=500), got.peer)
            elif isinstance(msg, proto.PromptRequest):
                for reply in self.replies(msg):
                    router.send(reply, got.peer)

    def seen(self, kind: type, timeout_s: float = 5.0) -> list[proto.Message]:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline and not any(isinstance(m, kind) for m in self.got):
            time.sleep(0.01)
        return [m for m in self.got if isinstance(m, kind)]


@pytest.fixture
def net():
    return MemoryNetwork()


@pytest.fixture
def head(net):
    h = Head(net)
    h.start()
    yield h
    h.done.set()
    h.join(5)


def _check_answer(answer: Answer | None) -> None:
    assert isinstance(answer, Answer)
    assert answer.text == "Hello" and answer.token_ids == (10, 11, 12) and answer.finish_reason == "length"
    assert answer.usage.prompt_tokens == 3 and answer.usage.completion_tokens == 3
    assert answer.stats.strategy == "flowspec" and answer.stats.mean_accept_len == 1.5
    assert answer.stats.figures["tree_depth"] == 4 and answer.client_wall_s >= 0.0
    assert answer["token_ids"] == [10, 11, 12]   # the dict of before, key by key


# ---- Client --------------------------------------------------------------------------------------
def test_chunks_carry_text_and_token_ids_and_the_last_one_the_answer(net, head):
    with Client(head.addr, link=net.link(), timeout_s=10) as client:
        chunks = list(client.chunks("hi", max_tokens=3))
    assert [(c.text, c.token_ids) for c in chunks[:-1]] == [("Hel", (10,)), ("", (11,)), ("lo", (12,))]
    assert all(isinstance(c, Chunk) and not c.done for c in chunks[:-1]) and chunks[-1].done
    _check_answer(chunks[-1].answer)
    assert chunks[-1].answer == client.last_result
    assert head.seen(proto.PromptRequest)[0].max_new_tokens == 3


def test_stream_yields_text_and_generate_returns_the_answer(net, head):
    with Client(head.addr, link=net.link(), timeout_s=10) as client:
        assert list(client.stream("hi", max_new_tokens=3)) == ["Hel", "lo"]   # no empty pieces
        _check_answer(client.last_result)
        _check_answer(client.generate("hi", max_tokens=3, max_new_tokens=3))


def test_max_tokens_disagreeing_is_refused_before_the_head_hears_of_it(net, head):
    with Client(head.addr, link=net.link(), timeout_s=10) as client:
        for call in (client.stream, client.chunks, client.generate):
            with pytest.raises(FlowedgeError, match="disagree"):
                call("hi", max_new_tokens=4, max_tokens=5)
    assert head.seen(proto.PromptRequest, timeout_s=0.2) == []


def test_leaving_a_stream_early_cancels_the_request(net):
    head = Head(net, first_chunk_only)
    head.start()
    try:
        with Client(head.addr, link=net.link(), timeout_s=10) as client:
            stream = client.stream("hi", max_tokens=3)
            assert next(stream) == "Hel"
            stream.close()
            [req] = head.seen(proto.PromptRequest)
            assert head.seen(proto.Cancel) == [proto.Cancel(request_id=req.request_id)]
            assert client.last_result is None
    finally:
        head.done.set()
        head.join(5)


# ---- AsyncClient -----------------------------------------------------------------------------------
def test_the_async_client_gives_the_same_typed_answers(net, head):
    async def run() -> tuple[list[str], Answer, list[list[Chunk]]]:
        link = MemoryAsyncLink(net)
        try:
            async with AsyncClient(head.addr, link=link, timeout_s=10) as client:
                pieces = [p async for p in client.stream("hi", max_tokens=3)]
                answer = await client.generate(messages=[{"role": "user", "content": "hi"}], max_new_tokens=3)

                async def collect() -> list[Chunk]:
                    return [c async for c in client.chunks("hi", max_tokens=3)]

                both = await asyncio.gather(collect(), collect())   # each stream ends with its own answer
                return pieces, answer, list(both)
        finally:
            link.close()

    pieces, answer, both = asyncio.run(run())
    assert pieces == ["Hel", "lo"]
    _check_answer(answer)
    for chunks in both:
        assert [c.text for c in chunks] == ["Hel", "", "lo", ""]
        _check_answer(chunks[-1].answer)
    assert len({id(chunks[-1].answer) for chunks in both}) == 2


# ---- the keyword arguments -----------------------------------------------------------------------
REQUEST_METHODS = [Client.chunks, Client.stream, Client.generate,
                   AsyncClient.chunks, AsyncClient.stream, AsyncClient.generate]


@pytest.mark.parametrize("method", REQUEST_METHODS, ids=lambda m: m.__qualname__)
def test_every_request_method_names_its_arguments(method):
    """Before: `AsyncClient.stream(prompt, **kwargs)` hid them from help(), an IDE and mypy."""
    params = inspect.signature(method).parameters
    assert not any(p.kind is p.VAR_KEYWORD or p.kind is p.VAR_POSITIONAL for p in params.values())
    # client: set per connection
    want = [n for n in inspect.signature(prompt_request).parameters if n not in ("rid", "client")]
    assert list(params)[1:] == want   # self, then prompt_request's: one list for every method
    assert {"max_new_tokens", "max_tokens", "temperature", "top_p", "seed", "stop", "strategy"} <= set(params)


# ---- the CLI's readers of an answer -----------------------------------------------------------------
@pytest.fixture
def memory_clients(net, monkeypatch):
    """`flowedge prompt` and `up --prompt` build a Client by address: here it is one on the memory link."""
    import flowedge.client.sync_client as client_module

    class MemoryClient(Client):
        def __init__(self, addr: str, **kwargs) -> None:
            kwargs.pop("keys_dir", None)
            kwargs.pop("insecure", None)
            super().__init__(addr, link=net.link(), **kwargs)

    monkeypatch.setattr(client_module, "Client", MemoryClient)


def test_flowedge_prompt_prints_the_answer_its_summary_and_its_json(head, memory_clients):
    from click.testing import CliRunner

    from flowedge.launch.cluster_commands import prompt

    shown = CliRunner().invoke(prompt, ["hi", "--head", head.addr, "--max-new-tokens", "3"])
    assert shown.exit_code == 0, shown.output
    assert shown.stdout == "Hello\n" and shown.stderr.startswith("[3 tokens, first token after ")
    assert shown.stderr.rstrip().endswith(" tok/s]")
    as_json = CliRunner().invoke(prompt, ["hi", "--head", head.addr, "--max-new-tokens", "3", "--json"])
    assert as_json.exit_code == 0, as_json.output
    out = json.loads(as_json.stdout)
    assert out["text"] == "Hello" and out["token_ids"] == [10, 11, 12] and out["tree_depth"] == 4


def test_up_prompt_ends_with_the_summary_line(head, memory_clients, capsys):
    from types import SimpleNamespace

    from flowedge.launch.cluster_commands import _answer_once

    _answer_once(SimpleNamespace(addr=head.addr, insecure=True, nodes=3), "hi", 3)
    out, err = capsys.readouterr()
    assert out == "Hello\n" and err.startswith("[3 tokens in ") and err.rstrip().endswith(
        "tok/s, strategy flowspec, 3 nodes]"), err
