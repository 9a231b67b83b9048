"""Engine messages <-> wire messages. The only place that knows both vocabularies.

The two say the same things in the same ids (no shift): a tree node that hangs off the committed
context is marked by the engine's `roots` mask and travels as an index set of those rows
(`root_rows`); a prompt chunk carries no tree ids at all; token choices travel as they are. Only the
roots change form (mask <-> rows); every other tensor passes through without a copy.

Peer input ends here as a ProtocolError, however it is wrong: what decodes (each field valid alone) can
still break a rule that spans fields, which the engine's own types check by raising ValueError (a
PruneSet's ids past its horizon, a root row past the segment's nodes); `from_wire` turns those into
ProtocolError, so a node drops and counts the frame as it does a malformed one.
"""
from __future__ import annotations

from typing import Any

import torch

from flowedge.core.prune import PruneSet
from flowedge.core.sampling import SamplingParams
from flowedge.engine import events
from flowedge.errors import ConfigError, ProtocolError
from flowedge.transport import protocol as proto
from flowedge.transport.channel import wire_bytes
from flowedge.transport.link import Endpoint


def segment_to_wire(seg: events.Segment, hidden_wire: str) -> proto.Segment:
    """Hidden states, or the last stage's chosen tokens."""
    sampling: dict[str, Any] = {} if seg.sampling is None else dict(
        temperature=float(seg.sampling.temperature), top_k=seg.sampling.top_k, top_p=float(seg.sampling.top_p),
        seed=seg.sampling.seed)
    payload: dict[str, Any]
    if seg.tokens is not None:
        payload = dict(token_ids=seg.tokens)
    elif seg.hidden is None:
        raise ProtocolError("a segment without hidden states must carry token choices")
    else:
        payload = dict(hidden=seg.hidden)
    roots = None if seg.roots is None or not bool(seg.roots.any()) else seg.roots.nonzero().flatten()
    return proto.Segment(
        run_id=seg.run_id, round_id=seg.round_id, seq=seg.seq, prune_version=seg.prune_version,
        kind=seg.phase, sent_at_step=seg.seq, node_ids=seg.node_ids, parent_ids=seg.parent_ids,
        root_rows=roots, positions=seg.positions, hidden_wire=hidden_wire, **payload, **sampling)


def segment_from_wire(msg: proto.Segment, dtype: torch.dtype) -> events.Segment:
    sampling = None if msg.temperature is None else SamplingParams(msg.temperature, msg.top_k, msg.top_p, msg.seed)
    if msg.hidden is None:   # the last stage's token choices: no hidden states to carry
        hidden, tokens = None, msg.token_ids
    else:   # hidden states arrive in the wire dtype; the cast to the compute dtype is the only copy
        hidden, tokens = msg.hidden.to(dtype), None
    roots = None
    if msg.root_rows is not None and msg.root_rows.numel():
        roots = torch.zeros(msg.node_ids.numel(), dtype=torch.bool)
        roots[msg.root_rows] = True
    return events.Segment(msg.run_id, msg.round_id, msg.seq, msg.prune_version, msg.node_ids,
                          msg.parent_ids, msg.positions, hidden, msg.kind, tokens, sampling, roots)


def prune_to_wire(p: events.Prune) -> proto.Prune:
    return proto.Prune(run_id=p.run_id, round_id=p.round_id, version=p.version,
                       horizon=p.prune.horizon, commit_ids=p.prune.commit, keep_ids=p.prune.keep,
                       end_round=p.end_round)


def prune_from_wire(msg: proto.Prune) -> events.Prune:
    try:
        prune = PruneSet(commit=msg.commit_ids, keep=msg.keep_ids, horizon=msg.horizon)
    except ValueError as err:   # ids past the horizon, unsorted keep ids, an id both committed and kept
        raise ProtocolError(proto.bounded(f"prune of run {msg.run_id}: {err}", 512)) from None
    return events.Prune(msg.run_id, msg.round_id, msg.version, prune, msg.end_round)


def to_wire(message, hidden_wire: str) -> proto.Message:
    """Any engine message a node sends (Segment, Prune, Finish)."""
    if isinstance(message, events.Segment):
        return segment_to_wire(message, hidden_wire)
    if isinstance(message, events.Prune):
        return prune_to_wire(message)
    if isinstance(message, events.Finish):
        return proto.Reset(run_id=message.run_id)
    raise TypeError(f"no wire form for {type(message).__name__}")


def from_wire(msg: proto.Message, dtype: torch.dtype):
    """The engine event for a data-plane wire message, or None if it is not one; ProtocolError for one the
    engine's types refuse."""
    if isinstance(msg, (proto.Segment, proto.Prune)):
        try:
            return segment_from_wire(msg, dtype) if isinstance(msg, proto.Segment) else prune_from_wire(msg)
        except (ValueError, IndexError, TypeError, ConfigError) as err:   # safety net: peer input never crashes
            raise ProtocolError(proto.bounded(f"{msg.TYPE} of run {msg.run_id}: {err}", 512)) from None
    if isinstance(msg, proto.Reset):
        return events.Finish(msg.run_id)
    return None


class WireCounter:
    """Bytes this node put on the wire (ZMTP framing + CurveZMQ included) against the payload inside
    (tensor frames: hidden states and index sets), per message type — the framing-overhead figure."""

    def __init__(self, curve: bool) -> None:
        self.curve = curve
        self.wire: dict[str, int] = {}
        self.payload: dict[str, int] = {}
        self.count: dict[str, int] = {}

    def send(self, endpoint: Endpoint, msg: proto.Message, to: bytes | None = None) -> None:
        """Count the message, then send it (PeerUnreachable passes through: it was counted as offered)."""
        frames = msg.to_frames()
        self.count[msg.TYPE] = self.count.get(msg.TYPE, 0) + 1
        self.payload[msg.TYPE] = self.payload.get(msg.TYPE, 0) + sum(memoryview(f).nbytes for f in frames[1:])
        self.wire[msg.TYPE] = self.wire.get(msg.TYPE, 0) + wire_bytes(frames, self.curve)
        endpoint.send_frames(frames, to)

    def snapshot(self) -> dict:
        return {t: {"messages": self.count[t], "wire_bytes": self.wire[t], "payload_bytes": self.payload[t]}
                for t in self.count}
