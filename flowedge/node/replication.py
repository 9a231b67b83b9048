"""The request log a standby head follows, both ends: the head's `Replicator` (a tap on the way to the
clients: every token a client is sent is first sent to each standby) and the standby's `RequestLog`, which
the new head resumes requests from (`resume`).

Replicated as they commit: the tap sits on the head's one way to its clients (requests.OutPort), and a
TokenChunk is only ever the committed tokens of a request, so the log is the answers as the clients
saw them, one message ahead of them. A client that follows the head to the standby (client/sync_client.py)
sends its request again with `resumed` = the tokens it holds; the new head runs it on the prompt plus the
logged tokens (as a replay after a stage loss does), so at T=0 the rest is token-identical.
"""
from __future__ import annotations

import logging
import time
from collections import OrderedDict
from dataclasses import replace

from flowedge.node.head_ports import ControlPort
from flowedge.node.membership import Membership
from flowedge.text.streams import StopText
from flowedge.transport import protocol as proto

log = logging.getLogger(__name__)

MAX_LOGGED = 4096   # requests a standby's log holds at most (the oldest are forgotten first)
Key = tuple[str, int]   # (the client's node id, the request id on its connection)


class Replicator:
    """Head side: each standby gets every committed token (LogEntry) and, every heartbeat period, the
    head's term and membership (HeadState, also its liveness)."""

    def __init__(self, port: ControlPort, members: Membership, head_id: str, heartbeat_s: float) -> None:
        self.port, self.members, self.head_id, self.heartbeat_s = port, members, head_id, heartbeat_s
        self.standbys: list[bytes] = []
        self.committed: dict[tuple[bytes, int], list[int]] = {}   # (owner, request id) -> tokens sent
        self.sent: dict[bytes, int] = {}   # standby -> log tokens sent it (status: how far behind it is)
        self.last_state_s = 0.0

    def joined(self, identity: bytes, hello: proto.Hello) -> None:
        """A standby joined: it is sent the log so far, then follows it."""
        if hello.role != "standby":
            return
        log.info("standby %s joined: replicating %d live requests to it", hello.node_id, len(self.committed))
        self.standbys.append(identity)
        self.sent[identity] = sum(map(len, self.committed.values()))
        for (owner, rid), tokens in self.committed.items():
            self.port.send(identity, proto.LogEntry(term=self.port.term, client=self._name(owner), request_id=rid,
                                                    tokens=tuple(tokens)))

    def tap(self, owner: bytes, msg: proto.Message) -> None:
        """A message on its way to a client: its committed tokens (or its end) go to the standbys first."""
        if not self.standbys or not isinstance(msg, (proto.TokenChunk, proto.ErrorReply)):
            return
        key = (owner, msg.request_id)
        tokens = self.committed.setdefault(key, [])
        start, new = len(tokens), tuple(getattr(msg, "token_ids", ()))
        failed = isinstance(msg, proto.ErrorReply)
        done = isinstance(msg, proto.TokenChunk) and msg.done
        tokens += new
        if done or failed:
            del self.committed[key]
        self._to_standbys(proto.LogEntry(term=self.port.term, client=self._name(owner), request_id=msg.request_id,
                                         start=start, tokens=new, done=done, failed=failed))

    def tick(self, now: float | None = None) -> None:
        """The head's state to each standby once a heartbeat period; requests of clients gone, forgotten."""
        now = time.monotonic() if now is None else now
        if not self.standbys or now - self.last_state_s < self.heartbeat_s:
            return
        self.last_state_s = now
        self.standbys = [i for i in self.standbys if i in self.members.peers]
        self.sent = {i: n for i, n in self.sent.items() if i in self.standbys}
        for owner, rid in [k for k in self.committed if k[0] not in self.members.peers]:
            del self.committed[(owner, rid)]
        stages = [self.members.peers[i].name if i is not None else "" for i in self.members.slots]
        layers: list[int] = self.members.plan.counts if self.members.plan is not None else []
        self._to_standbys(proto.HeadState(term=self.port.term, head_id=self.head_id, stages=stages,
                                          ready=self.members.cluster_ready(), layers=layers))

    def _to_standbys(self, msg: proto.Message) -> None:
        for identity in self.standbys:
            self.port.send(identity, msg)
            self.sent[identity] = self.sent.get(identity, 0) + len(getattr(msg, "tokens", ()))

    def _name(self, owner: bytes) -> str:
        peer = self.members.peers.get(owner)
        return peer.hello.node_id if peer is not None else ""


class ReplicatingOut:
    """The head's OutPort with the replicator's tap on the way to clients (everything else as it was)."""

    def __init__(self, inner, replicator: Replicator) -> None:
        self.inner, self.replicator = inner, replicator

    def to_client(self, identity: bytes, msg: proto.Message) -> None:
        self.replicator.tap(identity, msg)
        self.inner.to_client(identity, msg)

    def to_stages(self, action) -> None:
        self.inner.to_stages(action)

    def reset_stages(self, run_id: int) -> None:
        self.inner.reset_stages(run_id)

    def offload(self, key: int, action) -> None:
        self.inner.offload(key, action)


class RequestLog:
    """Standby side: each live request's committed tokens, as the head's LogEntry messages built them."""

    def __init__(self) -> None:
        self.entries: OrderedDict[Key, list[int]] = OrderedDict()
        self.broken: set[Key] = set()   # a gap in the entries (a message lost): not resumable
        self.done: set[Key] = set()     # answered in full (kept: a client may have missed the end)
        self.applied = 0                # log tokens applied (the head's status compares it to those it sent)

    def apply(self, msg: proto.LogEntry) -> None:
        key = (msg.client, msg.request_id)
        self.applied += len(msg.tokens)
        if msg.failed:
            self.entries.pop(key, None)
            self.broken.discard(key)
            return
        if msg.done:
            self.done.add(key)
        tokens = self.entries.setdefault(key, [])
        if msg.start > len(tokens):
            self.broken.add(key)
            log.warning("request log: a gap in request %d of %s (%d tokens held, the entry starts at %d)",
                        msg.request_id, msg.client, len(tokens), msg.start)
        del tokens[msg.start:]
        tokens += msg.tokens
        while len(self.entries) > MAX_LOGGED:
            old, _ = self.entries.popitem(last=False)
            self.done.discard(old)
            self.broken.discard(old)

    def live(self) -> int:
        return len(self.entries) - len(self.done)

    def committed(self, client: str, request_id: int) -> list[int] | None:
        key = (client, request_id)
        return None if key in self.broken else self.entries.get(key)


def resume(requests, peer, msg: proto.PromptRequest, entries: RequestLog, now: float, ready: bool,
           missing: list[str], send) -> None:
    """A request a client sends again after the head was lost: continued after its logged tokens (those
    the client lacks are sent first); one the log cannot continue ends with an error naming the failover."""
    have, fresh = msg.resumed, replace(msg, resumed=-1, held_ids=None)
    key = (peer.hello.node_id, msg.request_id)
    committed = _committed(entries.committed(*key), list(msg.held_ids or ()), have)
    if committed is None:
        logged = entries.committed(*key)
        send(peer.identity, proto.ErrorReply(request_id=msg.request_id, message=(
            f"head failover: request {msg.request_id} cannot be resumed (the new head's log holds "
            f"{'none' if logged is None else len(logged)} of its tokens, the client {have}, and they disagree "
            f"or the client's are missing); send it again")))
        return
    if not committed:   # never started (or never logged before it had tokens): it simply starts here
        requests.submit(peer.identity, fresh, now, ready, missing)
        return
    if (key in entries.done and len(committed) == len(entries.committed(*key) or ())) or \
            len(committed) >= msg.max_new_tokens or _stopped(requests, msg, committed):
        send(peer.identity, _rest_of_a_finished_answer(requests, msg, committed, have))
        return
    log.info("resuming request %d of %s after the failover: %d committed tokens (client holds %d)",
             msg.request_id, peer.hello.node_id, len(committed), have)
    requests.submit(peer.identity, fresh, now, ready, missing)
    client = requests.clients.get(requests.keys)
    if client is None or client.msg is not fresh or client.run is None:
        return   # refused at submit (the reason went to the client)
    client.run.emitted[:] = committed
    client.text(committed[:have])
    # the stop matcher as the old head left it: a stop string's first half (held back from the client, who
    # lacks it) ends the answer with its second half from here, or goes out with the next piece
    client.stop.feed(client.take_pieces())
    if len(committed) > have:
        client.text(committed[have:])
        send(peer.identity, proto.TokenChunk(request_id=msg.request_id, token_ids=tuple(committed[have:]),
                                             text=client.stop.feed(client.take_pieces()), done=False))


def _rest_of_a_finished_answer(requests, msg: proto.PromptRequest, committed: list[int],
                               have: int) -> proto.TokenChunk:
    """The answer was whole before the head was lost, and only its end is missing at the client: those
    tokens with their text (decoded after the ones the client holds, as the old head would have: a client
    that reads text, as the HTTP front does, would otherwise lose the answer's last words)."""
    pieces: list[str] = []
    text, stop = requests.engines.text_stream(pieces.append), StopText(msg.stop)
    text(committed[:have])
    stop.feed("".join(pieces))   # what the client holds; a stop string's first half stays held
    pieces.clear()
    text(committed[have:])
    text.flush()
    rest = stop.finish("".join(pieces))
    reason = "length" if len(committed) >= msg.max_new_tokens and not stop.hit else "stop"
    return proto.TokenChunk(request_id=msg.request_id, token_ids=tuple(committed[have:]), text=rest,
                            done=True, stats={"finish_reason": reason})


def _stopped(requests, msg: proto.PromptRequest, committed: list[int]) -> bool:
    """The logged tokens complete a stop string: the old head ended the answer there (the log's `done`
    did not make it out before the head was lost), so the rest is only the end the client lacks."""
    if not msg.stop:
        return False
    pieces: list[str] = []
    stop = StopText(msg.stop)
    requests.engines.text_stream(pieces.append)(committed)
    stop.feed("".join(pieces))
    return stop.hit


def _committed(logged: list[int] | None, held: list[int], have: int) -> list[int] | None:
    """The request's committed tokens: the longer of the log's and the client's (the old head sent both,
    the log first, but a kill may deliver either last); None if they disagree or neither covers `have`."""
    if len(held) != have and (logged is None or len(logged) < have):
        return None
    if logged is not None and logged[:len(held)] != held[:len(logged)]:
        return None
    return logged if logged is not None and len(logged) >= len(held) else held
