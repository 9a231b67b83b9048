"""Wire messages: every type round-trips, every malformed input is a one-line ProtocolError."""
from __future__ import annotations

import dataclasses
import hashlib

import msgpack
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from draft_helpers import draft_answer, draft_job
from flowedge.errors import ChecksumError, ProtocolError
from flowedge.transport import protocol as p

torch.set_num_threads(1)
SHA = hashlib.sha256(b"shard").hexdigest()


def _segment(n: int = 4, with_hidden: bool = True, wire: str = "float16", **kw) -> p.Segment:
    fields = dict(
        run_id=7, round_id=2, seq=1, prune_version=3, kind="draft", sent_at_step=11,
        node_ids=torch.arange(n), parent_ids=torch.zeros(n, dtype=torch.int64),
        positions=torch.arange(100, 100 + n), hidden_wire=wire,
    )
    if with_hidden:
        fields["hidden"] = torch.randn(n, 8)
    else:
        fields["token_ids"] = torch.arange(150_000, 150_000 + n)
    fields.update(kw)
    return p.Segment(**fields)


SAMPLES = [
    p.Hello(node_id="pi-1", role="stage", device="cpu", free_memory_bytes=4 << 30, capabilities={"bf16": True}),
    p.Welcome(node_id="head", heartbeat_interval_ms=1000),
    p.Refuse(reason="a head is already connected"),
    p.RequestDropped(run_id=9, reason="stage-2: its KV cache would pass 4096 entries"),
    p.Assign(stage_index=1, layer_start=0, layer_end=7, shard_sha256=SHA, shard_bytes=123,
             next_addr="tcp://10.0.0.3:5601", model="qwen2.5-coder-1.5b", model_sha256=SHA),
    p.ShardRequest(offset=4 << 20),
    p.ShardChunk.of(8, b"chunk-bytes", 100),
    p.Ready(stage_index=2),
    p.Heartbeat(node_id="pi-1", load=0.25, rss_bytes=1 << 30),
    p.Shutdown(reason="operator"),
    p.Prune(run_id=7, round_id=3, version=4, horizon=42, commit_ids=torch.tensor([0, 2]),
            keep_ids=torch.tensor([5, 6, 40_000])),
    p.Reset(run_id=7),
    p.PromptRequest(request_id=1, text="def fib(n):", max_new_tokens=32, temperature=0.7, top_k=10,
                    top_p=0.9, seed=5),
    p.PromptRequest(request_id=2, token_ids=torch.tensor([151_000, 3]), max_new_tokens=4),
    p.PromptRequest(request_id=3, messages=[{"role": "system", "content": "be brief"},
                                            {"role": "user", "content": "hi"}], max_new_tokens=4,
                    stop=["\n\n", "END"]),
    p.PromptRequest(request_id=4, text="def f(", max_new_tokens=4, raw=True),
    p.PromptRequest(request_id=5, text="hi", max_new_tokens=4, client="http:key-0123456789ab"),
    p.Cancel(request_id=3),
    p.TokenChunk(request_id=1, token_ids=torch.tensor([9, 10]), text="ab", done=True,
                 stats={"tokens_per_s": 3.5}),
    p.ErrorReply(request_id=1, message="context overflow"),
    p.StatusRequest(),
    p.StatusReply(nodes=[{"id": "head", "role": "head"}, {"id": "pi-1", "stage": 1}]),
    _segment(with_hidden=True),
    _segment(with_hidden=False),
    p.DraftSetup(model="qwen2.5-coder-0.5b", quant="int4"),
    p.DraftReady(model="qwen2.5-coder-0.5b"),
    draft_job(),
    draft_answer(),
    p.DraftDeclined(request_id=3, seq=2, why="behind", detail="no replica"),
    p.LogEntry(term=2, client="client-1-ab", request_id=4, start=3, tokens=(5, 6, 7)),
    p.LogEntry(term=2, client="client-1-ab", request_id=4, start=10, done=True),
    p.HeadState(term=2, head_id="head", stages=["stage-1", ""], ready=True, layers=[2, 2]),
    p.PromptRequest(request_id=5, max_new_tokens=9, token_ids=[1, 2], resumed=2, held_ids=[7, 8]),
    p.Welcome(node_id="standby", heartbeat_interval_ms=100, term=3),
]


def _expected(msg: p.Message) -> p.Message:
    """What the receiver sees: hidden states in their wire dtype, everything else unchanged."""
    if isinstance(msg, p.Segment) and msg.hidden is not None:
        return dataclasses.replace(msg, hidden=msg.hidden.to(p.WIRE_DTYPES[msg.hidden_wire]))
    return msg


def _header(frames) -> dict:
    return msgpack.unpackb(bytes(frames[0]), raw=False)


def _frames(header: dict, *tensors: bytes) -> list[bytes]:
    return [msgpack.packb(header), *tensors]


@pytest.mark.parametrize("msg", SAMPLES, ids=lambda m: type(m).__name__)
def test_every_message_round_trips(msg: p.Message) -> None:
    frames = p.encode(msg)
    out = p.decode(frames)
    assert type(out) is type(msg)
    assert out == _expected(msg)
    assert type(msg).from_frames(frames) == out


@pytest.mark.parametrize("msg", SAMPLES, ids=lambda m: type(m).__name__)
def test_every_header_carries_version_and_type(msg: p.Message) -> None:
    header = _header(msg.to_frames())
    assert header["v"] == list(p.PROTOCOL_VERSION) == [1, 9]
    assert p.MESSAGE_TYPES[header["type"]] is type(msg)


def test_message_types_are_unique_and_complete() -> None:
    assert len(p.MESSAGE_TYPES) == 26
    assert {type(m) for m in SAMPLES} == set(p.MESSAGE_TYPES.values())


@pytest.mark.parametrize("wire", ["float16", "bfloat16"])
def test_segment_hidden_travels_in_its_wire_dtype(wire: str) -> None:
    seg = _segment(n=16, wire=wire)
    frames = seg.to_frames()
    assert _header(frames)["tensors"]["hidden"] == {"dtype": wire, "shape": [16, 8]}
    out = p.decode(frames)
    assert out.hidden.dtype == p.WIRE_DTYPES[wire]
    assert torch.equal(out.hidden, seg.hidden.to(out.hidden.dtype))


def test_segment_index_sets_are_compact_on_the_wire_and_int64_in_memory() -> None:
    seg = _segment(with_hidden=False)
    metas = _header(seg.to_frames())["tensors"]
    assert metas["node_ids"]["dtype"] == "int16"
    assert metas["token_ids"]["dtype"] == "int32"  # vocab ids beyond int16
    out = p.decode(seg.to_frames())
    assert out.node_ids.dtype == out.token_ids.dtype == torch.int64
    assert len(out) == 4


@pytest.mark.parametrize("hidden", [True, False])
def test_empty_segment_round_trips(hidden: bool) -> None:
    seg = _segment(n=0, with_hidden=hidden)
    out = p.decode(seg.to_frames())
    assert out == _expected(seg) and len(out) == 0
    if hidden:
        assert out.hidden.shape == (0, 8)


def test_messages_are_frozen_and_keyword_only() -> None:
    with pytest.raises(dataclasses.FrozenInstanceError):
        SAMPLES[0].node_id = "x"  # type: ignore[misc]
    with pytest.raises(TypeError):
        p.Reset(7)  # type: ignore[misc]


def test_equality_compares_tensors_by_value() -> None:
    assert _segment(with_hidden=False) == _segment(with_hidden=False)
    assert _segment(with_hidden=False) != _segment(with_hidden=False, positions=torch.arange(1, 5))


@pytest.mark.parametrize(
    "build",
    [
        lambda: p.Reset(run_id=-1),
        lambda: p.Reset(run_id=True),
        lambda: p.Reset(run_id="7"),
        lambda: p.Hello(node_id="a", role="boss", device="cpu", free_memory_bytes=1),
        lambda: p.Hello(node_id="a", role="stage", device="cpu", free_memory_bytes=1, version=(1,)),
        lambda: p.Hello(node_id="a", role="stage", device="cpu", free_memory_bytes=1, capabilities={1: 2}),
        lambda: p.Assign(stage_index=1, layer_start=5, layer_end=5, shard_sha256=SHA, shard_bytes=1,
                         next_addr="x", model="m"),
        lambda: p.Assign(stage_index=0, layer_start=0, layer_end=5, shard_sha256=SHA, shard_bytes=1,
                         next_addr="x", model="m"),
        lambda: p.Assign(stage_index=1, layer_start=0, layer_end=5, shard_sha256="abc", shard_bytes=1,
                         next_addr="x", model="m"),
        lambda: p.Assign(stage_index=1, layer_start=0, layer_end=5, shard_sha256=SHA, shard_bytes=1,
                         next_addr="x", model="m", model_sha256="abc"),
        lambda: p.ShardRequest(offset=0, length=0),
        lambda: p.ShardChunk.of(95, b"0123456789", 100),
        lambda: p.Heartbeat(node_id="a", load=float("nan"), rss_bytes=1),
        lambda: _segment(kind="verify"),
        lambda: _segment(parent_ids=torch.zeros(3, dtype=torch.int64)),
        lambda: _segment(node_ids=torch.tensor([0.0, 1.0, 2.0, 3.0])),
        lambda: _segment(node_ids=torch.tensor([-1, 0, 1, 2])),  # no sentinels on the wire
        lambda: _segment(hidden=torch.randn(4, 8), token_ids=torch.arange(4)),
        lambda: _segment(hidden=None),
        lambda: _segment(hidden=torch.randn(3, 8)),
        lambda: _segment(wire="float64"),
        lambda: p.PromptRequest(request_id=1, max_new_tokens=4),
        lambda: p.PromptRequest(request_id=1, text="x", max_new_tokens=4, top_p=1.5),
        lambda: p.PromptRequest(request_id=1, text="x", max_new_tokens=4, top_k=0),
        lambda: p.PromptRequest(request_id=1, text="x", messages=[{"role": "user", "content": "x"}],
                                max_new_tokens=4),
        lambda: p.PromptRequest(request_id=1, messages=[], max_new_tokens=4),
        lambda: p.PromptRequest(request_id=1, messages=[{"role": "wizard", "content": "x"}], max_new_tokens=4),
        lambda: p.PromptRequest(request_id=1, messages=[{"role": "user", "content": 3}], max_new_tokens=4),
        lambda: p.PromptRequest(request_id=1, messages=[{"role": "user"}], max_new_tokens=4),
        lambda: p.PromptRequest(request_id=1, messages=[{"role": "user", "content": "x"}] * 1025,
                                max_new_tokens=4),
        lambda: p.PromptRequest(request_id=1, text="x", max_new_tokens=4, stop=[""]),
        lambda: p.PromptRequest(request_id=1, text="x", max_new_tokens=4, stop=["x" * 257]),
        lambda: p.PromptRequest(request_id=1, text="x", max_new_tokens=4, stop=["a"] * 17),
        lambda: p.PromptRequest(request_id=1, text="x", max_new_tokens=4, stop="END"),
        lambda: p.PromptRequest(request_id=1, text="x", max_new_tokens=4, raw=1),
        lambda: p.PromptRequest(request_id=1, text="x", max_new_tokens=4, client=7),
        lambda: p.PromptRequest(request_id=1, text="x", max_new_tokens=4, client="c" * 129),
        lambda: p.PromptRequest(request_id=1, text="", max_new_tokens=4),          # the empty prompt
        lambda: p.PromptRequest(request_id=1, token_ids=[], max_new_tokens=4),
        lambda: p.PromptRequest(request_id=1, token_ids=[True, False], max_new_tokens=4),
        lambda: p.Cancel(request_id=-1),
        lambda: p.TokenChunk(request_id=1, token_ids=torch.arange(2), text="", done=1),
        lambda: p.StatusReply(nodes=[1, 2]),
    ],
)
def test_invalid_messages_cannot_be_built(build) -> None:
    with pytest.raises(ProtocolError):
        build()


def test_a_prompt_over_the_limit_is_refused_as_too_long_not_as_the_wrong_type() -> None:
    with pytest.raises(ProtocolError, match=r"prompt.text is too long: 1000000 characters \(at most 524288\)"):
        p.PromptRequest(request_id=1, text="x" * 1_000_000, max_new_tokens=4)
    with pytest.raises(ProtocolError, match=r"prompt.messages is too long: 600000 characters"):
        p.PromptRequest(request_id=1, messages=[{"role": "user", "content": "x" * 600_000}], max_new_tokens=4)


def test_shard_chunk_verify_detects_corruption() -> None:
    chunk = p.ShardChunk.of(0, b"abc", 3)
    p.decode(chunk.to_frames()).verify()
    bad = p.ShardChunk(offset=0, total=3, data=b"abd", sha256=chunk.sha256)
    with pytest.raises(ChecksumError):
        bad.verify()


def test_other_major_version_is_refused_with_a_clear_message() -> None:
    frames = _frames({"v": [2, 0], "type": "reset", "run_id": 1, "tensors": {}})
    with pytest.raises(ProtocolError) as err:
        p.decode(frames)
    assert str(err.value) == "peer speaks flowedge protocol 2.0, this node speaks 1.9"


def test_newer_minor_version_and_unknown_keys_are_accepted() -> None:
    frames = _frames({"v": [1, 10], "type": "reset", "run_id": 1, "future": [1, 2], "tensors": {}})
    assert p.decode(frames) == p.Reset(run_id=1)


@pytest.mark.parametrize("msg", [_segment(), p.Prune(run_id=7, round_id=3, version=4, horizon=42,
                                                     commit_ids=torch.tensor([0, 2]), keep_ids=torch.tensor([1])),
                                 p.Reset(run_id=7), p.RequestDropped(run_id=7, reason="x")], ids=lambda m: m.TYPE)
def test_a_1_8_peer_s_data_plane_message_is_refused_naming_both_versions(msg) -> None:
    """1.9 renamed the engine run's field `request_id` to `run_id`: a 1.8 peer's copy (the old field) is
    refused by its version, not as a message that lacks a field."""
    frames = [bytes(memoryview(f)) for f in msg.to_frames()]
    header = _header(frames)
    header["v"], header["request_id"] = [1, 8], header.pop("run_id")
    with pytest.raises(ProtocolError, match=rf"{msg.TYPE} from a peer speaking flowedge protocol 1\.8, this node "
                                            r"speaks 1\.9: .* 1\.9 or newer"):
        p.decode(_frames(header, *frames[1:]))
    assert p.decode(frames).run_id == 7   # the same message from a 1.9 peer


def test_a_stage_and_a_head_of_different_data_planes_refuse_each_other_naming_both_versions() -> None:
    assert p.PROTOCOL_VERSION == (1, 9)
    assert p.data_plane_refusal((1, 8), "stage") == (
        "stage speaks flowedge protocol 1.8, this node speaks 1.9: the data plane needs 1.9 or newer on both "
        "sides (it names the engine run `run_id`): upgrade the stage")
    assert "head speaks flowedge protocol 1.4, this node speaks 1.9" in p.data_plane_refusal((1, 4), "head")
    assert [p.data_plane_refusal(v, "stage") for v in [(1, 9), (1, 10), (2, 0)]] == [None, None, None]


def test_an_assign_from_a_head_before_1_6_carries_no_model_key() -> None:
    frames = _frames({"v": [1, 5], "type": "assign", "stage_index": 1, "layer_start": 0, "layer_end": 2,
                      "shard_sha256": SHA, "shard_bytes": 1, "next_addr": "", "model": "m", "tensors": {}})
    assert p.decode(frames).model_sha256 == ""


def test_refuse_is_readable_across_major_versions() -> None:
    frames = _frames({"v": [3, 1], "type": "refuse", "reason": "too old", "tensors": {}})
    assert p.decode(frames) == p.Refuse(reason="too old")


def _segment_frames() -> tuple[dict, list[bytes]]:
    frames = [bytes(f) for f in _segment(n=2, with_hidden=False).to_frames()]
    return _header(frames), frames[1:]


@pytest.mark.parametrize(
    ("mutate", "match"),
    [
        (lambda h, t: ([], ), "empty message"),
        (lambda h, t: ([b"\xc1garbage"], ), "not valid msgpack"),
        (lambda h, t: ([msgpack.packb([1, 2])], ), "not a map"),
        (lambda h, t: ([msgpack.packb({1: 2})], ), "not valid msgpack"),
        (lambda h, t: (_frames({**h, "v": "1.0"}, *t), ), "protocol version"),
        (lambda h, t: (_frames({**h, "v": [1]}, *t), ), "protocol version"),
        (lambda h, t: (_frames({**h, "type": "teleport"}, *t), ), "unknown message type"),
        (lambda h, t: (_frames({**h, "type": None}, *t), ), "unknown message type"),
        (lambda h, t: (_frames({k: v for k, v in h.items() if k != "seq"}, *t), ), "missing field 'seq'"),
        (lambda h, t: (_frames({**h, "seq": "one"}, *t), ), "segment.seq"),
        (lambda h, t: (_frames({**h, "kind": ["draft"]}, *t), ), "segment.kind"),
        (lambda h, t: (_frames(h, *t[:-1]), ), "describes 4 tensors, message has 3"),
        (lambda h, t: (_frames(h, *t, b"extra"), ), "describes 4 tensors, message has 5"),
        (lambda h, t: (_frames({**h, "tensors": []}, *t), ), "describes no tensors"),
        (lambda h, t: (_frames(h, t[0] + b"\0", *t[1:]), ), "frame holds"),
        (lambda h, t: (_frames({**h, "tensors": {**h["tensors"], "logits": h["tensors"]["node_ids"]}},
                               *t, t[0]), ), "unknown tensor field"),
        (lambda h, t: (_frames({**h, "tensors": {k: v for k, v in h["tensors"].items() if k != "positions"}},
                               t[0], t[1], t[3]), ), "missing field 'positions'"),
        (lambda h, t: (_frames({**h, "tensors": {**h["tensors"], "node_ids": {"dtype": "int64", "shape": [1]}}},
                               b"\0" * 8, *t[1:]), ), "sent as 'int64'"),
        (lambda h, t: (_frames({**h, "tensors": {**h["tensors"], "node_ids": {"dtype": "int16", "shape": [-2]}}},
                               *t), ), "bad tensor shape"),
        (lambda h, t: (_frames({**h, "tensors": {**h["tensors"], "node_ids": "int16"}}, *t), ), "meta must be a map"),
        (lambda h, t: ([b"\0" * (p.MAX_HEADER_BYTES + 1)], ), "exceeds"),
    ],
)
def test_malformed_input_is_a_one_line_protocol_error(mutate, match: str) -> None:
    header, tensors = _segment_frames()
    (frames,) = mutate(header, tensors)
    with pytest.raises(ProtocolError, match=match) as err:
        p.decode(frames)
    assert "\n" not in str(err.value)


def test_hidden_dtype_must_match_the_declared_wire_dtype() -> None:
    frames = [bytes(f) for f in _segment(n=2, wire="float16").to_frames()]
    header = _header(frames)
    header["hidden_wire"] = "bfloat16"
    with pytest.raises(ProtocolError, match="hidden tensor sent as 'float16'"):
        p.decode(_frames(header, *frames[1:]))


def test_from_frames_checks_the_type() -> None:
    with pytest.raises(ProtocolError, match="expected a prune message, got reset"):
        p.Prune.from_frames(p.Reset(run_id=1).to_frames())


@settings(max_examples=200, deadline=None)
@given(st.lists(st.binary(max_size=64), max_size=4))
def test_random_bytes_never_crash_the_decoder(frames: list[bytes]) -> None:
    try:
        p.decode(frames)
    except ProtocolError:
        pass


_JUNK = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**63), 2**64 - 1) | st.floats() | st.text(max_size=8)
    | st.binary(max_size=8),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=4), inner, max_size=3),
    max_leaves=8,
)


@settings(max_examples=300, deadline=None)
@given(key=st.sampled_from(["v", "type", "run_id", "kind", "hidden_wire", "tensors", "seq"]), junk=_JUNK)
def test_junk_header_values_never_crash_the_decoder(key: str, junk) -> None:
    header, tensors = _segment_frames()
    header[key] = junk
    try:
        p.decode(_frames(header, *tensors))
    except ProtocolError:
        pass
