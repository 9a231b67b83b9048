"""Lossless acceptance: walk the draft tree as far as the base model's logits allow.

At every node the next token is drawn from the base model's own (warped) distribution and only then
matched against the node's draft children, so each emitted token has exactly the distribution plain
decoding would give it: P(output = x) = p(x). With deterministic (top-k) drafts nothing else is needed.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor

from flowedge.core.sampling import SamplingParams, choose_token
from flowedge.core.tree import DraftTree

LogitsSource = dict[int, Tensor] | Callable[[int], Tensor | None]


@dataclass(frozen=True, slots=True)
class WalkResult:
    """One walk: `committed` node ids in path order (starting at the walk's start), the token chosen
    from each one's logits, and the alive child matching the last token, if any."""

    committed: list[int]
    tokens: list[int]
    next_node: int | None

    def __post_init__(self) -> None:
        if not self.committed or len(self.committed) != len(self.tokens):
            raise ValueError("a walk commits at least one node and chooses one token per committed node")

    @property
    def continues(self) -> bool:
        """FlowSpec's continuous condition: the new token is already a live draft node."""
        return self.next_node is not None


def walk(
    tree: DraftTree,
    start: int,
    logits: LogitsSource,
    params: SamplingParams,
    generator: torch.Generator | None,
    alive: Tensor | None = None,
) -> WalkResult:
    """Accept from `start` (whose logits must be known): choose a token from the node's logits, move to
    the alive child holding that token, repeat while that child's logits are known."""
    lookup = logits.get if isinstance(logits, dict) else logits

    def chosen(node: int) -> int | None:   # drawn lazily: one draw per visited node, in path order
        node_logits = lookup(node)
        return None if node_logits is None else choose_token(node_logits, params, generator)

    return walk_chosen(tree, start, chosen, alive)


def walk_chosen(
    tree: DraftTree,
    start: int,
    chosen: Callable[[int], int | None],
    alive: Tensor | None = None,
) -> WalkResult:
    """The walk over tokens already chosen from the base model's distribution at each node (by `walk`
    from logits, or by the last stage when it holds the lm_head). Lossless either way: every node's
    token is one independent draw from p(. | its path), and the walk only follows matches."""
    node = int(start)
    if not 0 <= node < len(tree):
        raise ValueError(f"walk start {start} is outside a tree of {len(tree)} nodes")
    if alive is not None and alive.shape[0] < len(tree):
        raise ValueError(f"alive mask has {alive.shape[0]} entries for a tree of {len(tree)} nodes")
    token = chosen(node)
    if token is None:
        raise ValueError(f"walk start {start} has no base-model logits yet")
    committed: list[int] = []
    tokens: list[int] = []
    while True:
        committed.append(node)
        tokens.append(token)
        child = _matching_child(tree, node, token, alive)
        if child is None:
            return WalkResult(committed, tokens, None)
        token = chosen(child)
        if token is None:
            return WalkResult(committed, tokens, child)
        node = child


def _matching_child(tree: DraftTree, node: int, token: int, alive: Tensor | None) -> int | None:
    """The first alive child of `node` holding `token` (merging keeps alive siblings distinct)."""
    hit = (tree.parents == node) & (tree.tokens == token)
    if alive is not None:
        hit &= alive[: len(tree)]
    ids = hit.nonzero()
    return int(ids[0]) if ids.numel() else None
