"""Resident memory of a stage process that loads only its shard vs one that loads the whole model.

    python tools/measure_stage_memory.py SHARD_DIR [--stage 0]

Each measurement runs in a fresh `spawn`ed process (so earlier loads do not inflate it) and
reports RSS (psutil) before and after loading: the head file, one stage file, the whole
model.safetensors of the directory the shards were cut from (manifest "model" or --model-dir).
"""
from __future__ import annotations

import argparse
import multiprocessing as mp
from pathlib import Path


def _rss_mb() -> float:
    import psutil

    return psutil.Process().memory_info().rss / 2**20


def _measure(kind: str, path: str, stage: int, queue) -> None:
    import torch

    torch.set_num_threads(1)
    before = _rss_mb()
    if kind == "whole":
        from safetensors.torch import load_file

        tensors = load_file(str(Path(path) / "model.safetensors"))
    else:
        from flowedge.models.shards import load_shard

        tensors = load_shard(Path(path), "head" if kind == "head" else stage)
    total = 0
    for tensor in tensors.values():
        tensor.sum()  # touch every page so lazily mapped data counts as resident
        total += tensor.numel() * tensor.element_size()
    queue.put((kind, before, _rss_mb(), total / 2**20))


def run(kind: str, path: Path, stage: int) -> tuple:
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    proc = ctx.Process(target=_measure, args=(kind, str(path), stage, queue))
    proc.start()
    result = queue.get()
    proc.join()
    return result


def main() -> None:
    from flowedge.models.shards import Manifest

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("shard_dir", type=Path)
    parser.add_argument("--stage", type=int, default=0)
    parser.add_argument("--model-dir", type=Path, default=None,
                        help="HF directory the shards were cut from (default: manifest 'model' "
                             "resolved with flowedge.models.resolve)")
    args = parser.parse_args()
    manifest = Manifest.load(args.shard_dir)
    model_dir = args.model_dir
    if model_dir is None:
        from flowedge.models.resolve import resolve_model

        model_dir = resolve_model(manifest.model)
    print(f"{manifest.model}: {len(manifest.stages)} stages, measuring stage {args.stage}")
    print(f"{'load':>8} {'rss before MB':>14} {'rss after MB':>13} {'tensors MB':>11}")
    for kind, path in (("head", args.shard_dir), ("stage", args.shard_dir), ("whole", model_dir)):
        name, before, after, tensors = run(kind, path, args.stage)
        print(f"{name:>8} {before:14.1f} {after:13.1f} {tensors:11.1f}")


if __name__ == "__main__":
    main()
