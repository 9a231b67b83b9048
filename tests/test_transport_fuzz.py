"""Property-based fuzzing of the decoder: random, truncated, mutated, wrong-version, oversized and
schema-shaped frames. The decoder may only ever answer with a message or a short ProtocolError, and
every error can be quoted in a reply (the 5 KB `type` that once ended the head). The same holds past
the decoder, through the adapter to the engine's events (node/wire.py)."""
from __future__ import annotations

import os
import random
from dataclasses import fields

import msgpack
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from flowedge.errors import ProtocolError
from flowedge.node import wire
from flowedge.transport import protocol as p

from stage_fuzz_helpers import random_message
from test_transport_protocol import SAMPLES

MAX_ERROR_CHARS = 1024
FUZZ = settings(deadline=None, suppress_health_check=list(HealthCheck))
# mutated frames through decode and the wire adapter: 2,000 in CI (the same ones every run); by hand,
# e.g. FLOWEDGE_FUZZ_FRAMES=20000
ADAPTER_FRAMES = int(os.environ.get("FLOWEDGE_FUZZ_FRAMES", "2000"))
DATA_PLANE = [s for s in SAMPLES if isinstance(s, (p.Segment, p.Prune, p.Reset))]


def _decode_or_error(frames) -> p.Message | None:
    """Decode; a ProtocolError must be short and fit in the replies a node builds from it."""
    try:
        msg = p.decode(frames)
    except ProtocolError as err:
        assert len(str(err)) <= MAX_ERROR_CHARS, str(err)[:200]
        p.ErrorReply(request_id=0, message=f"malformed message: {err}").to_frames()
        p.Refuse(reason=str(err)).to_frames()
        return None
    p.encode(msg)   # what decodes can be sent on
    return msg


# ---- random frames ---------------------------------------------------------------------------------
@settings(FUZZ, max_examples=3500)
@given(st.lists(st.binary(max_size=96), max_size=5))
def test_fuzz_random_frames(frames):
    _decode_or_error(frames)


# ---- headers shaped like real messages, with random values -----------------------------------------
_SCALAR = (st.none() | st.booleans() | st.integers(-(2**63), 2**64 - 1) | st.floats(allow_nan=True)
           | st.text(max_size=12) | st.just("t" * 5000) | st.binary(max_size=16))
_VALUE = st.recursive(_SCALAR, lambda inner: st.lists(inner, max_size=3)
                      | st.dictionaries(st.text(max_size=6), inner, max_size=3), max_leaves=6)
_META = st.fixed_dictionaries({"dtype": st.sampled_from(["int16", "int32", "float16", "bfloat16", "float32",
                                                         "uint8", "int64", "bogus"]),
                               "shape": st.lists(st.integers(-2, 9), max_size=3)})
_TYPES = sorted(p.MESSAGE_TYPES)


@st.composite
def schema_frames(draw):
    """A header naming a real message type, with its fields present or missing and values of any type
    (often the right one), a version that is sometimes wrong, and tensor frames of random bytes."""
    kind = draw(st.sampled_from(_TYPES) | st.text(max_size=8) | st.just("x" * 5000))
    cls = p.MESSAGE_TYPES.get(kind)
    version = draw(st.sampled_from([list(p.PROTOCOL_VERSION), [1, 2], [1, 0], [1, 9], [2, 0], [0, 1]]) | _VALUE)
    header = {"v": version, "type": kind}
    names = [f.name for f in fields(cls)] if cls is not None else []
    for name in names:
        if name in cls.WIRE or draw(st.booleans()) and draw(st.booleans()):
            continue   # tensor fields go to "tensors"; some scalar fields go missing
        header[name] = draw(st.integers(0, 40) | st.sampled_from(["draft", "prefill", "float16", "stage"]) | _VALUE)
    tensors = {name: draw(_META) for name in (cls.WIRE if cls is not None else ()) if draw(st.booleans())}
    header["tensors"] = draw(st.just(tensors) | _VALUE)
    n = len(tensors) if draw(st.integers(0, 3)) else draw(st.integers(0, 3))
    return [msgpack.packb(header, use_bin_type=True), *draw(st.lists(st.binary(max_size=64), min_size=n,
                                                                     max_size=n))]


@settings(FUZZ, max_examples=4000)
@given(schema_frames())
def test_fuzz_schema_shaped_headers(frames):
    _decode_or_error(frames)


def test_a_long_hidden_wire_name_is_not_quoted_whole_in_the_error():
    """Regression (found by the fuzzer above in CI): a segment whose header names a 5,000-character hidden
    wire dtype was refused with an error quoting that name whole."""
    seg = next(s for s in SAMPLES if isinstance(s, p.Segment) and s.hidden is not None)
    frames = [bytes(memoryview(f).cast("B")) for f in p.encode(seg)]
    header = msgpack.unpackb(frames[0])
    header["hidden_wire"] = "t" * 5000
    with pytest.raises(ProtocolError) as err:
        p.decode([msgpack.packb(header), *frames[1:]])
    assert len(str(err.value)) <= MAX_ERROR_CHARS


# ---- real messages, truncated or mutated -------------------------------------------------------------
@settings(FUZZ, max_examples=3000)
@given(sample=st.sampled_from(SAMPLES), frame=st.integers(0, 3), cut=st.integers(0, 400),
       flips=st.lists(st.tuples(st.integers(0, 400), st.integers(0, 255)), max_size=4),
       extra=st.lists(st.binary(max_size=16), max_size=2), drop_last=st.booleans())
def test_fuzz_truncated_and_mutated_messages(sample, frame, cut, flips, extra, drop_last):
    frames = [bytearray(memoryview(f).cast("B")) for f in p.encode(sample)]
    target = frames[frame % len(frames)]
    del target[cut % (len(target) + 1):]
    for at, byte in flips:
        if target:
            target[at % len(target)] = byte
    frames = frames[:-1] if drop_last and len(frames) > 1 else frames
    _decode_or_error([bytes(f) for f in frames] + extra)


@settings(FUZZ, max_examples=ADAPTER_FRAMES, derandomize=True)
@given(sample=st.sampled_from(DATA_PLANE), frame=st.integers(0, 7), cut=st.none() | st.integers(0, 400),
       flips=st.lists(st.tuples(st.integers(0, 400), st.integers(0, 255)), min_size=1, max_size=4))
def test_fuzz_mutated_frames_through_the_wire_adapter(sample, frame, cut, flips):
    """What decodes from a mutated data-plane frame either becomes an engine event or is one short
    ProtocolError: a Prune whose ids pass its horizon was a ValueError out of `wire.from_wire`."""
    frames = [bytearray(memoryview(f).cast("B")) for f in p.encode(sample)]
    target = frames[frame % len(frames)]
    if cut is not None:
        del target[cut % (len(target) + 1):]
    for at, byte in flips:
        if target:
            target[at % len(target)] = byte
    msg = _decode_or_error([bytes(f) for f in frames])
    if msg is None:
        return
    try:
        wire.from_wire(msg, torch.float32)
    except ProtocolError as err:
        assert len(str(err)) <= MAX_ERROR_CHARS
        p.ErrorReply(request_id=0, message=f"malformed message: {err}").to_frames()


def test_an_oversized_header_is_refused_before_parsing():
    frames = [msgpack.packb({"v": [1, 2], "type": "reset", "pad": "x" * (p.MAX_HEADER_BYTES + 1)})]
    assert _decode_or_error(frames) is None


@pytest.mark.parametrize("version", [[2, 0], [0, 9], [99, 99]])
def test_every_message_of_another_major_version_is_refused(version):
    for sample in SAMPLES:
        header = msgpack.unpackb(bytes(memoryview(p.encode(sample)[0])), raw=False)
        header["v"] = version
        frames = [msgpack.packb(header), *p.encode(sample)[1:]]
        if sample.TYPE == "refuse":
            assert _decode_or_error(frames) == sample   # frozen forever: readable across versions
        else:
            assert _decode_or_error(frames) is None


def _mutate(rng: random.Random, frames: list[bytearray]) -> list[bytes]:
    """One frame cut short or not, one to four bytes overwritten, sometimes a frame dropped or added."""
    target = frames[rng.randrange(len(frames))]
    if rng.random() < 0.3:
        del target[rng.randrange(len(target) + 1):]
    for _ in range(rng.randint(1, 4)):
        if target:
            target[rng.randrange(len(target))] = rng.randrange(256)
    out = [bytes(f) for f in frames]
    if len(out) > 1 and rng.random() < 0.05:
        out.pop(rng.randrange(1, len(out)))
    if rng.random() < 0.05:
        out.append(rng.randbytes(rng.randrange(16)))
    return out


def test_twenty_thousand_mutated_frames_end_as_an_event_or_a_protocol_error():
    """20,000 mutated frames of every message type and of random data-plane messages (ids past a prune's
    horizon, roots past a segment's nodes, wrong widths: what once left `wire.from_wire` as a ValueError),
    seeded, through decode and the wire adapter: each ends as a message (and an engine event, or none for
    a control message) or a short ProtocolError. Anything else is counted and fails the test."""
    rng, other, ends = random.Random(20000), [], {"event": 0, "refused": 0}
    for n in range(20000):
        base = (SAMPLES[n % len(SAMPLES)] if n % 2 else random_message(rng, 8)) or SAMPLES[0]
        frames = _mutate(rng, [bytearray(memoryview(f).cast("B")) for f in p.encode(base)])
        try:
            msg = p.decode(frames)
            wire.from_wire(msg, torch.float32)
            ends["event"] += 1
        except ProtocolError as err:
            assert len(str(err)) <= MAX_ERROR_CHARS
            ends["refused"] += 1
        except Exception as err:  # noqa: BLE001 - the point is to count whatever is not a ProtocolError
            other.append((n, base.TYPE, type(err).__name__, str(err)[:120]))
    assert other == [], other[:10]
    assert min(ends.values()) > 1000, ends   # both ends are reached: the mutations are neither all fatal nor all benign
