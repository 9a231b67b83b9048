"""Tensor <-> raw frame conversion: the only place tensor bytes meet the wire.

A tensor travels as a small `meta` dict (``{"dtype": "float16", "shape": [16, 1536]}``) that goes into
the msgpack header, plus one raw buffer frame that ZeroMQ sends without copying or pickling.

Why these rules:
- Hidden states always travel in fp16 or bf16, whatever the compute dtype, to halve the bytes on slow
  edge links. numpy has no bf16, so a bf16 tensor is exposed to ZeroMQ through an int16 view (same bytes).
- Index sets (node ids, prune sets, positions, token ids) are small and travel as int16 when every value
  fits, else int32; int64 would double or quadruple the bytes for nothing.
- A received tensor is a `torch.frombuffer` view of the ZeroMQ frame (no copy) when the frame's memory
  is writable and aligned for the dtype. libzmq carves small messages out of a shared receive buffer at
  arbitrary offsets, so a misaligned buffer (or a read-only one, e.g. `bytes`) is copied once instead.
"""
from __future__ import annotations

import math
from typing import Any

import numpy as np
import torch

from flowedge.errors import ProtocolError
from flowedge.transport.buffers import MAX_DIMS, MAX_TENSOR_BYTES, frame_buffer, quote

__all__ = [
    "MAX_TENSOR_BYTES",
    "MAX_DIMS",
    "WIRE_DTYPES",
    "HIDDEN_WIRE_DTYPES",
    "tensor_to_frame",
    "index_to_frame",
    "frame_to_tensor",
    "frame_buffer",
    "dtype_name",
]

WIRE_DTYPES: dict[str, torch.dtype] = {
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "float32": torch.float32,
    "int8": torch.int8,
    "uint8": torch.uint8,
    "int16": torch.int16,
    "int32": torch.int32,
    "int64": torch.int64,
}
_NAMES = {dtype: name for name, dtype in WIRE_DTYPES.items()}
HIDDEN_WIRE_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
_INT16 = (-(1 << 15), (1 << 15) - 1)
_INT32 = (-(1 << 31), (1 << 31) - 1)


def dtype_name(dtype: torch.dtype) -> str:
    """The wire name of a dtype; ProtocolError for dtypes that never go on the wire."""
    name = _NAMES.get(dtype)
    if name is None:
        raise ProtocolError(f"dtype {dtype} cannot go on the wire")
    return name


def _as_buffer(t: torch.Tensor) -> memoryview:
    """A byte memoryview over a contiguous CPU tensor, sharing its memory (keeps the tensor alive)."""
    if t.dtype == torch.bfloat16:
        t = t.view(torch.int16)  # numpy has no bf16: same 2-byte elements, different name
    return t.reshape(-1).numpy().data.cast("B")  # 1-D: memoryview cannot cast 0-sized N-D views


def tensor_to_frame(
    t: torch.Tensor, hidden_wire_dtype: torch.dtype | None = None
) -> tuple[dict[str, Any], memoryview]:
    """(meta, buffer) for one tensor; floating tensors are cast to `hidden_wire_dtype` when given.

    The buffer shares memory with the (contiguous, CPU, maybe cast) tensor: do not modify the tensor
    in place until ZeroMQ has sent it.
    """
    if not isinstance(t, torch.Tensor):
        raise ProtocolError(f"expected a tensor, got {type(t).__name__}")
    if hidden_wire_dtype is not None and hidden_wire_dtype not in HIDDEN_WIRE_DTYPES:
        raise ProtocolError(f"hidden states travel as float16, bfloat16 or float32, not {hidden_wire_dtype}")
    t = t.detach()
    if hidden_wire_dtype is not None and t.is_floating_point():
        t = t.to(hidden_wire_dtype)
    name = dtype_name(t.dtype)
    t = t.cpu().contiguous()  # no-op (no copy) when already contiguous on the CPU
    return {"dtype": name, "shape": list(t.shape)}, _as_buffer(t)


def index_to_frame(ids: torch.Tensor) -> tuple[dict[str, Any], memoryview]:
    """(meta, buffer) for a 1-D integer index set as int16 when every value fits, else int32."""
    # ids: [n] any integer dtype
    if not isinstance(ids, torch.Tensor) or ids.is_floating_point() or ids.is_complex():
        raise ProtocolError("an index set must be an integer tensor")
    if ids.dtype == torch.bool or ids.dim() != 1:
        raise ProtocolError(f"an index set must be 1-D integers, got {ids.dtype} {list(ids.shape)}")
    lo, hi = (int(ids.min()), int(ids.max())) if ids.numel() else (0, 0)
    if _INT16[0] <= lo and hi <= _INT16[1]:
        wire = torch.int16
    elif _INT32[0] <= lo and hi <= _INT32[1]:
        wire = torch.int32
    else:
        raise ProtocolError(f"index values [{lo}, {hi}] do not fit int32")
    return tensor_to_frame(ids.to(wire))


def _check_meta(meta: Any) -> tuple[torch.dtype, list[int], int]:
    """Validate a peer's tensor meta; returns (dtype, shape, nbytes)."""
    if not isinstance(meta, dict):
        raise ProtocolError("tensor meta must be a map")
    name = meta.get("dtype")
    dtype = WIRE_DTYPES.get(name) if isinstance(name, str) else None
    if dtype is None:
        raise ProtocolError(f"unknown tensor dtype {quote(name)}")
    shape = meta.get("shape")
    if not isinstance(shape, list) or len(shape) > MAX_DIMS:
        raise ProtocolError(f"tensor shape must be a list of at most {MAX_DIMS} sizes")
    if not all(type(d) is int and 0 <= d <= MAX_TENSOR_BYTES for d in shape):
        raise ProtocolError(f"bad tensor shape {shape!r}")
    nbytes = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
    if nbytes > MAX_TENSOR_BYTES:
        raise ProtocolError(f"tensor of {nbytes} bytes exceeds the {MAX_TENSOR_BYTES}-byte cap")
    return dtype, shape, nbytes


def frame_to_tensor(meta: Any, frame: Any) -> torch.Tensor:
    """The tensor described by a peer's `meta` over `frame`, sharing the frame's memory when it can."""
    dtype, shape, nbytes = _check_meta(meta)
    view = frame_buffer(frame)
    if len(view) != nbytes:
        raise ProtocolError(f"frame holds {len(view)} bytes, {meta['dtype']}{shape} needs {nbytes}")
    if nbytes == 0:
        return torch.empty(shape, dtype=dtype)  # frombuffer refuses empty buffers
    itemsize = torch.empty((), dtype=dtype).element_size()
    address = np.frombuffer(view, dtype=np.uint8).ctypes.data
    if view.readonly or address % itemsize:
        view = memoryview(bytearray(view))  # one copy: immutable or misaligned memory
    return torch.frombuffer(view, dtype=dtype).view(shape)
