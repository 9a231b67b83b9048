"""Teacher-forced top-1 agreement of flowedge's W4A16 model with the float32 transformers model.

    python tools/w4a16_agreement.py [--model qwen2.5-coder-1.5b] [--prompts 8] [--tokens 128]

The float32 model is transformers' own, loaded from the same GGUF (dequantised); the W4A16 model is
flowedge's (own decoder, native kernels, int4 lm_head). Each sequence is a benchmark prompt (chat template)
plus the W4A16 model's greedy continuation; at every continuation position both models predict the next
token and we count how often the argmax agrees.
"""
from __future__ import annotations

import argparse
import json
import logging
import time

import torch

from flowedge.bench.agreement import stage_logits, top1_agreement, transformers_logits
from flowedge.core.sampling import SamplingParams
from flowedge.datasets import load_prompts
from flowedge.kernels import int8act
from flowedge.engine.local import generate_ar_staged
from flowedge.models import registry
from flowedge.models.resolve import resolve_model
from flowedge.models.stage import StageModel
from flowedge.text.prompts import encode_prompt, load_tokenizer

KINDS = ("humaneval", "mt-bench:writing", "mt-bench:math", "mt-bench:extraction")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="qwen2.5-coder-1.5b")
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--only", default="",
                    help="comma-separated prompt ids: run these of the selection only (the others' rows come from "
                         "an earlier run: a prompt's sequence and agreement do not depend on the other prompts)")
    ap.add_argument("--narrow-head", action="store_true",
                    help="a W4A16 lm_head (what the draft model keeps) instead of the default W8A16 one")
    ap.add_argument("--float-head", action="store_true",
                    help="also measure the W4A16 layers with the lm_head left in float32 (what the head costs)")
    args = ap.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    torch.set_num_threads(args.threads)
    base_dir = resolve_model(args.model)
    tok = load_tokenizer(base_dir)
    per_kind = -(-args.prompts // len(KINDS))
    prompts = [p for kind in KINDS for p in load_prompts(kind, per_kind)][: args.prompts]
    if args.only:
        prompts = [p for p in prompts if p.prompt_id in args.only.split(",")]
    w4 = StageModel.load(base_dir, wide_lm_head=not args.narrow_head)
    sequences, firsts = [], []
    for p in prompts:
        ids = encode_prompt(tok, p.text, chat=True)
        cont = generate_ar_staged(w4, ids, args.tokens, SamplingParams()).token_ids
        sequences.append(ids + cont)
        firsts.append(len(ids) - 1)        # the prediction made at the prompt's last token is the first compared
    from transformers import AutoModelForCausalLM

    gguf = registry.pull(args.model)
    t0 = time.monotonic()
    fp32 = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32).eval()
    logging.info("float32 oracle loaded in %.0f s", time.monotonic() - t0)
    variants = {"w4a16" if int8act.activations() == "bf16" else "w4a8": w4}   # FLOWEDGE_ACTIVATIONS
    if args.float_head:
        variants["w4a16-float-head"] = _with_float_head(StageModel.load(base_dir, wide_lm_head=False), fp32)
    for label, model in variants.items():
        rows = []
        for p, seq, first in zip(prompts, sequences, firsts):
            a = top1_agreement(transformers_logits(fp32), stage_logits(model), [seq[:-1]], first=first)
            rows.append({"variant": label, "prompt": p.prompt_id, "positions": a.positions, "agreed": a.agreed,
                         "rate": round(a.rate, 4)})
            print(json.dumps(rows[-1]), flush=True)
        total = sum(r["positions"] for r in rows)
        agreed = sum(r["agreed"] for r in rows)
        print(json.dumps({"variant": label, "model": args.model, "prompts": len(rows), "positions": total,
                          "agreed": agreed, "rate": round(agreed / total, 4)}), flush=True)


def _with_float_head(model: StageModel, fp32) -> StageModel:
    head = torch.nn.Linear(model.config.hidden_size, model.config.vocab_size, bias=False)
    head.weight = fp32.lm_head.weight
    model.lm_head = head
    return model


if __name__ == "__main__":
    main()
