"""What `flowedge generate` does, as a function: resolve models, tokenize, run a strategy, detokenize."""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable

from flowedge.core.sampling import SamplingParams
from flowedge.errors import ConfigError
from flowedge.text.prompts import encode_prompt, load_tokenizer
from flowedge.text.streams import TextStream

if TYPE_CHECKING:
    from flowedge.engine.local import GenerationResult

log = logging.getLogger(__name__)

LOCAL_STRATEGIES = ("ar", "tree")


@dataclass(frozen=True)
class GenerateRequest:
    prompt: str
    model: str
    draft: str
    strategy: str = "ar"
    max_new_tokens: int = 64
    params: SamplingParams = SamplingParams()
    chat: bool = True
    tree_topk: int | None = None
    tree_depth: int | None = None
    tree_nodes: int | None = None
    nodes: int = 5
    profile: str = "orin-nano-8gb"
    link: str | None = None
    quant: str = "int4"             # W4A16 (flowedge's default); none = the 16-bit checkpoint

    def __post_init__(self) -> None:
        if self.max_new_tokens < 1:
            raise ConfigError(f"--max-new-tokens must be >= 1 (got {self.max_new_tokens})")


def run_generate(req: GenerateRequest, on_text: Callable[[str], None] | None = None) -> dict:
    from flowedge.models.resolve import resolve_model

    base_dir = resolve_model(req.model, quant=req.quant)
    tok = load_tokenizer(base_dir)
    prompt_ids = encode_prompt(tok, req.prompt, req.chat)
    stream = TextStream(tok, on_text) if on_text else None
    t0 = time.monotonic()
    extra: dict = {}
    if req.strategy == "ar" and ((base_dir / "manifest.json").is_file() or req.quant != "none"):
        from flowedge.engine.local import generate_ar_staged
        from flowedge.models.stage import StageModel

        res = generate_ar_staged(StageModel.load(base_dir, quant=req.quant), prompt_ids, req.max_new_tokens,
                                 req.params, stream)
    elif req.strategy == "ar":
        from flowedge.engine.local import generate_ar

        res = generate_ar(base_dir, prompt_ids, req.max_new_tokens, req.params, on_tokens=stream)
    elif req.strategy == "tree":
        res, extra = _run_tree(req, base_dir, prompt_ids, stream)
    else:
        from flowedge.sim.run import run_simulated

        res, extra = run_simulated(req, base_dir, prompt_ids, stream)
    out = {
        "strategy": req.strategy,
        "text": tok.decode(res.token_ids, skip_special_tokens=True),
        "token_ids": res.token_ids,
        "prompt_tokens": len(prompt_ids),
        "new_tokens": len(res.token_ids),
        "wall_s": round(res.wall_s, 4),
        "total_s": round(time.monotonic() - t0, 4),
        "tokens_per_s": round(len(res.token_ids) / res.wall_s, 3) if res.wall_s > 0 else None,
        **decode_stats(res),
    }
    if (mean_accept := res.mean_accept_len) is not None:   # (there were verifications)
        out["mean_accept_len"] = round(mean_accept, 4)
        out["verifications"] = len(res.accept_lens)
    out["quant"] = req.quant
    out.update(extra)
    return out


def decode_stats(res: GenerationResult) -> dict:
    """Prefill and decode apart: `tokens_per_s` spreads the prompt's prefill over the answer, so a figure to
    compare decoding speed with (llama.cpp's, docs/bench/llamacpp) counts only the tokens after the first."""
    decode_s = res.decode_s
    if res.first_token_s is None or decode_s is None:   # (both or neither)
        return {}
    rate = (len(res.token_ids) - 1) / decode_s if len(res.token_ids) > 1 and decode_s > 0 else None
    return {"prefill_s": round(res.first_token_s, 4), "decode_s": round(decode_s, 4),
            "decode_tokens_per_s": round(rate, 3) if rate is not None else None}


def tree_settings(req: GenerateRequest, topk: int, depth: int, nodes: int):
    from flowedge.engine.drafter import TreeShape

    shape = TreeShape(topk=req.tree_topk or topk, depth=req.tree_depth or depth)
    total = req.tree_nodes or nodes
    if total < 1:
        raise ConfigError(f"--tree-nodes must be >= 1 (got {total})")
    return shape, total


def _run_tree(req: GenerateRequest, base_dir, prompt_ids, stream):
    from flowedge.engine.drafter import resolve_draft_quant
    from flowedge.engine.head_drafter import load_draft, make_drafter
    from flowedge.engine.local import generate_tree
    from flowedge.models.stage import StageModel

    # One-node defaults sized for a CPU: a small tree verifies in about the time of 2-3 tokens.
    shape, total = tree_settings(req, topk=4, depth=5, nodes=16)
    base = StageModel.load(base_dir, quant=req.quant)
    drafter = make_drafter(load_draft(req.draft, base_dir, resolve_draft_quant("auto")), base)
    res = generate_tree(base, drafter, prompt_ids, req.max_new_tokens, req.params, shape, total,
                        on_tokens=stream)
    return res, {"rounds": res.rounds, "draft_forwards": res.draft_forwards,
                 "tree": {"topk": shape.topk, "depth": shape.depth, "nodes": total}}
