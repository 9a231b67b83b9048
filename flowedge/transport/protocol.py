"""Wire messages: protocol constants and one frozen, self-validating dataclass per message type.

Frame layout of every message (see frames.py for the tensor rules):

    frame 0   msgpack map {"v": [major, minor], "type": "<TYPE>", <scalar fields...>,
                           "tensors": {"<field>": {"dtype": ..., "shape": [...]}, ...}}
    frame 1.. one raw buffer per tensor field that is present, in the order of "tensors"

Compatibility: every header carries "v". A receiver refuses a different MAJOR version on any message
(ProtocolError "peer speaks flowedge protocol 2.0, this node speaks 1.0"); a newer minor may add
fields with defaults, and unknown header keys are ignored. `Refuse` is frozen forever ({"reason"}), so
it is decoded whatever the major version and a refused peer can always read why.

Topology: the head (node 0) feeds stage 1; stage k forwards to stage k+1; the last stage returns
hidden states to the head. Control messages (HELLO/ASSIGN/SHARD/READY/HEARTBEAT) go stage <-> head,
client messages client <-> head.

Round restarts are folded into `Prune` (there is no NewRound): a Prune whose round_id is newer than
the stage's current round commits `commit_ids` into the prefix and keeps only `keep_ids` of the tree.
One message means a restart can never overtake or be overtaken by its own prune set.

Messages are keyword-only, so a reordered field can never silently swap two integers. Index tensors
(node ids, positions, prune sets, token ids) may be any integer dtype when built locally, travel as
int16/int32 and are decoded as int64. Hidden states are decoded in their wire dtype (fp16/bf16)
without a copy; cast them to the compute dtype. Never modify a tensor in place after sending it.
"""
from __future__ import annotations

import hashlib
import math
import re
from dataclasses import MISSING, dataclass, field, fields
from typing import Any, ClassVar, Sequence

import msgpack
import torch

from flowedge.errors import ChecksumError, ProtocolError
from flowedge.transport.frames import (
    WIRE_DTYPES,
    frame_buffer,
    frame_to_tensor,
    index_to_frame,
    tensor_to_frame,
)

PROTOCOL_VERSION: tuple[int, int] = (1, 0)
MAX_HEADER_BYTES = 1 << 20
SHARD_CHUNK_BYTES = 4 << 20
MAX_SHARD_CHUNK_BYTES = 64 << 20
MAX_LIST_ITEMS = 4096
ROLES = ("head", "stage", "client")
SEGMENT_KINDS = ("prefill", "draft", "expansion")
HIDDEN_WIRE_NAMES = ("float16", "bfloat16")
_U64 = (1 << 64) - 1
_SHA256 = re.compile(r"[0-9a-f]{64}")

# Tensor field kinds: INDEX -> int16/int32 index set, HIDDEN -> fp16/bf16 states, BYTES -> raw bytes.
INDEX, HIDDEN, BYTES = "index", "hidden", "bytes"


def version_text(version: Sequence[int]) -> str:
    return f"{version[0]}.{version[1]}"


def check_version(peer: Sequence[int]) -> None:
    """ProtocolError unless `peer` has our major version (minor differences are fine)."""
    if peer[0] != PROTOCOL_VERSION[0]:
        raise ProtocolError(
            f"peer speaks flowedge protocol {version_text(peer)}, "
            f"this node speaks {version_text(PROTOCOL_VERSION)}"
        )


# ---------------------------------------------------------------- validators (raise ProtocolError)
def _fail(msg: Message, name: str, want: str) -> ProtocolError:
    value = repr(getattr(msg, name))
    return ProtocolError(f"{msg.TYPE}.{name} must be {want}, got {value[:60]}")


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
    if not isinstance(v, str) or len(v) > max_len or (choices and v not in choices):
        raise _fail(msg, name, f"one of {list(choices)}" if choices else "a string")


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
    if (
        not isinstance(t, torch.Tensor)
        or t.is_floating_point()
        or t.is_complex()
        or t.dtype == torch.bool
        or t.dim() != 1
    ):
        raise _fail(msg, name, "a 1-D integer tensor")
    if n is not None and t.numel() != n:
        raise _fail(msg, name, f"a tensor of length {n}")
    if t.numel() and not 0 <= int(t.min()) <= int(t.max()) < (1 << 31):
        raise _fail(msg, name, "ids in [0, 2**31)")
    return t.numel()


def _version(msg: Message) -> None:
    v = msg.version
    if not isinstance(v, (tuple, list)) or len(v) != 2 or any(type(x) is not int or x < 0 for x in v):
        raise _fail(msg, "version", "a (major, minor) pair")
    object.__setattr__(msg, "version", tuple(v))


# ---------------------------------------------------------------- base class and codec
class Message:
    """Base of every wire message: generic header/tensor codec driven by the dataclass fields."""

    __slots__ = ()
    TYPE: ClassVar[str] = ""
    WIRE: ClassVar[dict[str, str]] = {}  # tensor field name -> INDEX | HIDDEN | BYTES

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
                raise ProtocolError(f"{cls.TYPE}: unknown tensor field {name!r}")
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
            raise ProtocolError(f"{cls.TYPE}: {err}") from err

    def __eq__(self, other: object) -> bool:
        if type(other) is not type(self):
            return NotImplemented
        names = [f.name for f in fields(self)]  # type: ignore[arg-type]
        return all(_same(getattr(self, n), getattr(other, n)) for n in names)

    __hash__ = None  # type: ignore[assignment]  # tensors inside: equal by value, not hashable


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return (
            isinstance(a, torch.Tensor)
            and isinstance(b, torch.Tensor)
            and a.dtype == b.dtype
            and a.shape == b.shape
            and torch.equal(a, b)
        )
    return bool(a == b)


def _encode_tensor(msg: Message, kind: str, value: Any) -> tuple[dict[str, Any], Any]:
    if kind == INDEX:
        return index_to_frame(value)
    if kind == HIDDEN:
        return tensor_to_frame(value, WIRE_DTYPES[msg.hidden_wire])  # type: ignore[attr-defined]
    view = memoryview(value).cast("B")
    return {"dtype": "uint8", "shape": [len(view)]}, view


def _decode_tensor(msg_type: str, kind: str, meta: Any, frame: Any, header: dict[str, Any]) -> Any:
    if not isinstance(meta, dict):
        raise ProtocolError(f"{msg_type}: tensor meta must be a map")
    dtype = meta.get("dtype")
    allowed = {INDEX: ("int16", "int32"), HIDDEN: (header.get("hidden_wire"),), BYTES: ("uint8",)}[kind]
    if dtype not in allowed:
        raise ProtocolError(f"{msg_type}: {kind} tensor sent as {dtype!r}, expected one of {allowed}")
    if kind == BYTES:
        if meta.get("shape") != [len(frame_buffer(frame))]:
            raise ProtocolError(f"{msg_type}: byte frame length does not match its shape")
        return frame_buffer(frame)
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
        raise ProtocolError(f"header is not valid msgpack: {err}") from err
    if not isinstance(header, dict):
        raise ProtocolError("header is not a map")
    v = header.get("v")
    if not isinstance(v, list) or len(v) != 2 or any(type(x) is not int or x < 0 for x in v):
        raise ProtocolError("header carries no valid protocol version 'v'")
    if header.get("type") != Refuse.TYPE:  # a REFUSE is readable across major versions
        check_version(v)
    return header


def decode(frames: Sequence[Any]) -> Message:
    """The message in a received frame list (zmq.Frame, bytes or memoryview); ProtocolError if malformed."""
    header = _read_header(frames)
    kind = header.get("type")
    cls = MESSAGE_TYPES.get(kind) if isinstance(kind, str) else None
    if cls is None:
        raise ProtocolError(f"unknown message type {kind!r}")
    return cls._from_header(header, frames[1:])


def encode(msg: Message) -> list[bytes | memoryview]:
    """The frame list for `msg` (send with copy=False)."""
    return msg.to_frames()


_MSG = dict(frozen=True, slots=True, kw_only=True, eq=False)


# ---------------------------------------------------------------- control plane
@dataclass(**_MSG)
class Hello(Message):
    """First message of every connection: who I am and what I can hold."""

    TYPE: ClassVar[str] = "hello"
    node_id: str
    role: str
    device: str
    free_memory_bytes: int
    version: tuple[int, int] = PROTOCOL_VERSION
    capabilities: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        _str(self, "node_id", max_len=256)
        _str(self, "role", ROLES)
        _str(self, "device", max_len=256)
        _ints(self, "free_memory_bytes")
        _version(self)
        _map(self, "capabilities")


@dataclass(**_MSG)
class Welcome(Message):
    """The head admits a peer: its own identity, version and the heartbeat period it expects."""

    TYPE: ClassVar[str] = "welcome"
    node_id: str
    heartbeat_interval_ms: int
    version: tuple[int, int] = PROTOCOL_VERSION

    def __post_init__(self) -> None:
        _str(self, "node_id", max_len=256)
        _ints(self, "heartbeat_interval_ms", lo=1)
        _version(self)


@dataclass(**_MSG)
class Refuse(Message):
    """The head turns a peer away. Layout frozen across major versions: {"reason": str}."""

    TYPE: ClassVar[str] = "refuse"
    reason: str

    def __post_init__(self) -> None:
        _str(self, "reason")


@dataclass(**_MSG)
class Assign(Message):
    """Head -> joining stage: the layer range [layer_start, layer_end) it serves and where to forward."""

    TYPE: ClassVar[str] = "assign"
    stage_index: int
    layer_start: int
    layer_end: int
    shard_sha256: str
    shard_bytes: int
    next_addr: str
    model: str

    def __post_init__(self) -> None:
        _ints(self, "stage_index", lo=1)
        _ints(self, "layer_start", "shard_bytes")
        _ints(self, "layer_end", lo=self.layer_start + 1 if type(self.layer_start) is int else 1)
        _sha256(self, "shard_sha256")
        _str(self, "next_addr", max_len=512)
        _str(self, "model", max_len=512)


@dataclass(**_MSG)
class ShardRequest(Message):
    """Stage -> head: send me bytes [offset, offset + length) of my shard."""

    TYPE: ClassVar[str] = "shard_request"
    offset: int
    length: int = SHARD_CHUNK_BYTES

    def __post_init__(self) -> None:
        _ints(self, "offset")
        _ints(self, "length", lo=1, hi=MAX_SHARD_CHUNK_BYTES)


@dataclass(**_MSG)
class ShardChunk(Message):
    """Head -> stage: one chunk of the shard; `sha256` is this chunk's digest, `total` the shard size."""

    TYPE: ClassVar[str] = "shard_chunk"
    WIRE: ClassVar[dict[str, str]] = {"data": BYTES}
    offset: int
    total: int
    sha256: str
    data: bytes | memoryview

    def __post_init__(self) -> None:
        _ints(self, "offset", "total")
        _sha256(self, "sha256")
        if not isinstance(self.data, (bytes, bytearray, memoryview)):
            raise _fail(self, "data", "bytes")
        if self.offset + memoryview(self.data).nbytes > self.total:
            raise _fail(self, "data", f"a chunk ending within total={self.total}")

    @classmethod
    def of(cls, offset: int, data: bytes | memoryview, total: int) -> ShardChunk:
        return cls(offset=offset, total=total, data=data, sha256=hashlib.sha256(data).hexdigest())

    def verify(self) -> None:
        """ChecksumError when the data does not hash to `sha256`."""
        got = hashlib.sha256(self.data).hexdigest()
        if got != self.sha256:
            raise ChecksumError(f"shard chunk at offset {self.offset}: sha256 {got} != {self.sha256}")


@dataclass(**_MSG)
class Ready(Message):
    """Stage -> head: shard loaded, layers ready, next hop connected."""

    TYPE: ClassVar[str] = "ready"
    stage_index: int

    def __post_init__(self) -> None:
        _ints(self, "stage_index", lo=1)


@dataclass(**_MSG)
class Heartbeat(Message):
    """Liveness plus load: `load` is busy time over wall time since the last heartbeat."""

    TYPE: ClassVar[str] = "heartbeat"
    node_id: str
    load: float
    rss_bytes: int

    def __post_init__(self) -> None:
        _str(self, "node_id", max_len=256)
        _float(self, "load", 0.0, 1e6)
        _ints(self, "rss_bytes")


@dataclass(**_MSG)
class Shutdown(Message):
    """Stop serving and exit cleanly."""

    TYPE: ClassVar[str] = "shutdown"
    reason: str = ""

    def __post_init__(self) -> None:
        _str(self, "reason")


# ---------------------------------------------------------------- data plane
@dataclass(**_MSG)
class Segment(Message):
    """A run of n draft-tree nodes moving down the pipeline: head -> stage 1 -> ... -> head.

    Carries either `token_ids` [n] (head -> stage 1 when stage 1 embeds) or `hidden` [n, H] (every
    other hop), never both. `parent_ids[i]` is the node id of node i's parent, `positions[i]` its
    absolute position. `prune_version` is the last Prune the sender applied, so a stage can tell a
    segment built before a prune from one built after it. n == 0 is legal.
    """

    TYPE: ClassVar[str] = "segment"
    WIRE: ClassVar[dict[str, str]] = {
        "node_ids": INDEX, "parent_ids": INDEX, "positions": INDEX, "hidden": HIDDEN, "token_ids": INDEX,
    }
    request_id: int
    round_id: int
    seq: int
    prune_version: int
    kind: str
    sent_at_step: int
    node_ids: torch.Tensor  # [n]
    parent_ids: torch.Tensor  # [n]
    positions: torch.Tensor  # [n]
    hidden: torch.Tensor | None = None  # [n, H] float
    token_ids: torch.Tensor | None = None  # [n]
    hidden_wire: str = "float16"

    def __post_init__(self) -> None:
        _ints(self, "request_id", "round_id", "seq", "prune_version", "sent_at_step")
        _str(self, "kind", SEGMENT_KINDS)
        _str(self, "hidden_wire", HIDDEN_WIRE_NAMES)
        n = _index(self, "node_ids")
        _index(self, "parent_ids", n)
        _index(self, "positions", n)
        if (self.hidden is None) == (self.token_ids is None):
            raise ProtocolError("segment carries exactly one of hidden or token_ids")
        _index(self, "token_ids", n, optional=True)
        h = self.hidden
        if h is not None and (
            not isinstance(h, torch.Tensor) or not h.is_floating_point() or h.dim() != 2 or h.shape[0] != n
        ):
            raise _fail(self, "hidden", f"a float tensor [{n}, H]")

    def __len__(self) -> int:
        return self.node_ids.numel()


@dataclass(**_MSG)
class Prune(Message):
    """Head -> every stage: keep only `keep_ids` of the tree, commit `commit_ids` (accepted tokens).

    `version` increases with every prune of a request. A Prune with a new `round_id` also starts
    that round (see the module docstring). `horizon` is the committed prefix length after this prune.
    """

    TYPE: ClassVar[str] = "prune"
    WIRE: ClassVar[dict[str, str]] = {"commit_ids": INDEX, "keep_ids": INDEX}
    request_id: int
    round_id: int
    version: int
    horizon: int
    commit_ids: torch.Tensor  # [c]
    keep_ids: torch.Tensor  # [k]

    def __post_init__(self) -> None:
        _ints(self, "request_id", "round_id", "version", "horizon")
        _index(self, "commit_ids")
        _index(self, "keep_ids")


@dataclass(**_MSG)
class Reset(Message):
    """Drop everything a node holds for a request (KV cache, tree)."""

    TYPE: ClassVar[str] = "reset"
    request_id: int

    def __post_init__(self) -> None:
        _ints(self, "request_id")


# ---------------------------------------------------------------- client <-> head
@dataclass(**_MSG)
class PromptRequest(Message):
    """Client -> head: generate up to `max_new_tokens` after `text` or `token_ids` (exactly one).

    `top_k`/`top_p` None means no such filter; `seed` None means a random seed.
    """

    TYPE: ClassVar[str] = "prompt"
    WIRE: ClassVar[dict[str, str]] = {"token_ids": INDEX}
    request_id: int
    max_new_tokens: int
    text: str | None = None
    token_ids: torch.Tensor | None = None  # [p]
    temperature: float = 0.0
    top_k: int | None = None
    top_p: float | None = None
    seed: int | None = None
    strategy: str = "flowspec"

    def __post_init__(self) -> None:
        _ints(self, "request_id")
        _ints(self, "max_new_tokens", lo=1, hi=1 << 20)
        if (self.text is None) == (self.token_ids is None):
            raise ProtocolError("prompt carries exactly one of text or token_ids")
        if self.text is not None:
            _str(self, "text", max_len=MAX_HEADER_BYTES // 2)
        _index(self, "token_ids", optional=True)
        _float(self, "temperature", 0.0, 100.0)
        _ints(self, "top_k", lo=1, hi=1 << 31, optional=True)
        _float(self, "top_p", 1e-9, 1.0, optional=True)
        _ints(self, "seed", optional=True)
        _str(self, "strategy", max_len=64)


@dataclass(**_MSG)
class TokenChunk(Message):
    """Head -> client: newly committed tokens; the last chunk has done=True and carries `stats`."""

    TYPE: ClassVar[str] = "tokens"
    WIRE: ClassVar[dict[str, str]] = {"token_ids": INDEX}
    request_id: int
    token_ids: torch.Tensor  # [t]
    text: str
    done: bool
    stats: dict[str, Any] | None = None

    def __post_init__(self) -> None:
        _ints(self, "request_id")
        _index(self, "token_ids")
        _str(self, "text", max_len=MAX_HEADER_BYTES // 2)
        if type(self.done) is not bool:
            raise _fail(self, "done", "a bool")
        _map(self, "stats", optional=True)


@dataclass(**_MSG)
class ErrorReply(Message):
    """Head -> client: the request failed; `message` is the one-line error."""

    TYPE: ClassVar[str] = "error"
    request_id: int
    message: str

    def __post_init__(self) -> None:
        _ints(self, "request_id")
        _str(self, "message")


@dataclass(**_MSG)
class StatusRequest(Message):
    """Client -> head: describe the cluster."""

    TYPE: ClassVar[str] = "status_request"


@dataclass(**_MSG)
class StatusReply(Message):
    """Head -> client: one map per node (id, role, stage, layers, device, load, last_seen_s...)."""

    TYPE: ClassVar[str] = "status"
    nodes: list[dict[str, Any]]

    def __post_init__(self) -> None:
        nodes = self.nodes
        if not isinstance(nodes, list) or len(nodes) > MAX_LIST_ITEMS or not all(
            isinstance(n, dict) and all(isinstance(k, str) for k in n) for n in nodes
        ):
            raise _fail(self, "nodes", "a list of maps with string keys")


MESSAGE_TYPES: dict[str, type[Message]] = {
    cls.TYPE: cls
    for cls in (
        Hello, Welcome, Refuse, Assign, ShardRequest, ShardChunk, Ready, Heartbeat, Shutdown,
        Segment, Prune, Reset, PromptRequest, TokenChunk, ErrorReply, StatusRequest, StatusReply,
    )
}
