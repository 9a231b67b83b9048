"""Oracle verification for the simulator: base-model logits computed along the accepted path only.

Why it is exact: verification (greedy or sampled) only ever reads the base model's logits at nodes it
accepts, and a tree node's logits are a function of its token path alone (tree attention over its
ancestors == causal attention over the path). So instead of running every draft token through the
stages, the head can ask a whole-model `PathOracle` for the logits at the end of a path, computed
incrementally with one KV cache: about one base token per output token instead of every tree token.

The stages keep their bookkeeping (segments, prune versions, cache lengths, Compute actions with the
same token counts) through `ShapeOnlyStage`, so the simulated clock is charged exactly as with real
stage math; only the layer arithmetic is skipped. `tests/test_sim_oracle.py` checks that both modes give
the same tokens and the same simulated time.
"""
from __future__ import annotations

import logging

import torch

from flowedge.core.sampling import SamplingParams, choose_token, make_generator
from flowedge.models.stage import StageModel, bool_to_float_mask, causal_mask

log = logging.getLogger(__name__)

MAX_CACHED_PATHS = 4096   # ~0.6 MB of fp32 logits each for a 152K vocabulary


class PathOracle:
    """Logits of a whole base model after a token path, with a path cache shared by every caller."""

    def __init__(self, model: StageModel) -> None:
        self.model = model
        self.cache = model.new_cache()
        self.tokens: list[int] = []          # the token path behind the KV cache entries
        self._rows = torch.zeros(0, model.config.hidden_size)   # their final hidden states
        self._logits: dict[tuple[int, ...], torch.Tensor] = {}
        self.forwards = 0
        self.tokens_run = 0

    def clear(self) -> None:
        """Forget cached paths (between prompts: keeps memory flat)."""
        self._logits.clear()
        self.cache.truncate(0)
        self.tokens = []
        self._rows = self._rows[:0]

    @torch.inference_mode()
    def logits(self, path: list[int]) -> torch.Tensor:
        """[V] float32 logits after the last token of `path` (prompt + accepted tokens + tree path)."""
        key = tuple(path)
        hit = self._logits.get(key)
        if hit is not None:
            return hit
        h = self._run_to(path)
        out = self.model.logits(h[-1:])[0]
        if len(self._logits) >= MAX_CACHED_PATHS:
            self._logits.clear()
        self._logits[key] = out
        return out

    @torch.inference_mode()
    def hidden_along(self, path: list[int]) -> torch.Tensor:
        """[len(path), H] final hidden states at every position of `path` (what a draft head reads)."""
        if _common_prefix(self.tokens, path) < len(path):
            self._run_to(path)
        return self._rows[: len(path)]

    def _run_to(self, path: list[int]) -> torch.Tensor:
        """Run the cache up to the end of `path` (re-running at least its last token); the new rows' hidden states."""
        keep = _common_prefix(self.tokens, path)
        if keep == len(path):   # the path is a prefix of what the cache holds: re-run its last token
            keep -= 1
        self.cache.truncate(keep)
        new = torch.tensor(path[keep:], dtype=torch.long)
        h = self.model.forward_layers(self.model.embed(new), torch.arange(keep, len(path)),
                                      bool_to_float_mask(causal_mask(new.numel(), keep)), self.cache)
        self._rows = torch.cat([self._rows[:keep], h])
        self.tokens = list(path)
        self.forwards += 1
        self.tokens_run += new.numel()
        return h

    def generate(self, prompt_ids: list[int], max_new_tokens: int, params: SamplingParams,
                 stop_ids: set[int]) -> list[int]:
        """Plain autoregressive decoding through the oracle (the bench's reference in oracle mode); its
        logits stay cached, so strategies that follow the same path do not pay for them again."""
        gen = make_generator(params)
        out: list[int] = []
        while len(out) < max_new_tokens:
            y = choose_token(self.logits(list(prompt_ids) + out), params, gen)
            out.append(y)
            if y in stop_ids:
                break
        return out


def _common_prefix(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


class LengthOnlyCache:
    """The KVCache API with lengths only: enough for a stage's bookkeeping without its tensors."""

    def __init__(self) -> None:
        self.length = 0

    def keep(self, idx: torch.Tensor) -> None:
        if idx.numel() and int(idx.max()) >= self.length:
            raise IndexError(f"keep index {int(idx.max())} outside a cache of {self.length} entries")
        self.length = int(idx.numel())

    def truncate(self, length: int) -> None:
        self.length = min(self.length, length)

    def nbytes(self) -> int:
        return 0


class ShapeOnlyStage:
    """Stands in for a stage's StageModel under oracle verification: same interface, no arithmetic.

    `forward_layers` (`forward_packed`) appends the segment (each request's rows) to the length-only cache and
    passes the (placeholder) hidden states on unchanged, so message sizes and every Compute's token and context
    counts stay exact."""

    def __init__(self, config, start: int, end: int) -> None:
        self.config = config
        self.layers = range(start, end)

    def new_cache(self, capacity: int = 256) -> LengthOnlyCache:
        return LengthOnlyCache()

    def forward_layers(self, hidden: torch.Tensor, positions: torch.Tensor, mask: torch.Tensor,
                       cache: LengthOnlyCache) -> torch.Tensor:
        # hidden: [n, H]; mask: [n, cache.length + n] -> [n, H] (unchanged)
        return self.forward_packed(hidden, positions, [mask], [cache])

    def forward_packed(self, hidden: torch.Tensor, positions: torch.Tensor, masks: list[torch.Tensor],
                       caches: list[LengthOnlyCache]) -> torch.Tensor:
        # a batched forward: masks[i] [n_i, caches[i].length + n_i]; each cache grows by its own rows
        for mask, c in zip(masks, caches):
            if mask.dim() != 2 or mask.shape[1] != c.length + mask.shape[0]:
                raise ValueError(f"mask {tuple(mask.shape)} does not match its rows after {c.length} cached")
        if sum(m.shape[0] for m in masks) != hidden.shape[0]:
            raise ValueError(f"{hidden.shape[0]} tokens for masks of {sum(m.shape[0] for m in masks)} rows")
        for mask, c in zip(masks, caches):
            c.length += mask.shape[0]
        return hidden
