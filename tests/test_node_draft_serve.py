"""The drafter's job handler (node/draft_serve.py) on the tiny draft model: a job that crossed the wire
is answered with exactly what node 0 would draft itself, a replica that is behind is said so, and any
malformed job gets an error answer while the handler keeps serving."""
from __future__ import annotations

import dataclasses
import logging

import msgpack
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from flowedge.engine.draft_sync import graft, snapshot
from flowedge.engine.drafter import Drafter
from flowedge.errors import ProtocolError
from flowedge.models.stage import StageModel
from flowedge.node import draft_wire
from flowedge.node.draft_serve import DraftServer
from flowedge.node.droplog import DropLog
from draft_helpers import rooted, tree_paths
from flowedge.transport import protocol as p

CONTEXT = list(range(3, 15))
WIDTH = 4


@pytest.fixture(scope="module")
def draft_model(tiny_pair):
    return StageModel.load(tiny_pair[1])


def _rooted(model, context=CONTEXT) -> Drafter:
    return rooted(model, context)


_paths = tree_paths


def _server(model) -> DraftServer:
    return DraftServer(model, DropLog(logging.getLogger("test")))


def _job_frames(model, key=1, seq=1, keep=0, context=CONTEXT):
    node0 = _rooted(model, context)
    snap = snapshot(node0, context, keep, 2, WIDTH, 0)
    return node0, snap, draft_wire.job_message(key, seq, snap).to_frames()


def test_a_job_over_the_wire_grows_what_node0_would_draft_itself(draft_model):
    node0, snap, frames = _job_frames(draft_model)
    server = _server(draft_model)
    reply = p.decode(server.handle(frames).to_frames())
    assert isinstance(reply, p.DraftAnswer) and (reply.request_id, reply.seq) == (1, 1)
    growth = draft_wire.growth_of(reply, snap, draft_model)
    assert growth.ran.numel() > 0 and len(growth.calls) == 2
    added, adopted = graft(node0, growth, snap)
    assert added > 0 and adopted > 0
    ref = _rooted(draft_model)
    ref.advance(CONTEXT, 2, WIDTH, 0)
    assert _paths(node0) == _paths(ref)
    assert server.stats()["answered"] == 1 and server.stats()["replicas"] == 1


def test_a_replica_that_lacks_the_rows_is_behind(draft_model):
    _, _, frames = _job_frames(draft_model, keep=5)
    reply = _server(draft_model).handle(frames)
    assert isinstance(reply, p.DraftDeclined) and reply.why == "behind" and (reply.request_id, reply.seq) == (1, 1)


def test_a_second_job_ships_only_the_new_rows(draft_model):
    server = _server(draft_model)
    _, _, first = _job_frames(draft_model, seq=1)
    assert isinstance(server.handle(first), p.DraftAnswer)
    longer = CONTEXT + [20, 21]
    node0, snap, frames = _job_frames(draft_model, seq=2, keep=len(CONTEXT), context=longer)
    assert snap.rows.shape[3] == 2 + snap.ran.numel()
    reply = server.handle(frames)
    assert isinstance(reply, p.DraftAnswer), reply
    ref = _rooted(draft_model, longer)
    ref.advance(longer, 2, WIDTH, 0)
    graft(node0, draft_wire.growth_of(p.decode(reply.to_frames()), snap, draft_model), snap)
    assert _paths(node0) == _paths(ref)


def test_a_job_for_another_model_shape_is_an_error_answer(draft_model):
    _, snap, _ = _job_frames(draft_model)
    bad = draft_wire.job_message(1, 3, snap)
    frames = dataclasses.replace(bad, rows=bad.rows[:, :, :, :, :-1].contiguous()).to_frames()
    server = _server(draft_model)
    reply = server.handle(frames)
    assert isinstance(reply, p.DraftDeclined) and reply.why == "error" and "head_dim" in reply.detail
    big = dataclasses.replace(bad, context=tuple(CONTEXT[:-1]) + (10 ** 6,), tokens=torch.tensor([10 ** 6]),
                              parents=torch.empty(0, dtype=torch.long), log_scores=torch.zeros(1),
                              ran=torch.empty(0, dtype=torch.long), rows=bad.rows[:, :, :, :len(CONTEXT)].contiguous())
    reply = server.handle(big.to_frames())
    assert isinstance(reply, p.DraftDeclined) and "vocabulary" in reply.detail


def test_check_rows_names_the_models_shape(draft_model):
    with pytest.raises(ProtocolError, match="this draft model's"):
        draft_wire.check_rows(torch.zeros(1, 2, 1, 3, 1), draft_model)


_FUZZ = settings(deadline=None, max_examples=150, suppress_health_check=list(HealthCheck))


@_FUZZ
@given(data=st.data())
def test_fuzz_malformed_jobs_get_an_error_answer_and_the_handler_keeps_serving(draft_model, data):
    _, _, frames = _job_frames(draft_model, key=7, seq=4)
    frames = [bytes(f) for f in frames]
    header = msgpack.unpackb(frames[0], raw=False)
    what = data.draw(st.sampled_from(["field", "flip", "cut", "drop", "meta"]))
    if what == "field":
        name = data.draw(st.sampled_from(["keep", "calls", "width", "lookup", "topk", "seq", "hidden_wire"]))
        header[name] = data.draw(st.integers(-3, 1 << 20) | st.text(max_size=4) | st.none())
    elif what == "meta":
        name = data.draw(st.sampled_from(sorted(header["tensors"])))
        header["tensors"][name]["shape"] = data.draw(st.lists(st.integers(0, 40), max_size=5))
    elif what in ("flip", "cut"):
        k = data.draw(st.integers(1, len(frames) - 1))
        raw = bytearray(frames[k])
        if what == "flip" and raw:
            for _ in range(data.draw(st.integers(1, 8))):
                raw[data.draw(st.integers(0, len(raw) - 1))] ^= data.draw(st.integers(1, 255))
        else:
            raw = raw[: data.draw(st.integers(0, max(0, len(raw) - 1)))]
        frames[k] = bytes(raw)
    else:
        frames = frames[:-1]
    frames[0] = msgpack.packb(header, use_bin_type=True)
    server = _server(draft_model)
    reply = server.handle(frames)
    assert isinstance(reply, (p.DraftAnswer, p.DraftDeclined))   # an answer, never an exception
    p.decode(reply.to_frames())   # and one that goes on the wire
    _, _, good = _job_frames(draft_model, key=8, seq=1)
    assert isinstance(server.handle(good), p.DraftAnswer)


@_FUZZ
@given(junk=st.lists(st.binary(max_size=64), max_size=4))
def test_fuzz_random_frames_are_an_error_answer(draft_model, junk):
    reply = _server(draft_model).handle(junk)
    assert isinstance(reply, p.DraftDeclined) and reply.why == "error" and reply.request_id == 0
