"""Helpers for the drafter-role tests: well-formed draft jobs and answers of a given tree and K/V shape."""
from __future__ import annotations

import torch

from flowedge.engine.drafter import Drafter, TreeShape
from flowedge.transport import protocol as p

LAYERS, KV_HEADS, HEAD_DIM = 2, 1, 4


def rows(n: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return torch.randn(LAYERS, 2, KV_HEADS, n, HEAD_DIM).to(dtype)


def draft_job(context=(5, 6, 7), keep: int = 1, n: int = 4, ran=(1, 2), **kw) -> p.DraftJob:
    tokens = torch.tensor([context[-1] if context else 5] + [10 + i for i in range(1, n)])
    fields = dict(request_id=3, seq=2, keep=keep, calls=2, width=4, lookup=1, topk=3, context=tuple(context),
                  tokens=tokens, parents=torch.tensor([0] + list(range(1, n - 1)))[: n - 1],
                  log_scores=-torch.arange(n, dtype=torch.float32) / 4, ran=torch.as_tensor(ran, dtype=torch.long),
                  rows=rows(max(0, len(context) - keep) + len(ran)))
    fields.update(kw)
    return p.DraftJob(**fields)


def draft_answer(n: int = 5, ran=(3, 4), **kw) -> p.DraftAnswer:
    fields = dict(request_id=3, seq=2, tokens=torch.arange(7, 7 + n), parents=torch.tensor([0, 0, 1, 2, 3])[: n - 1],
                  log_scores=-torch.arange(n, dtype=torch.float32), ran=torch.as_tensor(ran, dtype=torch.long),
                  rows=rows(len(ran)), calls=[(4, 9, 0.01), (4, 11, 0.02)])
    fields.update(kw)
    return p.DraftAnswer(**fields)


def rooted(model, context: list[int]) -> Drafter:
    """A drafter with a two-level tree at `context`, its calls drained: node 0 as a job would find it."""
    d = Drafter(model)
    d.build(context, TreeShape(4, 2))
    d.drain_calls()
    return d


def tree_paths(d: Drafter) -> dict[tuple[int, ...], float]:
    """Every node of the stored tree by token path, with its score."""
    t = d.base
    return {tuple(t.path_tokens(i)): round(float(t.log_scores[i]), 4) for i in range(len(t))}
