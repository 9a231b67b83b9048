"""Drafter-role messages (1.5), head <-> drafter over the control connection: the drafter's model
(DraftSetup, DraftReady), a pre-draft job (DraftJob: node 0's draft tree and the K/V rows the drafter's
replica lacks, engine/draft_sync.DraftSnapshot), and its answer (DraftAnswer: the grown tree and the K/V
rows of the nodes it ran, DraftGrowth) or a refusal (DraftDeclined: the replica is behind, or the job was
malformed). Trees travel as their node tokens, parents and log-scores, K/V rows as one raw tensor frame
in the draft cache's dtype, without copies, as a Segment's hidden states do.

What is checked here is what holds for any model: shapes consistent with each other, trees topological,
sizes bounded, dtypes. What depends on the draft model (vocabulary, layers, K/V heads, head size) each
side checks against its own model (node/draft_wire.py)."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, ClassVar

from flowedge.filenames import is_plain_file_name
from flowedge.transport.codec import (
    FLOAT32,
    HIDDEN,
    HIDDEN_WIRE_NAMES,
    INDEX,
    MESSAGE_OPTIONS,
    TOKENS,
    Message,
    _fail,
    _index,
    _ints,
    _map,
    _sha256,
    _str,
    _text,
    _tokens,
    is_tensor,
)

if TYPE_CHECKING:
    import torch

MAX_TREE_NODES = 1 << 16      # a stored draft tree: a few hundred nodes in practice
MAX_CONTEXT_TOKENS = 1 << 20
MAX_CALLS = 64                # draft calls in one job
MAX_ROWS_A_CALL = 1024        # rows of one draft call (width), and children per node (topk)
DECLINE_REASONS = ("behind", "error")


def _tree(msg: DraftJob | DraftAnswer, rows_expected: int) -> int:
    """Check a tree (tokens [n], parents of nodes 1.. [n - 1], log_scores [n], ran [r]) and its K/V
    rows [layers, 2, kv_heads, rows_expected + r, head_dim]; returns n."""
    import torch

    n = _index(msg, "tokens")
    if not 1 <= n <= MAX_TREE_NODES:
        raise _fail(msg, "tokens", f"a tree of 1 to {MAX_TREE_NODES} nodes")
    _index(msg, "parents", n - 1)
    if n > 1 and bool((msg.parents >= torch.arange(1, n)).any()):
        raise _fail(msg, "parents", "each node's parent before it (topological order)")
    s = msg.log_scores
    if not is_tensor(s) or s.dtype != torch.float32 or s.dim() != 1 or s.numel() != n:
        raise _fail(msg, "log_scores", f"a float32 tensor of length {n}")
    if bool(torch.isnan(s).any()) or bool((s == float("inf")).any()):
        raise _fail(msg, "log_scores", "log-probabilities (no NaN, no +inf)")
    r = _index(msg, "ran")
    if r and (int(msg.ran.min()) < 1 or int(msg.ran.max()) >= n or bool((msg.ran[1:] <= msg.ran[:-1]).any())):
        raise _fail(msg, "ran", f"ascending node ids in [1, {n})")
    kv = msg.rows
    if not is_tensor(kv) or not kv.is_floating_point() or kv.dim() != 5 or kv.shape[1] != 2 \
            or kv.shape[3] != rows_expected + r:
        raise _fail(msg, "rows", f"a float tensor [layers, 2, kv_heads, {rows_expected + r}, head_dim]")
    return n


def _job_shape(msg: DraftJob) -> None:
    _ints(msg, "calls", lo=1, hi=MAX_CALLS)
    _ints(msg, "width", "topk", lo=1, hi=MAX_ROWS_A_CALL)
    _ints(msg, "lookup", hi=msg.width)


@dataclass(**MESSAGE_OPTIONS)
class DraftSetup(Message):
    """Head -> drafter, once it joined: the draft model to hold and its weights' quantization. With
    `shard_sha256` set the head serves it as a one-stage split (the layers' file, `shard_sha256`, and the
    head file, `head_sha256`, fetched with ShardRequests like a stage's shard; `side_files`: config and
    manifest); without, or on the head's own host, `model` (a registry name, a Hugging Face directory or a
    .gguf file) is resolved on the drafter."""

    TYPE: ClassVar[str] = "draft_setup"
    MIN_MINOR: ClassVar[int] = 5
    model: str
    quant: str
    shard_sha256: str = ""
    shard_bytes: int = 0
    head_sha256: str = ""
    head_bytes: int = 0
    side_files: dict[str, str] = field(default_factory=dict)

    def __post_init__(self) -> None:
        _str(self, "model", max_len=1024)
        _str(self, "quant", max_len=16)
        _ints(self, "shard_bytes", "head_bytes")
        if self.shard_sha256 or self.head_sha256:
            _sha256(self, "shard_sha256")
            _sha256(self, "head_sha256")
        _map(self, "side_files")
        if len(self.side_files) > 64 or not all(isinstance(v, str) and is_plain_file_name(k)
                                                 for k, v in self.side_files.items()):
            raise _fail(self, "side_files", "plain file names mapped to text")


@dataclass(**MESSAGE_OPTIONS)
class DraftReady(Message):
    """Drafter -> head: its draft model is loaded (`error` empty), or why it could not be (the head shows
    it in status and sends it no jobs)."""

    TYPE: ClassVar[str] = "draft_ready"
    MIN_MINOR: ClassVar[int] = 5
    model: str
    error: str = ""

    def __post_init__(self) -> None:
        _str(self, "model", max_len=1024)
        _text(self, "error")


@dataclass(**MESSAGE_OPTIONS)
class DraftJob(Message):
    """Head -> drafter: grow node 0's draft tree at `context` by `calls` best-first calls of `width` rows
    (`lookup` of them prompt-lookup guesses, `topk` children a node). The replica of request
    `request_id` holds the first `keep` committed rows; `rows` are the committed ones after them, then
    the K/V of every node in `ran` (nodes the draft model has run; the root is context, never listed).
    `parents` are the parents of nodes 1..n-1 (node 0 is the root). In every draft message `request_id` is the
    head's request key (engine/scheduler.py), neither the client's id nor a run id: a replica outlives replays."""

    TYPE: ClassVar[str] = "draft_job"
    MIN_MINOR: ClassVar[int] = 5
    WIRE: ClassVar[dict[str, str]] = {"context": TOKENS, "tokens": INDEX, "parents": INDEX,
                                      "log_scores": FLOAT32, "ran": INDEX, "rows": HIDDEN}
    request_id: int
    seq: int
    keep: int
    calls: int
    width: int
    lookup: int
    topk: int
    context: tuple[int, ...]
    tokens: torch.Tensor        # [n]
    parents: torch.Tensor       # [n - 1]
    log_scores: torch.Tensor    # [n] float32
    ran: torch.Tensor           # [r]
    rows: torch.Tensor          # [layers, 2, kv_heads, len(context) - keep + r, head_dim]
    hidden_wire: str = "float32"   # the K/V rows' dtype (the draft cache's)

    def __post_init__(self) -> None:
        _ints(self, "request_id", "seq", "keep")
        _job_shape(self)
        _str(self, "hidden_wire", HIDDEN_WIRE_NAMES)
        _tokens(self, "context")
        if not 1 <= len(self.context) <= MAX_CONTEXT_TOKENS:
            raise _fail(self, "context", f"1 to {MAX_CONTEXT_TOKENS} token ids")
        if self.keep > len(self.context):
            raise _fail(self, "keep", f"at most the context's {len(self.context)} tokens")
        _tree(self, len(self.context) - self.keep)
        if int(self.tokens[0]) != self.context[-1]:
            raise _fail(self, "tokens", "a tree rooted at the context's last token")


@dataclass(**MESSAGE_OPTIONS)
class DraftAnswer(Message):
    """Drafter -> head: job `seq` of request `request_id` done. The grown tree (the job's nodes first,
    same ids), the nodes the drafter ran for it (`ran`) and their K/V `rows`, and the draft calls it
    made as (rows, context, seconds) triples (`calls`)."""

    TYPE: ClassVar[str] = "draft_answer"
    MIN_MINOR: ClassVar[int] = 5
    WIRE: ClassVar[dict[str, str]] = {"tokens": INDEX, "parents": INDEX, "log_scores": FLOAT32, "ran": INDEX,
                                      "rows": HIDDEN}
    request_id: int
    seq: int
    tokens: torch.Tensor
    parents: torch.Tensor
    log_scores: torch.Tensor
    ran: torch.Tensor
    rows: torch.Tensor          # [layers, 2, kv_heads, r, head_dim]
    calls: list = field(default_factory=list)
    hidden_wire: str = "float32"

    def __post_init__(self) -> None:
        _ints(self, "request_id", "seq")
        _str(self, "hidden_wire", HIDDEN_WIRE_NAMES)
        _tree(self, 0)
        c = self.calls
        if not isinstance(c, (list, tuple)) or len(c) > MAX_CALLS or not all(
                isinstance(x, (list, tuple)) and len(x) == 3 and type(x[0]) is int and type(x[1]) is int
                and type(x[2]) in (int, float) and 0 <= x[0] <= MAX_TREE_NODES and 0 <= x[1] <= MAX_CONTEXT_TOKENS
                + MAX_TREE_NODES and 0 <= x[2] < 3600 for x in c):
            raise _fail(self, "calls", f"at most {MAX_CALLS} (rows, context, seconds) triples")
        object.__setattr__(self, "calls", [(int(a), int(b), float(s)) for a, b, s in c])


@dataclass(**MESSAGE_OPTIONS)
class DraftDeclined(Message):
    """Drafter -> head: no answer to job `seq`: the replica lacks the rows the job assumed (`behind`: node
    0 ships the whole context next time), or the job could not be run (`error`, with why). request_id
    and seq are 0 when the job could not even be read."""

    TYPE: ClassVar[str] = "draft_declined"
    MIN_MINOR: ClassVar[int] = 5
    request_id: int
    seq: int
    why: str
    detail: str = ""

    def __post_init__(self) -> None:
        _ints(self, "request_id", "seq")
        _str(self, "why", DECLINE_REASONS)
        _text(self, "detail")
