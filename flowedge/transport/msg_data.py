"""Data-plane messages, along the pipeline: Segment (rows moving head -> stage 1 -> ... -> head), Prune
(keep/commit sets, which also start a new round) and Reset (drop a run's state).

Every one names its engine run by `run_id` (1.9; `request_id` before): the head's id for one run of a
request's engine, not the client's request id. A replay starts a new run under a new id, so a late segment
of the old run can never be taken for the new one's (node/run_router.py)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, ClassVar

from flowedge.errors import ProtocolError
from flowedge.transport.codec import (
    HIDDEN,
    HIDDEN_WIRE_NAMES,
    INDEX,
    MESSAGE_OPTIONS,
    Message,
    SEGMENT_KINDS,
    _fail,
    _float,
    _index,
    _ints,
    _str,
    is_tensor,
)

if TYPE_CHECKING:
    import torch


@dataclass(**MESSAGE_OPTIONS)
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
    MIN_MINOR: ClassVar[int] = 9   # 1.9 renamed request_id to run_id (1.4 dropped the ids' +1 shift)
    WIRE: ClassVar[dict[str, str]] = {
        "node_ids": INDEX, "parent_ids": INDEX, "root_rows": INDEX, "positions": INDEX, "hidden": HIDDEN,
        "token_ids": INDEX,
    }
    run_id: int
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
        _ints(self, "run_id", "round_id", "seq", "prune_version", "sent_at_step")
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
        if self.root_rows is not None and _index(self, "root_rows") and (
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


@dataclass(**MESSAGE_OPTIONS)
class Prune(Message):
    """Head -> every stage: keep only `keep_ids` of the tree, commit `commit_ids` (accepted tokens).

    `version` increases with every prune of a run. A Prune with a new `round_id` also starts
    that round (see the module docstring). `horizon` is the committed prefix length after this prune.
    """

    TYPE: ClassVar[str] = "prune"
    MIN_MINOR: ClassVar[int] = 9   # 1.9: run_id
    WIRE: ClassVar[dict[str, str]] = {"commit_ids": INDEX, "keep_ids": INDEX}
    run_id: int
    round_id: int
    version: int
    horizon: int
    commit_ids: torch.Tensor  # [c]
    keep_ids: torch.Tensor  # [k]
    end_round: bool = False  # every draft entry dies after the commit

    def __post_init__(self) -> None:
        _ints(self, "run_id", "round_id", "version", "horizon")
        _index(self, "commit_ids")
        _index(self, "keep_ids")
        if type(self.end_round) is not bool:
            raise _fail(self, "end_round", "a bool")


@dataclass(**MESSAGE_OPTIONS)
class Reset(Message):
    """Drop everything a node holds for a run (KV cache, tree)."""

    TYPE: ClassVar[str] = "reset"
    MIN_MINOR: ClassVar[int] = 9   # 1.9: run_id
    run_id: int

    def __post_init__(self) -> None:
        _ints(self, "run_id")
