"""End-to-end `ar` decode A/B in one process: two kernel builds, or two values of an env switch read at load.

    python tools/bench_ar_ab.py --base main [--threads 1] [--repeats 3]        # REV's C kernels vs the tree's
    python tools/bench_ar_ab.py --env FLOWEDGE_FUSED_ATTENTION=0,1 [--threads 1]

`--base`: the revision's tiled matmul kernels (flowedge/kernels extracted to a temporary directory, built
once) and the tree's serve the same loaded model in turns (their sources are switched between calls; the
rest, attention included, is the tree's). `--env`: the model is loaded once per value with the variable set
while it loads. Each repeat
decodes the first prompt of 4 datasets (code, writing, math, extraction; chat template, T=0, 128 new tokens)
on both sides, the order flipped every repeat; prints the median decode tok/s per side and kind (and over
all) and checks that both sides' tokens are identical (exit 1 otherwise). Made for a busy machine: the sides
interleave, so a burst of other load falls on both.
"""
from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import sys
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path

import torch
from kernel_bits_ab import base_sources

from flowedge.core.sampling import SamplingParams
from flowedge.datasets import load_prompts
from flowedge.engine.local import generate_ar_staged
from flowedge.kernels import int8act, w4a16, w8a16
from flowedge.models.resolve import resolve_model
from flowedge.models.stage import StageModel
from flowedge.text.prompts import encode_prompt, load_tokenizer

DATASETS = ("humaneval", "mt-bench:writing", "mt-bench:math", "mt-bench:extraction")
TILED = (w4a16.KERNEL, w8a16.KERNEL, int8act.KERNEL4, int8act.KERNEL8)
Side = Callable[[list[int], int], tuple[list[int], float]]


@contextlib.contextmanager
def kernels_from(folder: Path | None) -> Iterator[None]:
    """The tiled matmul kernels built from `folder`'s sources while inside (None: the tree's)."""
    saved = [k.source for k in TILED]
    if folder is not None:
        for k in TILED:
            k.source = folder / k.source.name
    try:
        yield
    finally:
        for k, source in zip(TILED, saved):
            k.source = source


def decoder(model: StageModel, folder: Path | None = None) -> Side:
    def run(ids: list[int], new: int) -> tuple[list[int], float]:
        with kernels_from(folder):
            res = generate_ar_staged(model, ids, new, SamplingParams(temperature=0.0))
        return res.token_ids, (len(res.token_ids) - 1) / res.decode_s

    return run


@contextlib.contextmanager
def env_set(name: str, value: str) -> Iterator[None]:
    old = os.environ.get(name)
    os.environ[name] = value
    try:
        yield
    finally:
        os.environ.pop(name) if old is None else os.environ.__setitem__(name, old)


def sides(args: argparse.Namespace, model_dir: Path, tmp: Path) -> dict[str, Side]:
    if args.env:
        name, _, values = args.env.partition("=")
        out = {}
        for value in values.split(","):
            with env_set(name, value):
                out[f"{name}={value}"] = decoder(StageModel.load(model_dir))
        return out
    model = StageModel.load(model_dir)
    return {args.base: decoder(model, base_sources(args.base, tmp)), "tree": decoder(model)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    which = ap.add_mutually_exclusive_group(required=True)
    which.add_argument("--base", help="git revision whose C kernels run against the tree's")
    which.add_argument("--env", help="NAME=A,B: a switch read when the model loads")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--model", default="qwen2.5-coder-1.5b")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    model_dir = resolve_model(args.model, quant="int4")
    tok = load_tokenizer(model_dir)
    prompts = [(ds, encode_prompt(tok, load_prompts(ds, 1)[0].text, chat=True)) for ds in DATASETS]
    with tempfile.TemporaryDirectory(prefix="ar-ab-") as tmp, torch.inference_mode():
        runs = sides(args, model_dir, Path(tmp))
        rates: dict[str, dict[str, list[float]]] = {s: {ds: [] for ds in DATASETS} for s in runs}
        order, same = list(runs), True
        for _ in range(args.repeats):
            for ds, ids in prompts:
                tokens = {}
                for label in order:
                    tokens[label], rate = runs[label](ids, args.max_new_tokens)
                    rates[label][ds].append(rate)
                    print(f"  {ds} {label}: {rate:.2f} tok/s", flush=True)   # a run cut short keeps these
                same &= len({tuple(t) for t in tokens.values()}) == 1
                order.reverse()
        report(rates, args, same)
    sys.exit(0 if same else 1)


def report(rates: dict[str, dict[str, list[float]]], args: argparse.Namespace, same: bool) -> None:
    print(f"ar decode tok/s, {args.threads} thread(s), {args.max_new_tokens} new tokens, T=0, median of "
          f"{args.repeats} interleaved repeats")
    labels = list(rates)
    for ds in DATASETS:
        print(f"  {ds:22s} " + "  ".join(f"{s} {statistics.median(rates[s][ds]):6.2f}" for s in labels))
    overall = {s: statistics.median([r for v in rates[s].values() for r in v]) for s in labels}
    print(f"  {'all':22s} " + "  ".join(f"{s} {overall[s]:6.2f}" for s in labels)
          + f"  ratio {overall[labels[1]] / overall[labels[0]]:.3f}")
    print("tokens identical on every prompt and repeat" if same else "TOKENS DIFFER between the sides")


if __name__ == "__main__":
    main()
