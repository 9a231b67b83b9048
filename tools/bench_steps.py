"""Time node 0's draft call and a stage step at 1 and 16 rows on the real pair (before/after comparisons).

    python tools/bench_steps.py [--threads 1] [--context 200] [--repeats 20] [--what draft,stage,last]
        [--activations bf16,int8 [--rounds 3]]

Draft call: the whole 0.5B draft model as node 0 loads it (`engine.drafter.load_draft_model`), embedding
to logits, `rows` new tokens as one tree level over a `context`-token cache. Stage step: the 1.5B base
model's layers [0, 14) alone (a 2-stage split's first stage), hidden in, hidden out. Last stage (`last`,
not by default): layers [14, 28) plus the final norm and lm_head, hidden in, logits out. Each figure is the
median of `repeats` calls after warm-up. Works on older checkouts too (only StageModel's public API).

`--activations bf16,int8` loads each model once per activation precision (FLOWEDGE_ACTIVATIONS, read at load)
and times them A/B interleaved in one process, `--rounds` times; each figure is then the least of the rounds'
medians (a shared box's bursts fall on one round, not on one mode).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import torch

from flowedge.engine.drafter import load_draft_model
from flowedge.models.resolve import resolve_model
from flowedge.models.stage import StageModel, StageParts, bool_to_float_mask, causal_mask


def _tree_mask(rows: int, past: int) -> torch.Tensor:
    allowed = torch.ones(rows, past + rows, dtype=torch.bool)
    allowed[:, past:] = torch.eye(rows, dtype=torch.bool)        # siblings: each sees the context and itself
    return bool_to_float_mask(allowed)


def _time(call, repeats: int) -> float:
    call()
    samples = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        call()
        samples.append(time.perf_counter() - t0)
    return statistics.median(samples)


def _bench(model: StageModel, context: int, rows: int, repeats: int, head: bool) -> float:
    cache = model.new_cache(context + 64)
    ids = torch.randint(100, 20000, (context + rows,), generator=torch.Generator().manual_seed(0))
    hidden = model.embed(ids) if model.embed_tokens is not None else torch.randn(context + rows, model.config.hidden_size)
    model.forward_layers(hidden[:context], torch.arange(context), bool_to_float_mask(causal_mask(context, 0)), cache)

    def step() -> None:
        x = model.embed(ids[context:]) if head and model.embed_tokens is not None else hidden[context:]
        h = model.forward_layers(x, torch.full((rows,), context), _tree_mask(rows, context), cache)
        if head:
            model.logits(h)
        cache.truncate(context)
    return _time(step, repeats)


def _load(what: str) -> StageModel:
    if what == "draft":
        return load_draft_model(resolve_model("qwen2.5-coder-0.5b"))
    parts = StageParts(0, 14) if what == "stage" else StageParts(14, 28, head=True)
    return StageModel.load(resolve_model("qwen2.5-coder-1.5b"), parts)


def _ab(what: str, modes: list[str], args: argparse.Namespace, out: dict) -> None:
    """Each mode's model loaded with FLOWEDGE_ACTIVATIONS set to it, then timed in turns."""
    models = {}
    for mode in modes:
        os.environ["FLOWEDGE_ACTIVATIONS"] = mode
        models[mode] = _load(what)
    label = {"draft": "draft_call", "stage": "stage_step", "last": "last_step"}[what]
    for rows in (1, 16):
        best = {mode: float("inf") for mode in modes}
        for _ in range(args.rounds):
            for mode, model in models.items():
                best[mode] = min(best[mode], _bench(model, args.context, rows, args.repeats, head=what != "stage"))
        for mode in modes:
            out[f"{label}_{rows}_ms_{mode}"] = round(1000 * best[mode], 2)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--context", type=int, default=200)
    ap.add_argument("--repeats", type=int, default=20)
    ap.add_argument("--what", default="draft,stage", help="comma-separated: draft, stage, last")
    ap.add_argument("--activations", default="", help="comma-separated FLOWEDGE_ACTIVATIONS values to A/B")
    ap.add_argument("--rounds", type=int, default=3, help="A/B rounds (with --activations)")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    what = args.what.split(",")
    out = {"threads": args.threads, "context": args.context}
    if args.activations:
        for w in what:
            _ab(w, args.activations.split(","), args, out)
        print(json.dumps(out))
        return
    if "draft" in what:
        draft = load_draft_model(resolve_model("qwen2.5-coder-0.5b"))
        for rows in (1, 16):
            out[f"draft_call_{rows}_ms"] = round(1000 * _bench(draft, args.context, rows, args.repeats, head=True), 2)
        del draft
    if "stage" in what:
        stage = StageModel.load(resolve_model("qwen2.5-coder-1.5b"), StageParts(0, 14))
        for rows in (1, 16):
            out[f"stage_step_{rows}_ms"] = round(1000 * _bench(stage, args.context, rows, args.repeats, head=False), 2)
        del stage
    if "last" in what:
        last = StageModel.load(resolve_model("qwen2.5-coder-1.5b"), StageParts(14, 28, head=True))
        for rows in (1, 16):
            out[f"last_step_{rows}_ms"] = round(1000 * _bench(last, args.context, rows, args.repeats, head=True), 2)
    print(json.dumps(out))


if __name__ == "__main__":
    main()
