"""The request log a standby follows (node/replication.py): the head's tap sends every committed token to
the standbys before the client sees it, the standby's log rebuilds each request from the entries (a gap
makes it unresumable, a failure forgets it, a full answer is kept), and a resumed request continues after
the longer of the log's and the client's tokens (or ends with an error naming the failover)."""
from __future__ import annotations

from dataclasses import dataclass, field

from flowedge.node.replication import ReplicatingOut, Replicator, RequestLog, _committed
from flowedge.transport import protocol as p


class FakePort:
    def __init__(self) -> None:
        self.term, self.sent = 2, []

    def send(self, identity: bytes, msg: p.Message) -> None:
        self.sent.append((identity, msg))


@dataclass
class FakePeer:
    hello: p.Hello
    identity: bytes = b""

    @property
    def name(self) -> str:
        return self.hello.node_id


@dataclass
class FakeMembers:
    peers: dict = field(default_factory=dict)
    slots: list = field(default_factory=list)

    def cluster_ready(self) -> bool:
        return True


def _hello(name: str, role: str = "client") -> p.Hello:
    return p.Hello(node_id=name, role=role, device="x", free_memory_bytes=0)


def _replicator() -> tuple[Replicator, FakePort, FakeMembers]:
    port, members = FakePort(), FakeMembers()
    members.peers = {b"c": FakePeer(_hello("client-1"), b"c"), b"s": FakePeer(_hello("sb", "standby"), b"s")}
    rep = Replicator(port, members, "head", 0.1)
    rep.joined(b"s", _hello("sb", "standby"))
    return rep, port, members


class Inner:
    def __init__(self, port: FakePort) -> None:
        self.port = port

    def to_client(self, identity: bytes, msg: p.Message) -> None:
        self.port.send(identity, msg)


def test_every_committed_token_goes_to_the_standby_before_the_client():
    rep, port, _ = _replicator()
    out = ReplicatingOut(Inner(port), rep)
    out.to_client(b"c", p.TokenChunk(request_id=7, token_ids=[1, 2], text="ab", done=False))
    out.to_client(b"c", p.TokenChunk(request_id=7, token_ids=[3], text="c", done=False))
    out.to_client(b"c", p.TokenChunk(request_id=7, token_ids=[], text="", done=True, stats={}))
    to = [(who, type(m).__name__) for who, m in port.sent]
    assert to == [(b"s", "LogEntry"), (b"c", "TokenChunk")] * 3
    entries = [m for who, m in port.sent if who == b"s"]
    assert [(e.client, e.request_id, e.start, e.tokens, e.done, e.term) for e in entries] == [
        ("client-1", 7, 0, (1, 2), False, 2), ("client-1", 7, 2, (3,), False, 2), ("client-1", 7, 3, (), True, 2)]
    assert rep.committed == {}


def test_a_standby_that_joins_late_gets_the_log_so_far():
    rep, port, members = _replicator()
    rep.tap(b"c", p.TokenChunk(request_id=1, token_ids=[4, 5], text="", done=False))
    members.peers[b"t"] = FakePeer(_hello("sb2", "standby"), b"t")
    rep.joined(b"t", _hello("sb2", "standby"))
    late = [m for who, m in port.sent if who == b"t"]
    assert [(m.request_id, m.tokens) for m in late] == [(1, (4, 5))]


def test_the_log_rebuilds_requests_and_forgets_failed_ones():
    log = RequestLog()
    log.apply(p.LogEntry(term=1, client="a", request_id=1, start=0, tokens=(1, 2)))
    log.apply(p.LogEntry(term=1, client="a", request_id=1, start=2, tokens=(3,)))
    log.apply(p.LogEntry(term=1, client="b", request_id=1, start=0, tokens=(9,)))
    assert log.committed("a", 1) == [1, 2, 3] and log.committed("b", 1) == [9]
    log.apply(p.LogEntry(term=1, client="a", request_id=1, start=3, done=True))
    assert log.committed("a", 1) == [1, 2, 3] and ("a", 1) in log.done and log.live() == 1
    log.apply(p.LogEntry(term=1, client="b", request_id=1, start=1, failed=True))
    assert log.committed("b", 1) is None
    log.apply(p.LogEntry(term=1, client="c", request_id=2, start=5, tokens=(1,)))   # entries 0..4 never came
    assert log.committed("c", 2) is None


def test_resumed_tokens_are_the_longer_agreeing_account():
    assert _committed([1, 2, 3], [1, 2], 2) == [1, 2, 3]      # a token was lost on the way to the client
    assert _committed([1, 2], [1, 2, 3], 3) == [1, 2, 3]      # ... or on the way to the standby
    assert _committed(None, [1, 2], 2) == [1, 2]
    assert _committed(None, [], 0) == []                      # queued only: starts afresh
    assert _committed([1, 2], [1, 5], 2) is None              # they disagree: not resumable
    assert _committed(None, [], 3) is None                    # nobody has the tokens the client counts


class LetterTokenizer:
    """Token id n is the letter chr(n); enough for the head's text stream."""

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return "".join(chr(i) for i in ids)


def test_a_finished_answer_whose_end_the_client_missed_is_sent_with_its_text():
    """The old head logged the whole answer, then died before the client had its last chunk: the new head
    sends the missing tokens and their text (a client reading text, as the HTTP front does, lost the last
    words when only the ids came), and the finish reason of an answer that stopped short is "stop"."""
    from types import SimpleNamespace

    from flowedge.node.replication import resume
    from flowedge.text.streams import TextStream

    log = RequestLog()
    log.apply(p.LogEntry(term=1, client="app", request_id=4, start=0, tokens=tuple(map(ord, "hello"))))
    log.apply(p.LogEntry(term=1, client="app", request_id=4, start=5, done=True))
    engines = SimpleNamespace(text_stream=lambda sink: TextStream(LetterTokenizer(), sink))
    sent: list = []
    msg = p.PromptRequest(request_id=4, token_ids=(1, 2), max_new_tokens=16, resumed=3,
                          held_ids=tuple(map(ord, "hel")))
    hello = p.Hello(node_id="app", role="client", device="gateway", free_memory_bytes=0)
    peer = FakePeer(hello, identity=b"c")
    resume(SimpleNamespace(engines=engines), peer, msg, log, 0.0, True, [], lambda who, m: sent.append((who, m)))
    [(who, chunk)] = sent
    assert who == b"c" and chunk.done and chunk.token_ids == tuple(map(ord, "lo")), chunk
    assert chunk.text == "lo" and chunk.stats["finish_reason"] == "stop", chunk


def _resumed_with_stop(next_token: int):
    """The old head logged "ca" (tokens 3, 1 as letters) under the stop string "ab", so it held the "a" back
    from the client; the new head resumes after them and makes `next_token`: what the client gets."""
    from test_node_lifecycle import book, prompt

    from flowedge.node.replication import resume

    requests, port = book()
    requests.tick(0.0, True)
    log = RequestLog()
    log.apply(p.LogEntry(term=1, client="app", request_id=1, start=0, tokens=(3, 1)))
    msg = prompt(max_new=8, stop=["ab"], resumed=2, held_ids=(3, 1))
    resume(requests, FakePeer(_hello("app"), b"c"), msg, log, 0.0, True, [],
           lambda who, m: port.client.append((who, m)))
    requests.tick(0.1, True)
    requests.on_segment(port.engine_.starts[-1][0], next_token, 0.2)
    chunks = [m for m in port.answers(b"c") if isinstance(m, p.TokenChunk)]
    return port, "".join(m.text for m in chunks)


def test_a_stop_string_spanning_the_failover_ends_the_answer_at_the_same_token():
    """"a" came from the old head, "b" from the new one: the answer ends at "b", as without a failover (the
    new head's stop matcher started empty and let "ab" through)."""
    port, text = _resumed_with_stop(2)
    assert port.done(b"c") and port.tokens(b"c") == [2] and text == "", (port.client, text)
    assert [m.stats["finish_reason"] for m in port.answers(b"c") if getattr(m, "done", False)] == ["stop"]


def test_the_text_the_old_head_held_back_for_a_stop_string_reaches_the_client():
    """No stop after all ("ac"): the "a" the old head held back goes out with the next piece (it was lost)."""
    port, text = _resumed_with_stop(3)
    assert not port.done(b"c") and port.tokens(b"c") == [3] and text == "ac", (port.client, text)
