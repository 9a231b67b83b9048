"""Single-process generation: `ar` (the reference: plain decoding with Hugging Face's own model) and
`tree` (one-node tree speculative decoding with the pure core), sharing one result type."""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import torch

from flowedge.core.sampling import SamplingParams, choose_token, make_generator
from flowedge.core.select import select_top
from flowedge.core.verify import walk
from flowedge.engine.drafter import Drafter, TreeShape
from flowedge.models.stage import StageModel, bool_to_float_mask, causal_mask
from flowedge.text.prompts import check_context

log = logging.getLogger(__name__)

TokenSink = Callable[[list[int]], None]


@dataclass
class GenerationResult:
    token_ids: list[int]
    wall_s: float
    accept_lens: list[int] = field(default_factory=list)   # tokens gained per verification
    rounds: int = 0
    draft_forwards: int = 0
    first_token_s: float | None = None   # prefill + choosing the first token: what `wall_s - first_token_s` excludes

    @property
    def decode_s(self) -> float | None:
        """Seconds for every token after the first: decoding alone, without prefill."""
        return self.wall_s - self.first_token_s if self.first_token_s is not None else None

    @property
    def mean_accept_len(self) -> float | None:
        return sum(self.accept_lens) / len(self.accept_lens) if self.accept_lens else None


def stop_ids(config) -> set[int]:
    eos = getattr(config, "eos_token_id", None)
    if eos is None:
        return set()
    return set(eos) if isinstance(eos, (list, tuple)) else {int(eos)}


def _finish(tokens: list[int], max_new: int, stops: set[int]) -> tuple[list[int], bool]:
    """Cut at the first stop token (kept) or at max_new; report whether generation is over."""
    for i, t in enumerate(tokens[:max_new]):
        if t in stops:
            return tokens[: i + 1], True
    return tokens[:max_new], len(tokens) >= max_new


@torch.inference_mode()
def generate_ar(model_dir: Path, prompt_ids: list[int], max_new_tokens: int,
                params: SamplingParams, model=None, on_tokens: TokenSink | None = None) -> GenerationResult:
    """Plain autoregressive decoding with transformers' own model: the reference every strategy must match.
    A W4A16 checkpoint (which transformers cannot load) is decoded through `generate_ar_staged`."""
    from transformers import AutoModelForCausalLM, DynamicCache
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    model = model or load_reference(model_dir)
    if isinstance(model, StageModel):
        return generate_ar_staged(model, prompt_ids, max_new_tokens, params, on_tokens)
    check_context(len(prompt_ids), max_new_tokens, model.config.max_position_embeddings)
    gen, stops = make_generator(params), stop_ids(model.config)
    t0 = time.monotonic()
    cache = DynamicCache(config=model.config)
    ids = torch.tensor([prompt_ids])
    out: list[int] = []
    first_s: float | None = None
    while len(out) < max_new_tokens:
        logits = model(input_ids=ids, past_key_values=cache, use_cache=True).logits[0, -1]
        y = choose_token(logits.float(), params, gen)
        if not out:
            first_s = time.monotonic() - t0
        out.append(y)
        if on_tokens:
            on_tokens([y])
        if y in stops:
            break
        ids = torch.tensor([[y]])
    return GenerationResult(out, time.monotonic() - t0, first_token_s=first_s)


@torch.inference_mode()
def load_reference(model_dir: Path):
    """The model `generate_ar` decodes with: transformers' own for a plain checkpoint, the StageModel
    (int4 kernels) for a W4A16 one, whose numbers only flowedge's loader knows."""
    from transformers import AutoModelForCausalLM

    from flowedge.models.stage import is_packed

    if is_packed(model_dir):
        return StageModel.load(model_dir)
    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()


def generate_ar_staged(model: StageModel, prompt_ids: list[int], max_new_tokens: int,
                       params: SamplingParams, on_tokens: TokenSink | None = None) -> GenerationResult:
    """Plain autoregressive decoding through a StageModel (for shard directories, which transformers
    cannot load): same sampler, same stop rule as `generate_ar`."""
    check_context(len(prompt_ids), max_new_tokens, model.config.max_position_embeddings)
    gen, stops = make_generator(params), stop_ids(model.config)
    t0 = time.monotonic()
    cache = model.new_cache(len(prompt_ids) + max_new_tokens)   # static: sized once
    ids, out = torch.tensor(prompt_ids), list[int]()
    first_s: float | None = None
    while len(out) < max_new_tokens:
        past = cache.length
        h = model.forward_layers(model.embed(ids), torch.arange(past, past + ids.numel()),
                                 bool_to_float_mask(causal_mask(ids.numel(), past)), cache)
        y = choose_token(model.logits(h[-1:])[0], params, gen)
        if not out:
            first_s = time.monotonic() - t0
        out.append(y)
        if on_tokens:
            on_tokens([y])
        if y in stops:
            break
        ids = torch.tensor([y])
    return GenerationResult(out, time.monotonic() - t0, first_token_s=first_s)


@torch.inference_mode()
def generate_tree(base: StageModel, drafter: Drafter, prompt_ids: list[int], max_new_tokens: int,
                  params: SamplingParams, shape: TreeShape, total: int,
                  on_tokens: TokenSink | None = None) -> GenerationResult:
    """Tree speculative decoding in one process: draft a tree, verify it whole, keep the accepted path."""
    check_context(len(prompt_ids), max_new_tokens, base.config.max_position_embeddings)
    gen, stops = make_generator(params), stop_ids(base.config)
    t0 = time.monotonic()
    drafter.reset()
    cache = base.new_cache(len(prompt_ids) + max_new_tokens + total)   # static: prompt, answer, one tree
    n = len(prompt_ids)
    h = base.forward_layers(base.embed(torch.tensor(prompt_ids)), torch.arange(n),
                            bool_to_float_mask(causal_mask(n, 0)), cache)
    drafter.observe(0, h)   # a draft head reads the base's features (engine/head_drafter.py)
    out = [choose_token(base.logits(h[-1:])[0], params, gen)]
    result = GenerationResult([], 0.0, first_token_s=time.monotonic() - t0)
    if on_tokens:
        on_tokens(out[:])
    done = out[0] in stops
    while not done and len(out) < max_new_tokens:
        tree, _ = select_top(drafter.build(prompt_ids + out, shape), total, "score")
        past = cache.length
        allowed = torch.ones(len(tree), past + len(tree), dtype=torch.bool)
        allowed[:, past:] = tree.ancestor_mask()
        h = base.forward_layers(base.embed(tree.tokens), (past + tree.depths), bool_to_float_mask(allowed), cache)
        logits = base.logits(h)
        res = walk(tree, 0, lambda i: logits[i], params, gen)
        drafter.observe(past, h[res.committed])
        cache.keep(torch.cat([torch.arange(past), past + torch.tensor(res.committed)]))
        result.accept_lens.append(len(res.tokens))
        result.rounds += 1
        before = len(out)
        out, done = _finish(out + res.tokens, max_new_tokens, stops)
        if on_tokens and len(out) > before:
            on_tokens(out[before:])
    result.token_ids, result.wall_s = out[:max_new_tokens], time.monotonic() - t0
    result.draft_forwards = drafter.forwards
    return result
