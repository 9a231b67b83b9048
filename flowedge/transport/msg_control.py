"""Control-plane messages, stage <-> head: the handshake (Hello, Welcome, Refuse), the stage's
assignment and its shard transfer (Assign, ShardRequest, ShardChunk), Ready, Heartbeat and Shutdown."""
from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from typing import Any, ClassVar

from flowedge.errors import ChecksumError
from flowedge.filenames import is_plain_file_name
from flowedge.transport.codec import (
    BYTES,
    HIDDEN_WIRE_NAMES,
    MAX_SHARD_CHUNK_BYTES,
    MESSAGE_OPTIONS,
    Message,
    PROTOCOL_VERSION,
    ROLES,
    SHARD_CHUNK_BYTES,
    _fail,
    _float,
    _ints,
    _map,
    _sha256,
    _str,
    _text,
    _version,
)


@dataclass(**MESSAGE_OPTIONS)
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


@dataclass(**MESSAGE_OPTIONS)
class Welcome(Message):
    """The head admits a peer: its own identity, version and the heartbeat period it expects."""

    TYPE: ClassVar[str] = "welcome"
    node_id: str
    heartbeat_interval_ms: int
    version: tuple[int, int] = PROTOCOL_VERSION
    term: int = 0   # 1.8: the head's fencing term (node/fencing.py; 0: an older head)

    def __post_init__(self) -> None:
        _str(self, "node_id", max_len=256)
        _ints(self, "heartbeat_interval_ms", lo=1)
        _version(self)
        _ints(self, "term")


@dataclass(**MESSAGE_OPTIONS)
class Refuse(Message):
    """The head turns a peer away. Layout frozen across major versions: {"reason": str}."""

    TYPE: ClassVar[str] = "refuse"
    reason: str

    def __post_init__(self) -> None:
        _text(self, "reason")


@dataclass(**MESSAGE_OPTIONS)
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
    hidden_wire: str = "float16"
    quant: str = "none"
    side_files: dict[str, str] = field(default_factory=dict)  # small text files: config.json, manifest
    source_dir: str = ""  # the head's split directory: a stage on the same host may read it directly
    head_sha256: str = ""  # 1.2, last stage only: also load the split's head file (final norm + lm_head)
    head_bytes: int = 0
    model_sha256: str = ""  # 1.6: content key of the model the shards were cut from ("": an older head)

    def __post_init__(self) -> None:
        _ints(self, "stage_index", lo=1)
        _ints(self, "layer_start", "shard_bytes")
        _ints(self, "layer_end", lo=self.layer_start + 1 if type(self.layer_start) is int else 1)
        _sha256(self, "shard_sha256")
        _str(self, "next_addr", max_len=512)
        _str(self, "model", max_len=512)
        _str(self, "hidden_wire", HIDDEN_WIRE_NAMES)
        _str(self, "quant", ("none", "int4", "nf4", "auto"))
        _map(self, "side_files")
        _str(self, "source_dir", max_len=4096)
        if self.head_sha256:
            _sha256(self, "head_sha256")
        _ints(self, "head_bytes")
        if self.model_sha256:
            _sha256(self, "model_sha256")
        if len(self.side_files) > 64 or not all(isinstance(v, str) and is_plain_file_name(k)
                                                 for k, v in self.side_files.items()):
            raise _fail(self, "side_files", "plain file names mapped to text")


@dataclass(**MESSAGE_OPTIONS)
class ShardRequest(Message):
    """Stage -> head: send me bytes [offset, offset + length) of my shard (or of the file `sha256`,
    which must be one the head assigned to this stage: 1.2, the head file of the last stage)."""

    TYPE: ClassVar[str] = "shard_request"
    offset: int
    length: int = SHARD_CHUNK_BYTES
    sha256: str = ""

    def __post_init__(self) -> None:
        _ints(self, "offset")
        _ints(self, "length", lo=1, hi=MAX_SHARD_CHUNK_BYTES)
        if self.sha256:
            _sha256(self, "sha256")


@dataclass(**MESSAGE_OPTIONS)
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


@dataclass(**MESSAGE_OPTIONS)
class Ready(Message):
    """Stage -> head: shard loaded, layers ready, next hop connected."""

    TYPE: ClassVar[str] = "ready"
    stage_index: int

    def __post_init__(self) -> None:
        _ints(self, "stage_index", lo=1)


@dataclass(**MESSAGE_OPTIONS)
class Heartbeat(Message):
    """Liveness plus load: `load` is busy time over wall time since the last heartbeat.

    Round trips (1.8): the head numbers its heartbeats (`ping`); a peer's next heartbeat echoes the latest
    number it read (`echo`) and how long it held it (`held_ms`), so the head times the link without either
    clock crossing it (node/link_rtt.py). Older peers neither send nor read these fields: no round trip."""

    TYPE: ClassVar[str] = "heartbeat"
    node_id: str
    load: float
    rss_bytes: int
    stats: dict[str, Any] = field(default_factory=dict)  # e.g. steps, step_ms_median
    term: int = 0   # 1.8: from a head, its fencing term (node/fencing.py); 0 from other nodes
    ping: int | None = None     # head -> peer: this heartbeat's number
    echo: int | None = None     # peer -> head: the latest number read
    held_ms: float = 0.0        # peer -> head: from reading `echo` to sending this

    def __post_init__(self) -> None:
        _str(self, "node_id", max_len=256)
        _float(self, "load", 0.0, 1e6)
        _ints(self, "rss_bytes")
        _map(self, "stats")
        _ints(self, "term")
        _ints(self, "ping", "echo", optional=True)
        _float(self, "held_ms", 0.0, 1e9)


@dataclass(**MESSAGE_OPTIONS)
class Shutdown(Message):
    """Stop serving and exit cleanly."""

    TYPE: ClassVar[str] = "shutdown"
    reason: str = ""

    def __post_init__(self) -> None:
        _text(self, "reason")


@dataclass(**MESSAGE_OPTIONS)
class RequestDropped(Message):
    """Stage -> head (1.6): this stage freed run `run_id` (the engine's run, as in segments; 1.9, `request_id`
    before) and computes no more of it, for `reason` (its context is full, it fell out of step, a compute
    error). Without it the head would wait for segments that never come."""

    TYPE: ClassVar[str] = "request-dropped"
    MIN_MINOR: ClassVar[int] = 9   # 1.9: run_id
    run_id: int
    reason: str

    def __post_init__(self) -> None:
        _ints(self, "run_id")
        _text(self, "reason")
