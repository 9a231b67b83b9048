"""Tensor <-> frame conversion: dtype rules, edge shapes, peer garbage, and no-copy receive."""
from __future__ import annotations

import numpy as np
import pytest
import torch
import zmq

from flowedge.errors import ProtocolError
from flowedge.transport.frames import (
    MAX_TENSOR_BYTES,
    WIRE_DTYPES,
    frame_buffer,
    frame_to_tensor,
    index_to_frame,
    tensor_to_frame,
)

torch.set_num_threads(1)


def _roundtrip(t: torch.Tensor, wire: torch.dtype | None = None) -> torch.Tensor:
    meta, buf = tensor_to_frame(t, wire)
    return frame_to_tensor(meta, bytes(buf))


@pytest.mark.parametrize("name", sorted(WIRE_DTYPES))
def test_every_wire_dtype_round_trips(name: str) -> None:
    dtype = WIRE_DTYPES[name]
    t = (torch.arange(-6, 6) * 3).reshape(3, 4).to(dtype)
    out = _roundtrip(t)
    assert out.dtype == dtype and out.shape == (3, 4)
    assert torch.equal(out, t)


def test_bf16_survives_bit_exact() -> None:
    t = torch.randn(5, 7).to(torch.bfloat16)
    meta, buf = tensor_to_frame(t)
    assert meta == {"dtype": "bfloat16", "shape": [5, 7]}
    assert len(buf) == 5 * 7 * 2
    out = frame_to_tensor(meta, bytes(buf))
    assert torch.equal(out.view(torch.int16), t.view(torch.int16))


@pytest.mark.parametrize("wire", [torch.float16, torch.bfloat16])
def test_hidden_states_travel_in_the_wire_dtype(wire: torch.dtype) -> None:
    t = torch.randn(4, 6, dtype=torch.float32)
    meta, buf = tensor_to_frame(t, wire)
    assert meta["dtype"] == str(wire).removeprefix("torch.")
    assert len(buf) == 4 * 6 * 2
    assert torch.equal(frame_to_tensor(meta, bytes(buf)), t.to(wire))


def test_integer_tensors_are_not_cast_by_the_hidden_dtype() -> None:
    meta, _ = tensor_to_frame(torch.arange(3, dtype=torch.int32), torch.float16)
    assert meta["dtype"] == "int32"


def test_bad_hidden_wire_dtype_is_refused() -> None:
    with pytest.raises(ProtocolError, match="float16, bfloat16 or float32"):
        tensor_to_frame(torch.zeros(2), torch.float64)


@pytest.mark.parametrize("shape", [(0,), (0, 1536), (3, 0, 2), ()])
def test_empty_and_scalar_tensors(shape: tuple[int, ...]) -> None:
    t = torch.ones(shape, dtype=torch.float16)
    out = _roundtrip(t)
    assert out.shape == t.shape and out.dtype == t.dtype and torch.equal(out, t)


def test_non_contiguous_input_is_made_contiguous() -> None:
    base = torch.arange(24, dtype=torch.float32).reshape(4, 6)
    t = base.t()[1:, ::2]
    assert not t.is_contiguous()
    meta, buf = tensor_to_frame(t)
    assert meta["shape"] == [5, 2]
    assert torch.equal(frame_to_tensor(meta, bytes(buf)), t)


def test_contiguous_cpu_tensor_is_not_copied_on_send() -> None:
    t = torch.arange(64, dtype=torch.float16)
    _, buf = tensor_to_frame(t)
    assert np.frombuffer(buf, np.uint8).ctypes.data == t.data_ptr()


def test_index_sets_use_int16_when_they_fit() -> None:
    meta, buf = index_to_frame(torch.tensor([0, 5, 32767], dtype=torch.int64))
    assert meta == {"dtype": "int16", "shape": [3]} and len(buf) == 6
    meta, _ = index_to_frame(torch.tensor([-32768, 1]))
    assert meta["dtype"] == "int16"


def test_index_sets_use_int32_beyond_int16() -> None:
    ids = torch.tensor([1, 151_935, 32768])
    meta, buf = index_to_frame(ids)
    assert meta["dtype"] == "int32" and len(buf) == 12
    assert torch.equal(frame_to_tensor(meta, bytes(buf)).long(), ids)


def test_empty_index_set_is_int16() -> None:
    meta, buf = index_to_frame(torch.empty(0, dtype=torch.int64))
    assert meta == {"dtype": "int16", "shape": [0]} and len(buf) == 0


@pytest.mark.parametrize(
    "ids",
    [torch.tensor([1 << 31]), torch.tensor([0.5]), torch.tensor([[1, 2]]), torch.tensor([True])],
)
def test_index_sets_never_go_int64_or_float(ids: torch.Tensor) -> None:
    with pytest.raises(ProtocolError):
        index_to_frame(ids)


@pytest.mark.parametrize(
    ("meta", "frame", "match"),
    [
        ({"dtype": "float16", "shape": [4]}, b"\0" * 7, "needs 8"),
        ({"dtype": "float16", "shape": [-1]}, b"\0" * 2, "bad tensor shape"),
        ({"dtype": "float16", "shape": [2.0]}, b"\0" * 4, "bad tensor shape"),
        ({"dtype": "float16", "shape": [True]}, b"\0" * 2, "bad tensor shape"),
        ({"dtype": "float32", "shape": [1 << 20, 1 << 20]}, b"", "exceeds"),
        ({"dtype": "complex64", "shape": [1]}, b"\0" * 8, "unknown tensor dtype"),
        ({"dtype": None, "shape": [1]}, b"\0", "unknown tensor dtype"),
        ({"dtype": "uint8", "shape": [1] * 9}, b"\0", "at most"),
        ({"dtype": "uint8", "shape": "1"}, b"\0", "list"),
        (["uint8", [1]], b"\0", "map"),
        ({"dtype": "uint8", "shape": [1]}, 12345, "buffer"),
    ],
)
def test_malformed_meta_is_a_protocol_error(meta, frame, match: str) -> None:
    with pytest.raises(ProtocolError, match=match):
        frame_to_tensor(meta, frame)


def test_cap_is_one_gib() -> None:
    assert MAX_TENSOR_BYTES == 1 << 30
    with pytest.raises(ProtocolError, match="exceeds"):
        frame_to_tensor({"dtype": "uint8", "shape": [1 << 15, (1 << 15) + 1]}, b"")


def test_read_only_buffer_gives_a_writable_tensor() -> None:
    out = frame_to_tensor({"dtype": "int16", "shape": [2]}, b"\x01\x00\x02\x00")
    out += 1  # must not raise nor write into immutable bytes
    assert out.tolist() == [2, 3]


def test_misaligned_buffer_is_copied_to_aligned_memory() -> None:
    raw = bytearray(1 + 8 * 4)
    raw[1:] = np.arange(8, dtype=np.float32).tobytes()
    view = memoryview(raw)[1:]
    out = frame_to_tensor({"dtype": "float32", "shape": [8]}, view)
    assert out.data_ptr() % 4 == 0
    assert out.tolist() == list(range(8))


def test_received_tensor_shares_memory_with_the_zmq_frame() -> None:
    ctx = zmq.Context()
    a, b = ctx.socket(zmq.PAIR), ctx.socket(zmq.PAIR)
    try:
        port = a.bind_to_random_port("tcp://127.0.0.1")
        b.connect(f"tcp://127.0.0.1:{port}")
        t = torch.randn(512, 512).to(torch.float16)  # 512 KiB
        meta, buf = tensor_to_frame(t)
        a.send_multipart([b"meta", buf], copy=False)
        assert b.poll(5000)
        frames = b.recv_multipart(copy=False)
        out = frame_to_tensor(meta, frames[1])
        start = np.frombuffer(frame_buffer(frames[1]), np.uint8).ctypes.data
        assert start <= out.data_ptr() < start + len(frames[1].buffer)
        assert torch.equal(out, t)
    finally:
        a.close(0)
        b.close(0)
        ctx.term()
