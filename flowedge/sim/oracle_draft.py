"""`bench --draft oracle`: perfect drafting at the real draft's cost, the bound for every strategy.

`OracleDraft` wraps the real draft model. Every draft call runs unchanged (same rows, same cache, same
simulated cost), but where a row's token path is a prefix of the reference answer (prompt + the base
model's own continuation, known from the reference run), its logits are raised so that the reference's
next token comes out top-1. The other children keep the draft's own ranking. So each strategy's trees,
draft calls and segments are what they would be, only its best guess is always right: at temperature 0
acceptance is as long as the tree allows, and the table shows how far each strategy is from that.

A row's path is read off the attention mask the drafter builds: the cache entries a row may see are
exactly its committed context and its tree ancestors, in position order.
"""
from __future__ import annotations

import torch


class _TokenCache:
    """The draft's KV cache plus each entry's token and position (for reading a row's path)."""

    def __init__(self, inner) -> None:
        self.inner = inner
        self.tokens: list[int] = []
        self.positions: list[int] = []

    @property
    def length(self) -> int:
        return self.inner.length

    def keep(self, idx: torch.Tensor) -> None:
        self.inner.keep(idx)
        self.tokens = [self.tokens[i] for i in idx.tolist()]
        self.positions = [self.positions[i] for i in idx.tolist()]

    def truncate(self, length: int) -> None:
        self.inner.truncate(length)
        del self.tokens[length:], self.positions[length:]

    def nbytes(self) -> int:
        return self.inner.nbytes()


class OracleDraft:
    """A draft model whose top-1 proposal follows the reference answer (see module docstring)."""

    def __init__(self, model) -> None:
        self.model = model
        self.reference: list[int] = []
        self._tokens = torch.empty(0, dtype=torch.long)
        self._next: list[int | None] = []

    def __getattr__(self, name):   # config, dtype, ...: the real draft's
        return getattr(self.model, name)

    def set_reference(self, prompt_ids: list[int], answer_ids: list[int]) -> None:
        self.reference = list(prompt_ids) + list(answer_ids)

    def new_cache(self, *args, **kwargs) -> _TokenCache:
        return _TokenCache(self.model.new_cache(*args, **kwargs))

    def embed(self, tokens: torch.Tensor) -> torch.Tensor:
        self._tokens = tokens.reshape(-1)
        return self.model.embed(tokens)

    def forward_layers(self, hidden: torch.Tensor, positions: torch.Tensor, mask: torch.Tensor,
                       cache: _TokenCache) -> torch.Tensor:
        past = cache.length
        out = self.model.forward_layers(hidden, positions, mask, cache.inner)
        cache.tokens += self._tokens.tolist()
        cache.positions += positions.reshape(-1).tolist()
        allowed = mask.reshape(mask.shape[-2], mask.shape[-1]) == 0
        self._next = [self._reference_next(cache, allowed[i], past + i) for i in range(hidden.shape[0])]
        return out

    def _reference_next(self, cache: _TokenCache, allowed: torch.Tensor, own: int) -> int | None:
        cols = allowed.nonzero().reshape(-1).tolist()
        if own not in cols:
            cols.append(own)
        path = [cache.tokens[c] for c in sorted(cols, key=lambda c: cache.positions[c])]
        n = len(path)
        if n < len(self.reference) and path == self.reference[:n]:
            return self.reference[n]
        return None

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = self.model.logits(hidden).clone()
        for i, token in enumerate(self._next[-hidden.shape[0]:] if self._next else []):
            if token is not None:
                logits[i, token] = logits[i].max() + 1.0
        return logits
