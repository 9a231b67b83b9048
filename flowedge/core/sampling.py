"""The one reference sampler: speculative verification and plain autoregressive decoding both draw
through `choose_token`, so "lossless" has a single definition to be measured against."""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor

from flowedge.errors import ConfigError


@dataclass(frozen=True, slots=True)
class SamplingParams:
    """Decoding distribution: temperature (0 = greedy), then top-k (0 = off), then top-p (1 = off)."""

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int | None = None

    def __post_init__(self) -> None:
        t = self.temperature
        if not isinstance(t, (int, float)) or not math.isfinite(t) or t < 0:
            raise ConfigError(f"temperature must be a finite number >= 0, got {self.temperature!r}")
        if isinstance(self.top_k, bool) or not isinstance(self.top_k, int) or self.top_k < 0:
            raise ConfigError(f"top_k must be an integer >= 0 (0 = off), got {self.top_k!r}")
        if not isinstance(self.top_p, (int, float)) or not 0.0 < self.top_p <= 1.0:  # also rejects nan
            raise ConfigError(f"top_p must be in (0, 1] (1 = off), got {self.top_p!r}")
        if self.seed is not None and (isinstance(self.seed, bool) or not isinstance(self.seed, int)):
            raise ConfigError(f"seed must be an integer or unset, got {self.seed!r}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


def warp_probs(logits: Tensor, params: SamplingParams) -> Tensor:
    """[..., V] logits -> [..., V] float32 probabilities, in Hugging Face's warper order:
    logits / temperature, top-k (ties with the k-th value survive), top-p (keep the smallest set of
    most likely tokens whose mass reaches top_p, at least one), softmax. Greedy gives a one-hot on the
    first maximum, so greedy and sampled decoding share one distribution function."""
    scores = logits.to(torch.float32)
    if params.greedy:
        first_max = scores.argmax(dim=-1, keepdim=True)
        return torch.zeros_like(scores).scatter_(-1, first_max, 1.0)
    scaled = scores / params.temperature
    if not bool(torch.isfinite(scaled[torch.isfinite(scores)]).all()):   # a temperature so small it overflows:
        # the same distribution from logits shifted to their maximum (0 stays 0, the rest go to -inf)
        scaled = (scores - scores.amax(dim=-1, keepdim=True)) / params.temperature
    scores = scaled
    if params.top_k > 0:
        k = min(params.top_k, scores.shape[-1])
        kth = torch.topk(scores, k, dim=-1).values[..., -1:]
        scores = scores.masked_fill(scores < kth, -math.inf)
    if params.top_p < 1.0:
        scores = _top_p_filter(scores, params.top_p)
    return torch.softmax(scores, dim=-1)


def _top_p_filter(scores: Tensor, top_p: float) -> Tensor:
    """Drop the least likely tokens while the mass dropped stays <= 1 - top_p; the top token stays."""
    # scores: [..., V] float32
    ascending, order = torch.sort(scores, dim=-1)
    mass_up_to = torch.softmax(ascending, dim=-1).cumsum(dim=-1)
    drop_sorted = mass_up_to <= 1.0 - top_p
    drop_sorted[..., -1] = False
    drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
    return scores.masked_fill(drop, -math.inf)


def choose_token(logits: Tensor, params: SamplingParams, generator: torch.Generator | None) -> int:
    """[V] logits -> one token id: the first argmax when greedy, else one multinomial draw from
    warp_probs. Exactly one draw per emitted token, so a seeded run consumes the generator the same way
    whether tokens come from speculation or from plain decoding."""
    if logits.dim() != 1:
        raise ValueError(f"choose_token takes [V] logits, got shape {tuple(logits.shape)}")
    if params.greedy:
        return int(torch.argmax(logits))
    probs = warp_probs(logits, params)
    return int(torch.multinomial(probs, 1, generator=generator))


def make_generator(params: SamplingParams) -> torch.Generator | None:
    """None when greedy (nothing is drawn); a CPU generator seeded from params.seed, or from fresh OS
    entropy when no seed is set, otherwise."""
    if params.greedy:
        return None
    generator = torch.Generator()
    if params.seed is None:
        generator.seed()
    else:
        generator.manual_seed(params.seed)
    return generator
