"""Semantic checks of data-plane messages at a node's boundary, before the engine sees them.

`decode` already guarantees types and ranges of every field (protocol.py); what it cannot know is
what makes a message usable here: the stage's hidden width and wire dtype, the tree rules (every
node's parent comes before it, so a segment can never describe a cycle), disjoint prune sets, and
sizes a node is willing to hold. A failed check raises `InvalidMessage` naming the broken rule (the
key a node counts drops under); no check asserts, and none looks at node state, so they are plain
functions both the stages and the head call.

Wire conventions checked here (see node/wire.py and protocol.Segment, 1.4): node, parent and prune
ids are the engine's own (no shift); `root_rows` names the tree nodes that hang off the committed
context; a prefill chunk carries no tree ids.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from flowedge.core.config import MAX_SEGMENT_NODES   # the engine never builds larger segments
from flowedge.errors import InvalidMessage
from flowedge.transport import protocol as proto

MAX_NODE_ID = 1 << 16           # node ids of one round: a draft tree holds hundreds, never this many
MAX_TEMPERATURE = 100.0         # as a client's PromptRequest


@dataclass(frozen=True, slots=True)
class StagePlan:
    """What a stage accepts: its model's hidden width and context, the assignment's wire dtype."""

    hidden_size: int
    hidden_wire: str
    max_positions: int
    max_segment_nodes: int = MAX_SEGMENT_NODES
    max_node_id: int = MAX_NODE_ID


@dataclass(frozen=True, slots=True)
class ReturnPlan:
    """What the head accepts on its return port for the request it runs."""

    hidden_size: int
    vocab_size: int
    max_segment_nodes: int = MAX_SEGMENT_NODES


# ---------------------------------------------------------------- stage side
def check_stage_input(msg: proto.Message, plan: StagePlan) -> None:
    """InvalidMessage unless `msg` is a Segment, Prune or Reset a stage with `plan` can run."""
    if isinstance(msg, proto.Segment):
        check_segment(msg, plan)
    elif isinstance(msg, proto.Prune):
        check_prune(msg, plan.max_node_id)
    elif not isinstance(msg, proto.Reset):
        raise InvalidMessage("unexpected_type", f"a stage takes no {msg.TYPE} on its data path")


def check_segment(msg: proto.Segment, plan: StagePlan) -> None:
    """Hidden states of the planned width and dtype, sane sizes and positions, tree-ordered ids."""
    n = len(msg)
    if msg.hidden is None:
        raise InvalidMessage("segment_payload", "a stage's input carries hidden states, not token ids")
    if msg.hidden_wire != plan.hidden_wire:
        raise InvalidMessage("segment_dtype", f"hidden states in {msg.hidden_wire}, plan says {plan.hidden_wire}")
    if msg.hidden.shape[1] != plan.hidden_size:
        raise InvalidMessage("segment_width", f"hidden width {msg.hidden.shape[1]}, model has {plan.hidden_size}")
    _check_size(n, plan.max_segment_nodes)
    _check_sampling(msg)
    if n and int(msg.positions.max()) >= plan.max_positions:
        raise InvalidMessage("segment_positions", f"position {int(msg.positions.max())} beyond the model's "
                                                  f"context of {plan.max_positions}")
    if msg.kind == "prefill":
        _check_prefill(msg)
    else:
        check_tree_ids(msg.node_ids, msg.parent_ids, msg.root_rows, plan.max_node_id)


def _check_size(n: int, max_nodes: int) -> None:
    if n > max_nodes:
        raise InvalidMessage("segment_size", f"{n} nodes, at most {max_nodes} per segment")


def _check_sampling(msg: proto.Segment) -> None:
    if msg.temperature is not None and msg.temperature > MAX_TEMPERATURE:
        raise InvalidMessage("segment_sampling", f"temperature {msg.temperature} above {MAX_TEMPERATURE}")


def _check_prefill(msg: proto.Segment) -> None:
    """A prompt chunk: at least one row, consecutive positions (its rows carry no tree ids: decode
    refuses any)."""
    n = len(msg)
    if n == 0:
        raise InvalidMessage("prefill_empty", "a prefill chunk holds at least one token")
    first = int(msg.positions[0])
    if not torch.equal(msg.positions, torch.arange(first, first + n)):
        raise InvalidMessage("prefill_positions", "prefill positions must be consecutive")


def check_tree_ids(node_ids: torch.Tensor, parent_ids: torch.Tensor, root_rows: torch.Tensor | None,
                   max_node_id: int) -> None:
    """Ids of draft nodes: distinct, below `max_node_id`, each parent (where the node is not a root)
    before its child, root rows' parent ids 0.

    A parent id smaller than its child's is how the draft tree stores nodes (core/tree.py), and it
    rules out cycles, a node being its own parent included."""
    if not node_ids.numel():
        return
    if int(node_ids.max()) >= max_node_id:
        raise InvalidMessage("segment_ids", f"draft node ids must lie below {max_node_id}")
    if node_ids.unique().numel() != node_ids.numel():
        raise InvalidMessage("segment_ids", "a segment names a node twice")
    child = torch.ones(node_ids.numel(), dtype=torch.bool)
    if root_rows is not None and root_rows.numel():
        child[root_rows] = False
        if bool(parent_ids[root_rows].any()):
            raise InvalidMessage("segment_parents", "a root row's parent id must be 0 (it has no parent node)")
    if bool((parent_ids[child] >= node_ids[child]).any()):
        raise InvalidMessage("segment_parents", "every parent must come before its child (no cycles)")


def check_prune(msg: proto.Prune, max_node_id: int = MAX_NODE_ID) -> None:
    """Ids below the horizon, keep strictly ascending, commit without repeats, the two sets disjoint."""
    if msg.horizon > max_node_id:
        raise InvalidMessage("prune_horizon", f"horizon {msg.horizon} beyond {max_node_id}")
    commit, keep = msg.commit_ids, msg.keep_ids
    for name, ids in (("commit", commit), ("keep", keep)):
        if ids.numel() and int(ids.max()) >= msg.horizon:
            raise InvalidMessage("prune_range", f"{name} ids reach past the horizon {msg.horizon}")
    if keep.numel() > 1 and bool((keep[1:] <= keep[:-1]).any()):
        raise InvalidMessage("prune_order", "keep ids must be strictly ascending")
    if commit.unique().numel() != commit.numel():
        raise InvalidMessage("prune_repeat", "commit ids repeat a node")
    if bool(torch.isin(commit, keep).any()):
        raise InvalidMessage("prune_overlap", "commit and keep sets overlap")


# ---------------------------------------------------------------- head side
def check_returned_segment(msg: proto.Segment, plan: ReturnPlan, known_ids: int) -> None:
    """A segment back from the last stage: node ids the head sent this round (below `known_ids`; none
    on prefill rows), and a payload the head can read — hidden states [rows, hidden_size] or token
    choices inside the vocabulary."""
    n = len(msg)
    _check_size(n, plan.max_segment_nodes)
    if msg.kind != "prefill" and n and int(msg.node_ids.max()) >= known_ids:   # a prefill names no nodes
        raise InvalidMessage("return_ids", f"node ids outside the {known_ids} nodes the head sent")
    if msg.hidden is not None:
        if msg.hidden.shape[1] != plan.hidden_size:
            raise InvalidMessage("return_width", f"hidden width {msg.hidden.shape[1]}, "
                                                 f"model has {plan.hidden_size}")
    elif msg.token_ids is not None and msg.token_ids.numel() and int(msg.token_ids.max()) >= plan.vocab_size:
        raise InvalidMessage("return_tokens", f"token ids beyond the vocabulary of {plan.vocab_size}")
