"""A/B: one-process `tree` decoding with a draft head against the draft model, and both against `ar`.

    python tools/bench_draft_head.py --head head:qwen2.5-coder-1.5b [--draft qwen2.5-coder-0.5b]
        [--max-new-tokens 128] [--rounds 2] [--tree-nodes 16] [--out results.json]

What `flowedge generate --strategy ar|tree [--draft ...]` runs (generate.py: the W4A16 base through
`generate_ar_staged`, `generate_tree` with a `Drafter` or a `HeadDrafter`), with every model loaded once and
the three runs of a prompt interleaved (the order alternating from round to round), so a box shared with
other work loads all three alike. Per run: decode tokens/s (tokens after the first over the seconds after
it: prefill apart), mean accepted tokens per verification, draft calls; every answer is checked against
`ar`'s, token for token. Prompts: five kinds, none a benchmark prompt nor a training instruction
(flowedge/distill/corpus.py).
"""
from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from flowedge.core.sampling import SamplingParams
from flowedge.engine.drafter import TreeShape, resolve_draft_quant
from flowedge.engine.head_drafter import load_draft, make_drafter
from flowedge.engine.local import generate_ar_staged, generate_tree
from flowedge.models.resolve import resolve_model
from flowedge.models.stage import StageModel
from flowedge.generate import decode_stats
from flowedge.text.prompts import encode_prompt, load_tokenizer

PROMPTS = {
    "code": "Write a Python function that checks whether two strings are anagrams of each other, with doctests.",
    "explain": "Explain how HTTP caching works, including the Cache-Control and ETag headers.",
    "sql": "Write a SQL schema for a library with books, members and loans, and a query listing overdue loans.",
    "prose": "Write a short product description for a reusable steel water bottle.",
    "shell": "Write a bash function that backs up a directory into a timestamped tar.gz file.",
}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="qwen2.5-coder-1.5b")
    ap.add_argument("--draft", default="qwen2.5-coder-0.5b")
    ap.add_argument("--head", required=True, help="head:NAME or a head file")
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("--tree-nodes", type=int, default=16)
    ap.add_argument("--tree-depth", type=int, default=5)
    ap.add_argument("--tree-topk", type=int, default=4)
    ap.add_argument("--head-tree-nodes", type=int, default=None, help="the head's tree size (default: the same)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    base_dir = resolve_model(args.model)
    tok = load_tokenizer(base_dir)
    base = StageModel.load(base_dir)
    quant = resolve_draft_quant("auto")
    drafters = {"tree+0.5B": make_drafter(load_draft(args.draft, base_dir, quant), base),
                "tree+head": make_drafter(load_draft(args.head, base_dir, quant), base)}
    shape = TreeShape(args.tree_topk, args.tree_depth)
    nodes = {"tree+0.5B": args.tree_nodes, "tree+head": args.head_tree_nodes or args.tree_nodes}
    runs = []
    for r in range(args.rounds):
        for kind, text in PROMPTS.items():
            ids = encode_prompt(tok, text, chat=True)
            order = ["ar", "tree+0.5B", "tree+head"]
            order = order if (r + len(runs) // 3) % 2 == 0 else order[::-1]
            results = {}
            for name in order:
                t0 = time.monotonic()
                if name == "ar":
                    res = generate_ar_staged(base, ids, args.max_new_tokens, SamplingParams())
                else:
                    res = generate_tree(base, drafters[name], ids, args.max_new_tokens, SamplingParams(), shape,
                                        nodes[name])
                results[name] = res
                row = {"round": r, "kind": kind, "run": name, "wall_s": round(time.monotonic() - t0, 3),
                       **decode_stats(res), "mean_accept_len": res.mean_accept_len and round(res.mean_accept_len, 3),
                       "draft_calls": res.draft_forwards, "tokens": len(res.token_ids)}
                runs.append(row)
            for name in ("tree+0.5B", "tree+head"):
                same = results[name].token_ids == results["ar"].token_ids
                runs[-3 + order.index(name)]["equals_ar"] = same
            print(json.dumps([r for r in runs[-3:]]), flush=True)
    print(json.dumps(summary(runs), indent=1))
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"runs": runs, "summary": summary(runs), "args": vars(args)}, f, indent=1)


def summary(runs: list[dict]) -> dict:
    out = {}
    for name in ("ar", "tree+0.5B", "tree+head"):
        mine = [r for r in runs if r["run"] == name]
        rates = [r["decode_tokens_per_s"] for r in mine if r.get("decode_tokens_per_s")]
        accepts = [r["mean_accept_len"] for r in mine if r.get("mean_accept_len")]
        out[name] = {"runs": len(mine),
                     "decode_tokens_per_s_median": round(statistics.median(rates), 3) if rates else None,
                     "decode_tokens_per_s_mean": round(statistics.mean(rates), 3) if rates else None,
                     "mean_accept_len": round(statistics.mean(accepts), 3) if accepts else None,
                     "all_equal_ar": all(r.get("equals_ar", True) for r in mine)}
    return out


if __name__ == "__main__":
    main()
