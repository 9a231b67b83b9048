"""Time node 0's draft call and a stage step at 1 and 16 rows on the real pair (before/after comparisons).

    python tools/bench_steps.py [--threads 1] [--context 200] [--repeats 20] [--what draft,stage,last]
        [--rows 1,16] [--activations bf16,int8] [--rounds 3]

Draft call: the whole 0.5B draft model as node 0 loads it (`engine.drafter.load_draft_model`), embedding
to logits, `rows` new tokens as one tree level over a `context`-token cache. Stage step: the 1.5B base
model's layers [0, 14) alone (a 2-stage split's first stage), hidden in, hidden out. Last stage (`last`,
not by default): layers [14, 28) plus the final norm and lm_head, hidden in, logits out. Each figure is the
median of `repeats` calls after warm-up. Works on older checkouts too (only StageModel's public API).

`--rows 1,2,4,8,16,32 --rounds 5` (the cost-model fit, `device_profiles/README.md`) loads the
asked models together and times every (model, rows) pair in turns, `rounds` times: each figure is the median
of the rounds' medians, with the least and the most (`..._spread`) since the VM's speed drifts between minutes;
`weight_bytes` counts each model's decoder-layer and lm_head weight bytes as loaded.

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


def tree_mask(rows: int, past: int) -> torch.Tensor:
    """One tree level of `rows` siblings over `past` cached tokens, as an additive mask."""
    allowed = torch.ones(rows, past + rows, dtype=torch.bool)
    allowed[:, past:] = torch.eye(rows, dtype=torch.bool)        # siblings: each sees the context and itself
    return bool_to_float_mask(allowed)


def median_s(call, repeats: int) -> float:
    """Median seconds of `repeats` calls after one untimed warm-up call."""
    call()
    samples = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        call()
        samples.append(time.perf_counter() - t0)
    return statistics.median(samples)


def _stepper(model: StageModel, context: int, max_rows: int, head: bool):
    """A `context`-token cache filled once; the returned call times `rows` new rows over it."""
    cache = model.new_cache(context + max(64, max_rows))
    ids = torch.randint(100, 20000, (context + max_rows,), generator=torch.Generator().manual_seed(0))
    hidden = model.embed(ids) if model.embed_tokens is not None else torch.randn(context + max_rows,
                                                                                 model.config.hidden_size)
    model.forward_layers(hidden[:context], torch.arange(context), bool_to_float_mask(causal_mask(context, 0)), cache)

    def timed(rows: int, repeats: int) -> float:
        def step() -> None:
            new = slice(context, context + rows)
            x = model.embed(ids[new]) if head and model.embed_tokens is not None else hidden[new]
            h = model.forward_layers(x, torch.full((rows,), context), tree_mask(rows, context), cache)
            if head:
                model.logits(h)
            cache.truncate(context)
        return median_s(step, repeats)
    return timed


def _bench(model: StageModel, context: int, rows: int, repeats: int, head: bool) -> float:
    return _stepper(model, context, rows, head)(rows, repeats)


def _nbytes(module: torch.nn.Module | None) -> int:
    if module is None:
        return 0
    return sum(t.numel() * t.element_size() for t in (*module.parameters(), *module.buffers()))


def _weight_bytes(model: StageModel) -> dict[str, int]:
    """Bytes a forward streams, as loaded: the decoder layers (W4/W8 tiles, norms, biases) and the lm_head."""
    return {"layers": _nbytes(model.layers), "lm_head": _nbytes(model.lm_head)}


def _interleaved(whats: list[str], rows_list: list[int], args: argparse.Namespace, out: dict) -> None:
    """Every (model, rows) pair timed in turns, `rounds` times: the box's drift spreads over all of them."""
    label = {"draft": "draft_call", "stage": "stage_step", "last": "last_step"}
    models = {w: load_model(w, args.stage_layers) for w in whats}
    out["weight_bytes"] = {w: _weight_bytes(m) for w, m in models.items()}
    out["stage_layers"] = list(args.stage_layers)
    steppers = {w: _stepper(m, args.context, max(rows_list), head=w != "stage") for w, m in models.items()}
    samples: dict[str, list[float]] = {}
    for _ in range(args.rounds):
        for rows in rows_list:
            for w, timed in steppers.items():
                samples.setdefault(f"{label[w]}_{rows}_ms", []).append(1000 * timed(rows, args.repeats))
    for key, values in samples.items():
        out[key] = round(statistics.median(values), 2)
        out[f"{key}_spread"] = [round(min(values), 2), round(max(values), 2)]


def load_model(what: str, stage_layers: tuple[int, int] = (0, 14)) -> StageModel:
    """The real pair's draft model, a stage of the 1.5B (`stage_layers`) or its last stage with the lm_head."""
    if what == "draft":
        return load_draft_model(resolve_model("qwen2.5-coder-0.5b"))
    start, end = stage_layers
    parts = StageParts(start, end) if what == "stage" else StageParts(14, 28, head=True)
    return StageModel.load(resolve_model("qwen2.5-coder-1.5b"), parts)


def _ab(what: str, modes: list[str], args: argparse.Namespace, out: dict) -> None:
    """Each mode's model loaded with FLOWEDGE_ACTIVATIONS set to it, then timed in turns."""
    models = {}
    for mode in modes:
        os.environ["FLOWEDGE_ACTIVATIONS"] = mode
        models[mode] = load_model(what, args.stage_layers)
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
    ap.add_argument("--rounds", type=int, default=3, help="A/B rounds (with --activations), rounds with --rows")
    ap.add_argument("--stage-layers", default="0,14", help="the stage step's layer range: start,end")
    ap.add_argument("--rows", default="", help="comma-separated row counts, timed interleaved (default 1,16)")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    start, end = (int(v) for v in args.stage_layers.split(","))
    args.stage_layers = (start, end)
    what = args.what.split(",")
    out = {"threads": args.threads, "context": args.context}
    if args.activations:
        for w in what:
            _ab(w, args.activations.split(","), args, out)
        print(json.dumps(out))
        return
    if args.rows:
        _interleaved(what, [int(r) for r in args.rows.split(",")], args, out)
        print(json.dumps(out))
        return
    if "draft" in what:
        draft = load_draft_model(resolve_model("qwen2.5-coder-0.5b"))
        for rows in (1, 16):
            out[f"draft_call_{rows}_ms"] = round(1000 * _bench(draft, args.context, rows, args.repeats, head=True), 2)
        del draft
    if "stage" in what:
        stage = load_model("stage", args.stage_layers)
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
