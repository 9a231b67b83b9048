"""Does `torch.compile` (inductor, CPU) make a decode step faster? Eager against compiled, one process.

    python tools/bench_compile.py [--threads 1] [--what draft,stage] [--rows 1,16] [--rounds 3] [--repeats 12]

What is compiled: each decoder layer's two pure-tensor halves, the part before attention (RMSNorm, the
fused q/k/v call, RoPE) and the part after it (o_proj, residual, RMSNorm, gate/up, SiLU x up, down,
residual), with static shapes per row count (one graph per bucket, shared by every layer: the layers'
weights are graph inputs). The KV cache write and the attention kernel stay eager between them: the
cache's length changes every step and the attention kernel is a ctypes call. The W4A16/W8A16 Linears are
custom ops (`flowedge::w4a16_linear`...), so inductor fuses only the elementwise work around them, which
is the whole of what a CPU step spends outside the C kernels (~3.5 ms of a 25 ms draft call, 1 row).

Printed per model and row count: the first call's seconds (the compile), eager and compiled medians in
turns (least of `rounds` medians of `repeats` calls), and bitwise checks: compiled == eager, and how many
rows of a compiled call equal eager's (eager rows are row-invariant, tests/test_models_decoder.py, so a row
that differs is one whose bits depend on the rows beside it: T=0 exactness lost).
Draft: the 0.5B whole model's layers; stage: the 1.5B's layers [0, 14); context 200 tokens.
"""
from __future__ import annotations

import argparse
import json
import time
from dataclasses import dataclass

import torch

from bench_steps import load_model, median_s, tree_mask   # this directory's step timer (run as a script)
from flowedge.kernels.attention import attend
from flowedge.models import decoder
from flowedge.models.stage import StageModel, bool_to_float_mask, causal_mask

CONTEXT = 200


def before_attention(layer: decoder.DecoderLayer, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
    attn, n = layer.self_attn, h.shape[0]
    q, k, v = attn._project(layer.input_layernorm(h))
    rotary = decoder.Rotary(cos, sin)
    q = rotary.apply(q.reshape(n, attn.heads, attn.head_dim))
    k = rotary.apply(k.reshape(n, attn.kv_heads, attn.head_dim))
    return q, k, v.reshape(n, attn.kv_heads, attn.head_dim)


def after_attention(layer: decoder.DecoderLayer, h: torch.Tensor, attended: torch.Tensor) -> torch.Tensor:
    h = h + layer.self_attn.o_proj(attended.reshape(h.shape[0], -1))
    return h + layer.mlp(layer.post_attention_layernorm(h))


@dataclass
class Halves:
    """The two halves a layer runs: eager functions, or their compiled versions."""
    before: object = before_attention
    after: object = after_attention


def split_forward(active: dict):
    """A DecoderLayer.forward running `active["halves"]` around the eager cache write and attention (one
    request)."""
    def forward(layer, h, rotary, requests):
        halves = active["halves"]
        q, k, v = halves.before(layer, h, rotary.cos, rotary.sin)
        req = requests[0]
        keys, values = req.cache.update(k.transpose(0, 1)[None], v.transpose(0, 1)[None], layer.index)
        return halves.after(layer, h, attend(q, keys[0], values[0], req.mask))
    return forward


def _step_fn(model: StageModel):
    """A step of `rows` sibling rows over a CONTEXT-token cache, the cache cut back after it."""
    cache = model.new_cache(CONTEXT + 64)
    hidden = torch.randn(CONTEXT + 64, model.config.hidden_size, generator=torch.Generator().manual_seed(0))
    model.forward_layers(hidden[:CONTEXT], torch.arange(CONTEXT), bool_to_float_mask(causal_mask(CONTEXT, 0)), cache)

    def step(rows: int) -> torch.Tensor:
        out = model.forward_layers(hidden[CONTEXT:CONTEXT + rows], torch.full((rows,), CONTEXT),
                                   tree_mask(rows, CONTEXT), cache)
        cache.truncate(CONTEXT)
        return out
    return step


def measure(what: str, rows_list: list[int], rounds: int, repeats: int) -> dict:
    model, eager, compiled = load_model(what), Halves(), Halves(torch.compile(before_attention, dynamic=False),
                                                             torch.compile(after_attention, dynamic=False))
    step, active = _step_fn(model), {"halves": eager}
    decoder.DecoderLayer.forward = split_forward(active)
    out: dict = {}
    first: dict[tuple[str, int], torch.Tensor] = {}
    for name, halves in (("eager", eager), ("compiled", compiled)):
        active["halves"] = halves
        for rows in rows_list:
            t0 = time.perf_counter()
            first[name, rows] = step(rows)
            out[f"{what}_{rows}_first_call_s_{name}"] = round(time.perf_counter() - t0, 2)
    for rows in rows_list:
        out[f"{what}_{rows}_compiled_equals_eager"] = torch.equal(first["eager", rows], first["compiled", rows])
        out[f"{what}_{rows}_max_abs_diff"] = float((first["eager", rows] - first["compiled", rows]).abs().max())
        same = (first["eager", rows] == first["compiled", rows]).all(dim=-1)
        out[f"{what}_{rows}_rows_equal_to_eager"] = f"{int(same.sum())}/{rows}"
        best = {"eager": float("inf"), "compiled": float("inf")}
        for _ in range(rounds):
            for name, halves in (("eager", eager), ("compiled", compiled)):
                active["halves"] = halves
                best[name] = min(best[name], 1000 * median_s(lambda: step(rows), repeats))
        for name, ms in best.items():
            out[f"{what}_{rows}_ms_{name}"] = round(ms, 2)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--what", default="draft,stage")
    ap.add_argument("--rows", default="1,16")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--repeats", type=int, default=12)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    # one graph per (half, row count, model): the default limit of 8 would silently leave the second model eager
    torch._dynamo.config.recompile_limit = 64
    torch._dynamo.config.fail_on_recompile_limit_hit = True
    rows_list = [int(r) for r in args.rows.split(",")]
    if 1 not in rows_list:
        rows_list.insert(0, 1)
    out = {"threads": args.threads, "context": CONTEXT, "torch": torch.__version__}
    forward = decoder.DecoderLayer.forward
    for what in args.what.split(","):
        out.update(measure(what, rows_list, args.rounds, args.repeats))
        decoder.DecoderLayer.forward = forward
    print(json.dumps(out))


if __name__ == "__main__":
    main()
