"""Speed A/B of the tiled kernels: a git revision's C sources against the working tree's, same process.

    python tools/bench_kernel_ab.py [--base main] [--rows 1] [--threads 1] [--rounds 15]

Both builds go to a temporary directory (tools/kernel_bits_ab.py builds them the same way). Per kernel
(W4A16 and W8A16; `--kernels` adds the int8-activation W4A8, W8A8) and shape of the 1.5B model: each round
times one call of each build, in turns whose order
flips every round, on the next of several copies of the weight (so weights come from DRAM as in a decode
step); prints the median time and the weight GB/s streamed. For a busy machine: medians of interleaved
calls, never one build's calls in a row.
"""
from __future__ import annotations

import argparse
import ctypes
import statistics
import tempfile
import time
from pathlib import Path

import torch
from bench_helpers import COLD_BYTES
from kernel_bits_ab import KERNELS, base_sources, kernel

from flowedge.kernels import w4a16, w8a16
from flowedge.models.quant import pack_int4
from flowedge.models.quant8 import pack_int8

SHAPES = (("qkv", 1536, 2048), ("o_proj", 1536, 1536), ("gate_up", 1536, 17920), ("down", 8960, 1536))
GROUP = 32


def tiles_of(bits: int, n: int, k: int) -> torch.Tensor:
    w = torch.randn(n, k) * 0.05
    return (w4a16.prepare(pack_int4(w, GROUP)) if bits == 4 else w8a16.prepare(pack_int8(w, GROUP))).tiles


def one_call(fn, x: torch.Tensor, tiles: torch.Tensor, out: torch.Tensor, threads: int) -> float:
    m, k = x.shape
    start = time.perf_counter()
    rc = fn(x.data_ptr(), m, k, tiles.data_ptr(), out.shape[1], GROUP, None, out.data_ptr(), threads)
    elapsed = time.perf_counter() - start
    if rc != 0:
        raise RuntimeError(f"kernel returned {rc}")
    return elapsed


def ab_shape(fns: dict[str, ctypes._CFuncPtr], bits: int, k: int, n: int, rows: int, threads: int,
             rounds: int) -> tuple[dict[str, float], int]:
    """Median seconds a call per build over `rounds` interleaved rounds, and the tile bytes a call reads."""
    copies = [tiles_of(bits, n, k)]
    copies += [copies[0].clone() for _ in range(max(1, COLD_BYTES // copies[0].numel()))]
    x = torch.randn(rows, k)
    outs = {label: torch.empty(rows, n) for label in fns}
    times: dict[str, list[float]] = {label: [] for label in fns}
    order = list(fns)
    for r in range(rounds * len(copies) // 4 + 4):
        tiles = copies[r % len(copies)]
        for label in order:
            times[label].append(one_call(fns[label], x, tiles, outs[label], threads))
        order.reverse()
    a, b = outs.values()
    if not torch.equal(a.view(torch.int32), b.view(torch.int32)):
        print(f"  note: W{bits} {k}x{n}: the builds' outputs differ in some bits")
    return {label: statistics.median(ts[4:]) for label, ts in times.items()}, copies[0].numel()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--base", default="main", help="the git revision to compare against")
    parser.add_argument("--rows", type=int, default=1)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--kernels", default="w4a16,w8a16", help="any of w4a16, w8a16, w4a8, w8a8")
    args = parser.parse_args()
    here = Path(w4a16.__file__).parent
    torch.manual_seed(0)
    with tempfile.TemporaryDirectory(prefix="kernel-speed-ab-") as tmp:
        base = base_sources(args.base, Path(tmp) / "src")
        for name in args.kernels.split(","):
            source, bits = KERNELS[name]
            (old, isa), (new, _) = (kernel(root / source, name, Path(tmp) / side)
                                    for root, side in ((base, "old"), (here, "new")))
            print(f"{name} ({isa}), M={args.rows}, {args.threads} thread(s): median of interleaved calls")
            for label, k, n in SHAPES:
                med, nbytes = ab_shape({args.base: old, "tree": new}, bits, k, n, args.rows, args.threads,
                                       args.rounds)
                gb = nbytes / 1e9
                cells = "  ".join(f"{lab} {s * 1e6:7.0f} us {gb / s:5.1f} GB/s" for lab, s in med.items())
                print(f"  {label:8s} {k:5d}x{n:<5d} {cells}  tree/base {med['tree'] / med[args.base]:.3f}")


if __name__ == "__main__":
    main()
