"""Resident memory of a stage process: after loading its shard, and after answering a prompt.

    python tools/measure_stage_memory.py SHARD_DIR [SHARD_DIR ...] [--stage 1] [--quant none,int4]
                                         [--prompt-tokens 32] [--tokens 128] [--parts layers|last|head]

For every shard directory and every quantization (a W4A16 split is measured with its own format;
`--quant` applies to full-precision splits), a fresh `spawn`ed process loads the stage exactly as a
stage node does (`StageModel.load` of its layer range) and reports RSS (psutil) before loading, after
loading, and after a prompt of `--prompt-tokens` hidden states followed by `--tokens` one-token
decode steps through its layers and KV cache (the memory a 128-token answer costs; hidden states are
random of the model's width, the memory and compute are the same as for real ones). Also prints each
shard file's bytes and the size of the whole model cache ($FLOWEDGE_HOME). `--parts last` loads the
stage as a token-choosing last stage (its layers + final norm + lm_head from the head file), `--parts
head` loads what the head process holds (embedding, final norm, lm_head; no layers, no answer); the
load time is printed beside the memory.
"""
from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
from pathlib import Path


def _rss_mb() -> float:
    import psutil

    return psutil.Process().memory_info().rss / 2**20


def _measure(shard_dir: str, stage: int, quant: str, prompt_tokens: int, tokens: int, parts: str, queue) -> None:
    import time

    import torch

    from flowedge.models.shards import Manifest
    from flowedge.models.stage import StageModel, StageParts, bool_to_float_mask, causal_mask

    torch.set_num_threads(1)
    spec = Manifest.load(Path(shard_dir)).stages[stage - 1]
    before = _rss_mb()
    which = {"layers": StageParts(spec.start, spec.end), "last": StageParts(spec.start, spec.end, head=True),
             "head": StageParts(0, 0, embed=True, head=True)}[parts]
    t0 = time.monotonic()
    model = StageModel.load(Path(shard_dir), which, quant=quant)
    load_s = time.monotonic() - t0
    loaded = _rss_mb()
    if parts == "head":
        tokens, prompt_tokens = 0, 0
    cache = model.new_cache()
    hidden = model.config.hidden_size
    gen = torch.Generator().manual_seed(0)
    dtype = torch.float32
    n, past = prompt_tokens, 0
    with torch.inference_mode():
        for step in range(1 + tokens if prompt_tokens else 0):
            x = torch.randn(n, hidden, generator=gen, dtype=dtype)
            mask = bool_to_float_mask(causal_mask(n, past))
            model.forward_layers(x, torch.arange(past, past + n), mask, cache)
            past += n
            n = 1
    import resource

    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    queue.put((before, loaded, _rss_mb(), cache.nbytes() / 2**20, peak, load_s))


def run(shard_dir: Path, stage: int, quant: str, prompt_tokens: int, tokens: int, parts: str = "layers") -> tuple:
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    proc = ctx.Process(target=_measure, args=(str(shard_dir), stage, quant, prompt_tokens, tokens, parts, queue))
    proc.start()
    proc.join()
    if proc.exitcode != 0:
        return None
    return queue.get()


def _dir_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file() and not p.is_symlink())


def _cache_report() -> None:
    from flowedge.home import flowedge_home

    home = flowedge_home()
    print(f"model cache {home}:")
    for sub in ("gguf", "models", "shards", "stage-cache"):
        if (home / sub).is_dir():
            print(f"  {sub:<12} {_dir_bytes(home / sub) / 1e9:7.2f} GB")
    total = sum(_dir_bytes(home / s) for s in ("gguf", "models", "shards", "stage-cache") if (home / s).is_dir())
    print(f"  {'total':<12} {total / 1e9:7.2f} GB")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("shard_dirs", type=Path, nargs="+")
    parser.add_argument("--stage", type=int, default=1, help="1-based stage to measure")
    parser.add_argument("--quant", default="none,int4", help="quantizations to load full-precision splits with")
    parser.add_argument("--prompt-tokens", type=int, default=32)
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--parts", choices=("layers", "last", "head"), default="layers",
                        help="the stage's layers, + the lm_head (a last stage), or the head's parts")
    args = parser.parse_args()
    print("MB = MiB; rss 0: interpreter + torch + flowedge before loading; peak: the process's maximum")
    print(f"{'split':<44} {'quant':>5} {'shard MB':>9} {'rss 0 MB':>9} {'loaded MB':>10} "
          f"{'answered MB':>12} {'kv MB':>6} {'peak MB':>8} {'load s':>7}  ({args.parts})")
    for shard_dir in args.shard_dirs:
        manifest = json.loads((shard_dir / "manifest.json").read_text())
        spec = manifest["stages"][args.stage - 1]
        fmt_quant = manifest.get("quant", "none")
        quants = args.quant.split(",") if fmt_quant == "none" else [fmt_quant]
        for quant in quants:
            res = run(shard_dir, args.stage, quant, args.prompt_tokens, args.tokens, args.parts)
            if res is None:
                print(f"{shard_dir.name:<44} {quant:>5} failed")
                continue
            before, loaded, answered, kv, peak, load_s = res
            print(f"{shard_dir.name:<44} {quant:>5} {spec['bytes'] / 2**20:9.1f} {before:9.1f} "
                  f"{loaded:10.1f} {answered:12.1f} {kv:6.1f} {peak:8.1f} {load_s:7.1f}", flush=True)
        files = [manifest["head"]] + manifest["stages"]
        print("  files: " + ", ".join(f"{f['file']} {f['bytes'] / 1e6:.1f} MB" for f in files))
    _cache_report()


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main()
