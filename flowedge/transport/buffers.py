"""Torch-free frame helpers: byte views of received frames, and token-id lists as compact frames.

Client messages (a prompt's token ids, the tokens of an answer) use these so that a gateway that only
sends text never imports torch; the data plane's tensors (hidden states, index sets) go through
frames.py. The wire layout is the same either way: int16 when every id fits, else int32.
"""
from __future__ import annotations

from typing import Any

import numpy as np

from flowedge import errors
from flowedge.errors import ProtocolError

# A peer cannot make us allocate more than this for one tensor.
MAX_TENSOR_BYTES = 1 << 30
MAX_DIMS = 8
TOKEN_WIRE_DTYPES = {"int16": np.int16, "int32": np.int32}
_INT16_MAX = (1 << 15) - 1
_INT31_LIMIT = 1 << 31
MAX_QUOTE_CHARS = 60         # how much of a peer's value an error message quotes


def quote(value: Any) -> str:
    """A short repr of a peer's value for an error message (frames.py and codec.py both quote)."""
    return errors.bounded(repr(value), MAX_QUOTE_CHARS)


def frame_buffer(frame: Any) -> memoryview:
    """A flat byte view of a received frame: a zmq.Frame (copy=False), bytes, bytearray or memoryview."""
    buf = getattr(frame, "buffer", frame)  # zmq.Frame exposes its message memory as .buffer
    try:
        view = memoryview(buf)
    except TypeError as err:
        raise ProtocolError(f"a frame must be a buffer, got {type(frame).__name__}") from err
    if view.ndim != 1 or view.itemsize != 1:
        view = view.cast("B") if view.c_contiguous else memoryview(view.tobytes())
    return view


def as_token_ids(value: Any) -> tuple[int, ...] | None:
    """`value` (list, tuple, numpy array or torch tensor of ints) as a tuple of ids in [0, 2**31);
    None when it is not a 1-D sequence of such ints."""
    if hasattr(value, "tolist") and getattr(value, "ndim", 1) == 1:
        value = value.tolist()   # numpy / torch: python ints (floats stay floats and are refused)
    if not isinstance(value, (list, tuple)):
        return None
    if not all(type(v) is int and 0 <= v < _INT31_LIMIT for v in value):
        return None
    return tuple(value)


def tokens_to_frame(ids: tuple[int, ...]) -> tuple[dict[str, Any], memoryview]:
    """(meta, buffer) for validated token ids: int16 when every id fits, else int32."""
    name = "int16" if max(ids, default=0) <= _INT16_MAX else "int32"
    arr = np.asarray(ids, dtype=TOKEN_WIRE_DTYPES[name])
    return {"dtype": name, "shape": [len(ids)]}, arr.data.cast("B")


def frame_to_tokens(meta: dict[str, Any], frame: Any) -> tuple[int, ...]:
    """The token ids a peer sent as `meta` + `frame` (dtype already checked against the field's kind)."""
    dtype = TOKEN_WIRE_DTYPES[meta["dtype"]]
    shape = meta.get("shape")
    if not isinstance(shape, list) or len(shape) != 1 or type(shape[0]) is not int or shape[0] < 0:
        raise ProtocolError(f"token ids must have a 1-D shape, got {shape!r}")
    view = frame_buffer(frame)
    nbytes = shape[0] * np.dtype(dtype).itemsize
    if nbytes > MAX_TENSOR_BYTES or len(view) != nbytes:
        raise ProtocolError(f"frame holds {len(view)} bytes, {meta['dtype']}{shape} needs {nbytes}")
    return tuple(np.frombuffer(view, dtype=dtype).tolist())
