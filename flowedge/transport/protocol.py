"""Wire messages: one frozen, self-validating dataclass per message type (codec in codec.py).

Frame layout of every message (see frames.py for the tensor rules):

    frame 0   msgpack map {"v": [major, minor], "type": "<TYPE>", <scalar fields...>,
                           "tensors": {"<field>": {"dtype": ..., "shape": [...]}, ...}}
    frame 1.. one raw buffer per tensor field that is present, in the order of "tensors"

Compatibility: every header carries "v". A receiver refuses a different MAJOR version on any message
(ProtocolError "peer speaks flowedge protocol 2.0, this node speaks 1.0"); a newer minor may add
fields with defaults, and unknown header keys are ignored. `Refuse` is frozen forever ({"reason"}), so
it is decoded whatever the major version and a refused peer can always read why.

Topology: the head (node 0) feeds stage 1; stage k forwards to stage k+1; the last stage returns
hidden states to the head, or (1.2, when it holds the lm_head and the request's prefill carried
sampling params) the base model's chosen token per node. Control messages (HELLO/ASSIGN/SHARD/READY/HEARTBEAT) go stage <-> head,
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
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar

from flowedge.errors import ChecksumError, ProtocolError
from flowedge.filenames import is_plain_file_name
from flowedge.transport.codec import (  # noqa: F401  (re-exported: the protocol's public surface)
    BYTES,
    HIDDEN,
    HIDDEN_WIRE_NAMES,
    INDEX,
    MAX_HEADER_BYTES,
    MAX_LIST_ITEMS,
    MAX_SHARD_CHUNK_BYTES,
    MAX_TEXT_CHARS,
    MESSAGE_TYPES,
    PROTOCOL_VERSION,
    ROLES,
    SEGMENT_KINDS,
    SHARD_CHUNK_BYTES,
    TOKENS,
    Message,
    _fail,
    _float,
    _index,
    _ints,
    _map,
    _sha256,
    _str,
    _tokens,
    _text,
    bounded,
    quote,
    too_long,
    _version,
    check_version,
    decode,
    encode,
    is_tensor,
    version_text,
)

if TYPE_CHECKING:
    import torch


def __getattr__(name: str) -> Any:
    if name == "WIRE_DTYPES":   # the data plane's torch dtype table, loaded on first use
        from flowedge.transport.frames import WIRE_DTYPES

        return WIRE_DTYPES
    raise AttributeError(name)


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
        _text(self, "reason")


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
    hidden_wire: str = "float16"
    quant: str = "none"
    side_files: dict[str, str] = field(default_factory=dict)  # small text files: config.json, manifest
    source_dir: str = ""  # the head's split directory: a stage on the same host may read it directly
    head_sha256: str = ""  # 1.2, last stage only: also load the split's head file (final norm + lm_head)
    head_bytes: int = 0

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
        if len(self.side_files) > 64 or not all(isinstance(v, str) and is_plain_file_name(k)
                                                 for k, v in self.side_files.items()):
            raise _fail(self, "side_files", "plain file names mapped to text")


@dataclass(**_MSG)
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
    stats: dict[str, Any] = field(default_factory=dict)  # e.g. steps, step_ms_median

    def __post_init__(self) -> None:
        _str(self, "node_id", max_len=256)
        _float(self, "load", 0.0, 1e6)
        _ints(self, "rss_bytes")
        _map(self, "stats")


@dataclass(**_MSG)
class Shutdown(Message):
    """Stop serving and exit cleanly."""

    TYPE: ClassVar[str] = "shutdown"
    reason: str = ""

    def __post_init__(self) -> None:
        _text(self, "reason")


# ---------------------------------------------------------------- data plane
@dataclass(**_MSG)
class Segment(Message):
    """A run of rows moving down the pipeline: head -> stage 1 -> ... -> head. Its `positions` [rows]
    are absolute; hidden states [rows, H] travel between stages.

    Tree segments (every kind but "prefill") name their n = rows nodes: `node_ids`, `parent_ids` and
    `root_rows` (1.4), the rows (ascending) whose node hangs off the committed context; every other
    row's parent is node `parent_ids[i]`, which comes before it in the tree (a smaller id); root rows
    carry parent id 0, ignored. A prefill chunk's rows are committed context: no node, parent or root
    ids (all empty). On the return hop, when the last stage chose the base model's token (1.2),
    `token_ids` replaces `hidden`: one per node, or for a prefill chunk the one choice after its last
    row. `prune_version` is the last Prune the sender applied, so a stage can tell a segment built
    before a prune from one built after it. rows == 0 is legal. Prefill segments may carry the
    request's sampling params (`temperature` set): the last stage then chooses tokens with them.
    """

    TYPE: ClassVar[str] = "segment"
    MIN_MINOR: ClassVar[int] = 4   # 1.4 dropped the ids' +1 shift: an older peer's ids would be misread
    WIRE: ClassVar[dict[str, str]] = {
        "node_ids": INDEX, "parent_ids": INDEX, "root_rows": INDEX, "positions": INDEX, "hidden": HIDDEN,
        "token_ids": INDEX,
    }
    request_id: int
    round_id: int
    seq: int
    prune_version: int
    kind: str
    sent_at_step: int
    node_ids: torch.Tensor  # [n] (prefill: [0])
    parent_ids: torch.Tensor  # [n] (prefill: [0])
    positions: torch.Tensor  # [rows]
    root_rows: torch.Tensor | None = None  # [r] ascending rows < n whose parent is the committed context
    hidden: torch.Tensor | None = None  # [rows, H] float
    token_ids: torch.Tensor | None = None  # [n] (prefill: [1])
    hidden_wire: str = "float16"
    temperature: float | None = None       # 1.2: sampling params (prefill only; None = not sent)
    top_k: int = 0
    top_p: float = 1.0
    seed: int | None = None

    def __post_init__(self) -> None:
        _ints(self, "request_id", "round_id", "seq", "prune_version", "sent_at_step")
        _float(self, "temperature", 0.0, 1e6, optional=True)
        _ints(self, "top_k")
        _float(self, "top_p", 1e-9, 1.0)
        _ints(self, "seed", optional=True)
        _str(self, "kind", SEGMENT_KINDS)
        _str(self, "hidden_wire", HIDDEN_WIRE_NAMES)
        rows = _index(self, "positions")
        n = 0 if self.kind == "prefill" else rows
        _index(self, "node_ids", n)
        _index(self, "parent_ids", n)
        if _index(self, "root_rows", optional=True) and (
                int(self.root_rows.max()) >= n or bool((self.root_rows[1:] <= self.root_rows[:-1]).any())):
            raise _fail(self, "root_rows", f"ascending rows below {n}")
        if (self.hidden is None) == (self.token_ids is None):
            raise ProtocolError("segment carries exactly one of hidden or token_ids")
        _index(self, "token_ids", 1 if self.kind == "prefill" else n, optional=True)
        h = self.hidden
        if h is not None and (
            not is_tensor(h) or not h.is_floating_point() or h.dim() != 2 or h.shape[0] != rows
        ):
            raise _fail(self, "hidden", f"a float tensor [{rows}, H]")

    def __len__(self) -> int:
        return self.positions.numel()


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
    end_round: bool = False  # every draft entry dies after the commit

    def __post_init__(self) -> None:
        _ints(self, "request_id", "round_id", "version", "horizon")
        _index(self, "commit_ids")
        _index(self, "keep_ids")
        if type(self.end_round) is not bool:
            raise _fail(self, "end_round", "a bool")


@dataclass(**_MSG)
class Reset(Message):
    """Drop everything a node holds for a request (KV cache, tree)."""

    TYPE: ClassVar[str] = "reset"
    request_id: int

    def __post_init__(self) -> None:
        _ints(self, "request_id")


# ---------------------------------------------------------------- client <-> head
MAX_MESSAGES = 1024          # turns in one conversation
MAX_STOPS = 16               # stop strings in one request
MAX_STOP_CHARS = 256         # characters in one stop string
MAX_PROMPT_CHARS = MAX_HEADER_BYTES // 2   # characters of prompt text (or of all turns' content)
CHAT_ROLES = ("system", "user", "assistant")


@dataclass(**_MSG)
class PromptRequest(Message):
    """Client -> head: generate up to `max_new_tokens` after `text`, `token_ids` or `messages` (exactly one).

    `top_k`/`top_p` None means no such filter; `seed` None means a random seed.
    1.3: `messages` is a conversation ([{"role": "system"|"user"|"assistant", "content": str}]) put
    through the model's chat template; `raw` sends `text` to the model as is (no template); `stop`
    ends the answer where its text first contains one of these strings (the stop string is cut off).
    """

    TYPE: ClassVar[str] = "prompt"
    WIRE: ClassVar[dict[str, str]] = {"token_ids": TOKENS}
    request_id: int
    max_new_tokens: int
    text: str | None = None
    token_ids: tuple[int, ...] | None = None  # [p]; a list, array or tensor is stored as a tuple
    temperature: float = 0.0
    top_k: int | None = None
    top_p: float | None = None
    seed: int | None = None
    strategy: str = "flowspec"
    messages: list[dict[str, str]] | None = None
    stop: list[str] = field(default_factory=list)
    raw: bool = False

    def __post_init__(self) -> None:
        _ints(self, "request_id")
        _ints(self, "max_new_tokens", lo=1, hi=1 << 20)
        if sum(x is not None for x in (self.text, self.token_ids, self.messages)) != 1:
            raise ProtocolError("prompt carries exactly one of text, token_ids or messages")
        if self.text is not None:
            _str(self, "text", max_len=MAX_PROMPT_CHARS)
        _tokens(self, "token_ids", optional=True)
        if self.text == "" or self.token_ids == ():
            raise ProtocolError("the prompt is empty")
        if self.messages is not None:
            _messages(self)
        _float(self, "temperature", 0.0, 100.0)
        _ints(self, "top_k", lo=1, hi=1 << 31, optional=True)
        _float(self, "top_p", 1e-9, 1.0, optional=True)
        _ints(self, "seed", optional=True)
        _str(self, "strategy", max_len=64)
        if not isinstance(self.stop, (list, tuple)) or len(self.stop) > MAX_STOPS or not all(
                isinstance(s, str) and 0 < len(s) <= MAX_STOP_CHARS for s in self.stop):
            raise _fail(self, "stop", f"at most {MAX_STOPS} non-empty strings of <= {MAX_STOP_CHARS} characters")
        object.__setattr__(self, "stop", list(self.stop))
        if type(self.raw) is not bool:
            raise _fail(self, "raw", "a bool")


def _messages(msg: PromptRequest) -> None:
    turns = msg.messages
    if not isinstance(turns, (list, tuple)) or not 0 < len(turns) <= MAX_MESSAGES or not all(
            isinstance(t, dict) and set(t) == {"role", "content"} and t["role"] in CHAT_ROLES
            and isinstance(t["content"], str) for t in turns):
        raise _fail(msg, "messages", f"1..{MAX_MESSAGES} maps {{role: one of {list(CHAT_ROLES)}, content: str}}")
    chars = sum(len(t["content"]) for t in turns)
    if chars > MAX_PROMPT_CHARS:
        raise too_long(msg, "messages", chars, MAX_PROMPT_CHARS)
    object.__setattr__(msg, "messages", [dict(t) for t in turns])


@dataclass(**_MSG)
class Cancel(Message):
    """Client -> head (1.3): stop my request `request_id` (queued or running) and free its KV cache."""

    TYPE: ClassVar[str] = "cancel"
    request_id: int

    def __post_init__(self) -> None:
        _ints(self, "request_id")


@dataclass(**_MSG)
class TokenChunk(Message):
    """Head -> client: newly committed tokens; the last chunk has done=True and carries `stats`."""

    TYPE: ClassVar[str] = "tokens"
    WIRE: ClassVar[dict[str, str]] = {"token_ids": TOKENS}
    request_id: int
    token_ids: tuple[int, ...]  # [t]; a list, array or tensor is stored as a tuple
    text: str
    done: bool
    stats: dict[str, Any] | None = None

    def __post_init__(self) -> None:
        _ints(self, "request_id")
        _tokens(self, "token_ids")
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
        _text(self, "message")


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
