"""Drafter-role messages (transport/msg_draft.py): they round-trip without touching their numbers, and
every inconsistent job or answer is one clear ProtocolError, before any tensor op runs on it."""
from __future__ import annotations

import dataclasses

import pytest
import torch

from draft_helpers import draft_answer, draft_job, rows
from flowedge.errors import ProtocolError
from flowedge.transport import protocol as p


def _roundtrip(msg):
    return p.decode(msg.to_frames())


def test_a_job_round_trips_with_its_scores_exact_and_its_rows_in_their_dtype():
    job = draft_job(rows=rows(4, torch.float16), hidden_wire="float16",
                    log_scores=torch.tensor([0.0, -0.1234567, -1e-7, -30.5]))
    out = _roundtrip(job)
    assert out == job
    assert out.rows.dtype == torch.float16 and out.log_scores.dtype == torch.float32
    assert torch.equal(out.log_scores, job.log_scores)   # float32 frames are never rounded


def test_an_answer_round_trips_with_its_calls():
    ans = draft_answer()
    out = _roundtrip(ans)
    assert out == ans and out.calls == [(4, 9, 0.01), (4, 11, 0.02)]


def test_draft_messages_came_with_1_5_and_older_peers_reading_a_job_are_told_to_upgrade():
    frames = draft_job().to_frames()
    import msgpack
    header = msgpack.unpackb(bytes(frames[0]), raw=False)
    assert header["v"] == [1, 8]
    header["v"] = [1, 4]
    with pytest.raises(ProtocolError, match="1.5 or newer"):
        p.decode([msgpack.packb(header), *frames[1:]])


@pytest.mark.parametrize("change, match", [
    (dict(parents=torch.tensor([0, 3, 1])), "parent before it"),
    (dict(parents=torch.tensor([0, 1])), "length 3"),
    (dict(ran=torch.tensor([0, 1])), "ascending node ids in \\[1, 4\\)"),
    (dict(ran=torch.tensor([2, 1])), "ascending"),
    (dict(ran=torch.tensor([1, 4])), "ascending"),
    (dict(rows=rows(3)), "rows"),
    (dict(rows=torch.zeros(2, 3, 1, 4, 4)), "rows"),
    (dict(rows=torch.zeros(4, 4, dtype=torch.float32)), "rows"),
    (dict(keep=4), "keep"),
    (dict(tokens=torch.tensor([9, 11, 12, 13])), "rooted at the context's last token"),
    (dict(log_scores=torch.tensor([0.0, float("nan"), -1.0, -2.0])), "no NaN"),
    (dict(log_scores=torch.zeros(4, dtype=torch.float64)), "float32"),
    (dict(lookup=5), "lookup"),
    (dict(calls=0), "calls"),
    (dict(calls=65), "calls"),
    (dict(width=2000), "width"),
    (dict(context=()), "context"),
    (dict(hidden_wire="int8"), "hidden_wire"),
])
def test_an_inconsistent_job_is_refused(change, match):
    with pytest.raises(ProtocolError, match=match):
        draft_job(**change)


def test_a_tree_past_the_bound_is_refused():
    from flowedge.transport.msg_draft import MAX_TREE_NODES
    n = MAX_TREE_NODES + 1
    with pytest.raises(ProtocolError, match="tree of 1 to"):
        draft_job(n=n, ran=())


@pytest.mark.parametrize("calls", [[(1, 2)], [(1, 2, -1.0)], [("a", 2, 0.1)], [(1, 2, 0.1)] * 65, "x"])
def test_bad_call_records_are_refused(calls):
    with pytest.raises(ProtocolError, match="calls"):
        draft_answer(calls=calls)


def test_a_decoded_message_is_checked_the_same_way():
    """What a peer sends is checked by the same __post_init__: a job whose rows frame lies about its row
    count fails to decode."""
    job = draft_job()
    bad = dataclasses.replace(job, rows=rows(4))
    frames = bad.to_frames()
    import msgpack
    header = msgpack.unpackb(bytes(frames[0]), raw=False)
    header["keep"] = 2
    with pytest.raises(ProtocolError, match="rows"):
        p.decode([msgpack.packb(header), *frames[1:]])


def test_declined_reasons_are_a_closed_list():
    assert _roundtrip(p.DraftDeclined(request_id=1, seq=2, why="error", detail="x" * 9000)).detail.endswith("…")
    with pytest.raises(ProtocolError, match="why"):
        p.DraftDeclined(request_id=1, seq=2, why="maybe")


def test_a_drafter_hello_is_a_valid_role():
    hello = p.Hello(node_id="d", role="drafter", device="x86-cpu", free_memory_bytes=1, capabilities={"role": "drafter"})
    assert _roundtrip(hello).role == "drafter"


def test_a_setup_names_the_files_the_head_serves_or_none():
    sha = "ab" * 32
    setup = p.DraftSetup(model="m", quant="int4", shard_sha256=sha, shard_bytes=10, head_sha256="cd" * 32,
                         head_bytes=5, side_files={"config.json": "{}", "manifest.json": "{}"})
    assert _roundtrip(setup) == setup
    assert _roundtrip(p.DraftSetup(model="m", quant="int4")).shard_sha256 == ""
    with pytest.raises(ProtocolError, match="head_sha256"):
        p.DraftSetup(model="m", quant="int4", shard_sha256=sha)   # both files, or neither
    with pytest.raises(ProtocolError, match="side_files"):
        p.DraftSetup(model="m", quant="int4", shard_sha256=sha, head_sha256=sha, side_files={"../x": ""})
