"""Message codec: the base class every wire message derives from, field validators, encode/decode.

A message is a frozen dataclass; `Message.to_frames` turns its scalar fields into a msgpack header
and its tensor fields (named in `WIRE`) into raw frames; `decode` does the reverse and validates
every field through the dataclass's `__post_init__`, so malformed peer input becomes one
ProtocolError and never a crash. Concrete messages live in msg_control.py, msg_data.py and
msg_client.py (protocol.py gathers them) and register themselves here.
"""
from __future__ import annotations

import math
import re
import sys
from dataclasses import MISSING, fields
from typing import Any, ClassVar, Sequence

import msgpack

from flowedge import errors
from flowedge.core.config import SEGMENT_PHASES
from flowedge.errors import ProtocolError, VersionMismatch
from flowedge.transport.buffers import (
    TOKEN_WIRE_DTYPES,
    as_token_ids,
    frame_buffer,
    frame_to_tokens,
    quote,
    tokens_to_frame,
)

PROTOCOL_VERSION: tuple[int, int] = (1, 9)   # 1.2: token segments from the last stage, head file;
#                                               1.3: prompt messages/stop/raw, Cancel;
#                                               1.4: segment ids unshifted, root_rows (no -1 / +1);
#                                               1.5: the drafter role (msg_draft.py);
#                                               1.6: RequestDropped (a stage tells the head it freed a
#                                                    run), Assign.model_sha256 (the model's content key);
#                                               1.7: PromptRequest.client (whom a gateway asks for:
#                                                    the head's fair queue has one lane per client),
#                                                    StatusRequest.timeline (the head's recent past);
#                                               1.8: the standby role (msg_standby.py: the request log),
#                                                    a fencing term on Welcome and Heartbeat,
#                                                    PromptRequest.resumed (a request moved to a new head),
#                                                    Heartbeat.ping/echo/held_ms (link round trips)
#                                               1.9: the data plane names the engine run `run_id`
#                                                    (Segment, Prune, Reset, RequestDropped; `request_id`
#                                                    before): a 1.8 stage or head is refused at HELLO
MAX_HEADER_BYTES = 1 << 20
SHARD_CHUNK_BYTES = 4 << 20
MAX_SHARD_CHUNK_BYTES = 64 << 20
MAX_LIST_ITEMS = 4096
MAX_TEXT_CHARS = 4096        # free-text fields (reasons, error messages): longer text is cut, not refused
ROLES = ("head", "stage", "client", "drafter", "standby")
# The engine's segment phases (flowedge.engine.events.Segment.phase), one list for both sides.
SEGMENT_KINDS = SEGMENT_PHASES
# float32 exists for exactness tests: 16-bit rounding between stages can flip a greedy near-tie.
HIDDEN_WIRE_NAMES = ("float16", "bfloat16", "float32")
_U64 = (1 << 64) - 1
_SHA256 = re.compile(r"[0-9a-f]{64}")

# Field kinds that travel as raw frames: INDEX -> int16/int32 index set (a torch tensor), HIDDEN ->
# fp16/bf16(/fp32) states, BYTES -> raw bytes, TOKENS -> int16/int32 token ids (a tuple of ints, no torch),
# FLOAT32 -> a float32 tensor of any shape, never rounded (a draft tree's log-scores order its growth).
INDEX, HIDDEN, BYTES, TOKENS, FLOAT32 = "index", "hidden", "bytes", "tokens", "float32"


def is_tensor(value: Any) -> bool:
    """True for a torch tensor, without importing torch (a value can only be one if torch is loaded)."""
    torch = sys.modules.get("torch")
    return torch is not None and isinstance(value, torch.Tensor)


def version_text(version: Sequence[int]) -> str:
    return f"{version[0]}.{version[1]}"


def check_version(peer: Sequence[int]) -> None:
    """ProtocolError unless `peer` has our major version (minor differences are fine)."""
    if peer[0] != PROTOCOL_VERSION[0]:
        raise VersionMismatch(
            f"peer speaks flowedge protocol {version_text(peer)}, "
            f"this node speaks {version_text(PROTOCOL_VERSION)}"
        )


def bounded(text: str, max_chars: int = MAX_TEXT_CHARS) -> str:
    """`text` cut to at most `max_chars` characters (an ellipsis marks the cut). Every error text that
    may quote peer input goes through this before it becomes a Refuse or ErrorReply."""
    return errors.bounded(text, max_chars)


# ---------------------------------------------------------------- validators (raise ProtocolError)
def _fail(msg: Message, name: str, want: str) -> ProtocolError:
    return ProtocolError(f"{msg.TYPE}.{name} must be {want}, got {quote(getattr(msg, name))}")


def too_long(msg: Message, name: str, chars: int, max_chars: int) -> ProtocolError:
    return ProtocolError(f"{msg.TYPE}.{name} is too long: {chars} characters (at most {max_chars})")


def _ints(msg: Message, *names: str, lo: int = 0, hi: int = _U64, optional: bool = False) -> None:
    for name in names:
        v = getattr(msg, name)
        if optional and v is None:
            continue
        if type(v) is not int or not lo <= v <= hi:
            raise _fail(msg, name, f"an int in [{lo}, {hi}]")


def _float(msg: Message, name: str, lo: float, hi: float, optional: bool = False) -> None:
    v = getattr(msg, name)
    if optional and v is None:
        return
    if type(v) not in (int, float) or not (math.isfinite(v) and lo <= v <= hi):
        raise _fail(msg, name, f"a number in [{lo}, {hi}]")
    object.__setattr__(msg, name, float(v))


def _str(msg: Message, name: str, choices: Sequence[str] = (), max_len: int = 4096) -> None:
    v = getattr(msg, name)
    if isinstance(v, str) and len(v) > max_len:
        raise too_long(msg, name, len(v), max_len)
    if not isinstance(v, str) or (choices and v not in choices):
        raise _fail(msg, name, f"one of {list(choices)}" if choices else "a string")


def _text(msg: Message, name: str) -> None:
    """A free-text field (a reason, an error message): must be a string; cut to MAX_TEXT_CHARS instead
    of refused, so a reply quoting a peer's long input can always be built and sent."""
    v = getattr(msg, name)
    if not isinstance(v, str):
        raise _fail(msg, name, "a string")
    object.__setattr__(msg, name, bounded(v))


def _map(msg: Message, name: str, optional: bool = False) -> None:
    v = getattr(msg, name)
    if optional and v is None:
        return
    if not isinstance(v, dict) or not all(isinstance(k, str) for k in v):
        raise _fail(msg, name, "a map with string keys")


def _sha256(msg: Message, name: str) -> None:
    v = getattr(msg, name)
    if not isinstance(v, str) or not _SHA256.fullmatch(v):
        raise _fail(msg, name, "a lowercase hex sha256")


def _index(msg: Message, name: str, n: int | None = None, optional: bool = False) -> int:
    """Validate a 1-D non-negative integer tensor; returns its length."""
    t = getattr(msg, name)
    if optional and t is None:
        return 0
    if not is_tensor(t) or t.is_floating_point() or t.is_complex() or t.dim() != 1 \
            or t.dtype == sys.modules["torch"].bool:
        raise _fail(msg, name, "a 1-D integer tensor")
    if n is not None and t.numel() != n:
        raise _fail(msg, name, f"a tensor of length {n}")
    if t.numel() and not 0 <= int(t.min()) <= int(t.max()) < (1 << 31):
        raise _fail(msg, name, "ids in [0, 2**31)")
    return t.numel()


def _tokens(msg: Message, name: str, optional: bool = False) -> None:
    """Validate token ids (list, tuple, numpy array or torch tensor) and store them as a tuple of ints."""
    v = getattr(msg, name)
    if optional and v is None:
        return
    ids = as_token_ids(v)
    if ids is None:
        raise _fail(msg, name, "a 1-D sequence of token ids in [0, 2**31)")
    object.__setattr__(msg, name, ids)


def _version(msg: Message) -> None:
    v = getattr(msg, "version")
    if not isinstance(v, (tuple, list)) or len(v) != 2 or any(type(x) is not int or x < 0 for x in v):
        raise _fail(msg, "version", "a (major, minor) pair")
    object.__setattr__(msg, "version", tuple(v))


# ---------------------------------------------------------------- base class and codec
# Every concrete message is `@dataclass(**MESSAGE_OPTIONS)`: frozen and keyword-only (a reordered field
# can never silently swap two integers), slotted, compared by identity (tensors have no plain ==).
MESSAGE_OPTIONS: dict[str, bool] = dict(frozen=True, slots=True, kw_only=True, eq=False)
MESSAGE_TYPES: dict[str, type["Message"]] = {}
REFUSE_TYPE = "refuse"  # frozen across major versions


class Message:
    """Base of every wire message: generic header/tensor codec driven by the dataclass fields."""

    __slots__ = ()
    TYPE: ClassVar[str] = ""
    WIRE: ClassVar[dict[str, str]] = {}  # tensor field name -> INDEX | HIDDEN | BYTES
    MIN_MINOR: ClassVar[int] = 0         # oldest minor version whose layout of this message we read

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        if cls.TYPE:  # dataclass(slots=True) re-creates the class: the final one registers last
            MESSAGE_TYPES[cls.TYPE] = cls

    def to_frames(self) -> list[bytes | memoryview]:
        header: dict[str, Any] = {"v": list(PROTOCOL_VERSION), "type": self.TYPE}
        metas: dict[str, dict[str, Any]] = {}
        buffers: list[bytes | memoryview] = []
        for f in fields(self):  # type: ignore[arg-type]
            value = getattr(self, f.name)
            kind = self.WIRE.get(f.name)
            if kind is None:
                header[f.name] = list(value) if isinstance(value, tuple) else value
            elif value is not None:
                metas[f.name], buf = _encode_tensor(self, kind, value)
                buffers.append(buf)
        header["tensors"] = metas
        try:
            packed = msgpack.packb(header, use_bin_type=True)
        except (TypeError, ValueError, OverflowError) as err:
            raise ProtocolError(f"{self.TYPE}: header cannot be packed: {err}") from err
        return [packed, *buffers]

    @classmethod
    def from_frames(cls, frames: Sequence[Any]) -> Message:
        msg = decode(frames)
        if not isinstance(msg, cls):
            raise ProtocolError(f"expected a {cls.TYPE} message, got {msg.TYPE}")
        return msg

    @classmethod
    def _from_header(cls, header: dict[str, Any], frames: Sequence[Any]) -> Message:
        metas = header.get("tensors")
        if not isinstance(metas, dict) or len(metas) != len(frames):
            n = len(metas) if isinstance(metas, dict) else "no"
            raise ProtocolError(f"{cls.TYPE}: header describes {n} tensors, message has {len(frames)}")
        kwargs: dict[str, Any] = {}
        for (name, meta), frame in zip(metas.items(), frames):
            if name not in cls.WIRE:
                raise ProtocolError(f"{cls.TYPE}: unknown tensor field {quote(name)}")
            kwargs[name] = _decode_tensor(cls.TYPE, cls.WIRE[name], meta, frame, header)
        for f in fields(cls):  # type: ignore[arg-type]
            if f.name in cls.WIRE and f.name in kwargs:
                continue
            if f.name in header and f.name not in cls.WIRE:
                kwargs[f.name] = header[f.name]
            elif f.default is MISSING and f.default_factory is MISSING:
                raise ProtocolError(f"{cls.TYPE}: missing field {f.name!r}")
        try:
            return cls(**kwargs)
        except (TypeError, ValueError, OverflowError) as err:  # safety net: peer input never crashes
            raise ProtocolError(bounded(f"{cls.TYPE}: {err}", 512)) from err

    def __eq__(self, other: object) -> bool:
        if type(other) is not type(self):
            return NotImplemented
        names = [f.name for f in fields(self)]  # type: ignore[arg-type]
        return all(_same(getattr(self, n), getattr(other, n)) for n in names)

    __hash__ = None  # type: ignore[assignment]  # tensors inside: equal by value, not hashable


def _same(a: Any, b: Any) -> bool:
    if is_tensor(a) or is_tensor(b):
        return (
            is_tensor(a) and is_tensor(b) and a.dtype == b.dtype and a.shape == b.shape
            and sys.modules["torch"].equal(a, b)
        )
    return bool(a == b)


def _encode_tensor(msg: Message, kind: str, value: Any) -> tuple[dict[str, Any], Any]:
    if kind == TOKENS:
        return tokens_to_frame(value)
    if kind == INDEX:
        from flowedge.transport.frames import index_to_frame

        return index_to_frame(value)
    if kind == HIDDEN:
        from flowedge.transport.frames import WIRE_DTYPES, tensor_to_frame

        return tensor_to_frame(value, WIRE_DTYPES[msg.hidden_wire])  # type: ignore[attr-defined]
    if kind == FLOAT32:
        from flowedge.transport.frames import tensor_to_frame

        return tensor_to_frame(value, sys.modules["torch"].float32)
    view = memoryview(value).cast("B")
    return {"dtype": "uint8", "shape": [len(view)]}, view


def _decode_tensor(msg_type: str, kind: str, meta: Any, frame: Any, header: dict[str, Any]) -> Any:
    if not isinstance(meta, dict):
        raise ProtocolError(f"{msg_type}: tensor meta must be a map")
    dtype = meta.get("dtype")
    allowed = {INDEX: ("int16", "int32"), TOKENS: tuple(TOKEN_WIRE_DTYPES), HIDDEN: (header.get("hidden_wire"),),
               BYTES: ("uint8",), FLOAT32: ("float32",)}[kind]
    if dtype not in allowed:
        raise ProtocolError(f"{msg_type}: {kind} tensor sent as {quote(dtype)}, expected one of {quote(allowed)}")
    if kind == BYTES:
        if meta.get("shape") != [len(frame_buffer(frame))]:
            raise ProtocolError(f"{msg_type}: byte frame length does not match its shape")
        return frame_buffer(frame)
    if kind == TOKENS:
        return frame_to_tokens(meta, frame)
    from flowedge.transport.frames import frame_to_tensor

    t = frame_to_tensor(meta, frame)
    return t.long() if kind == INDEX else t


def _read_header(frames: Sequence[Any]) -> dict[str, Any]:
    if not isinstance(frames, (list, tuple)) or not frames:
        raise ProtocolError("empty message")
    raw = frame_buffer(frames[0])
    if len(raw) > MAX_HEADER_BYTES:
        raise ProtocolError(f"header of {len(raw)} bytes exceeds {MAX_HEADER_BYTES}")
    try:
        header = msgpack.unpackb(raw, raw=False, strict_map_key=True)
    except (ValueError, TypeError, msgpack.UnpackException) as err:
        raise ProtocolError(bounded(f"header is not valid msgpack: {err}", 512)) from err
    if not isinstance(header, dict):
        raise ProtocolError("header is not a map")
    v = header.get("v")
    if not isinstance(v, list) or len(v) != 2 or any(type(x) is not int or x < 0 for x in v):
        raise VersionMismatch("header carries no valid protocol version 'v'")
    if header.get("type") != REFUSE_TYPE:  # a REFUSE is readable across major versions
        check_version(v)
    return header


def decode(frames: Sequence[Any]) -> Message:
    """The message in a received frame list (zmq.Frame, bytes or memoryview); ProtocolError if malformed."""
    header = _read_header(frames)
    kind = header.get("type")
    cls = MESSAGE_TYPES.get(kind) if isinstance(kind, str) else None
    if cls is None:
        raise ProtocolError(f"unknown message type {quote(kind)}")
    if header["v"][0] == PROTOCOL_VERSION[0] and header["v"][1] < cls.MIN_MINOR:
        raise VersionMismatch(f"{kind} from a peer speaking flowedge protocol {version_text(header['v'])}, this "
                              f"node speaks {version_text(PROTOCOL_VERSION)}: it reads {kind} messages of "
                              f"{PROTOCOL_VERSION[0]}.{cls.MIN_MINOR} or newer (upgrade every node of the cluster "
                              f"together)")
    return cls._from_header(header, frames[1:])


def __getattr__(name: str) -> Any:
    # the torch dtype table is the data plane's: loaded on first use, never for a client
    if name == "WIRE_DTYPES":
        from flowedge.transport.frames import WIRE_DTYPES

        return WIRE_DTYPES
    raise AttributeError(name)


def encode(msg: Message) -> list[bytes | memoryview]:
    """The frame list for `msg` (send with copy=False)."""
    return msg.to_frames()


