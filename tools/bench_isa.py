"""The tiled kernels at each ISA level, in one process: W4A16, W8A16, W4A8, W8A8 built for every level this
CPU runs (kernels/isa.py), timed A/B interleaved on the 1.5B model's shapes.

    python tools/bench_isa.py --threads 1                                   # avx512, avx2, portable here
    CC="gcc -mno-avx512f" python tools/bench_isa.py --levels avx2,portable  # as an AVX2-only CPU builds them

Per kind, shape and rows M: the best time of `--repeats` calls, the levels interleaved (bench_helpers),
each call on the next of several copies of the weight so weights come from DRAM as in a decode step;
the weight GB/s streamed at M=1 and M16/M1. Builds go to a temporary directory, never to $FLOWEDGE_HOME.
Weights are random codes: speed does not depend on their values.
"""
from __future__ import annotations

import ctypes
import tempfile
from collections.abc import Callable
from pathlib import Path

import torch
from bench_helpers import COLD_BYTES, bench_parser, interleaved_times, rotating
from bench_w4a16 import GROUP, random_packed
from bench_w8a16 import random_packed8

from flowedge.kernels import build, isa, w4a16, w8a16

KERNEL_DIR = Path(w4a16.__file__).parent
SHAPES = (("q/o_proj", 1536, 1536), ("k/v_proj", 1536, 256), ("gate/up", 1536, 8960), ("down", 8960, 1536))
ROWS = (1, 16)
# kind -> (source, bits): W4A8 / W8A8 read the W4A16 / W8A16 tiles
KINDS = {"w4a16": ("w4a16.c", 4), "w8a16": ("w8a16.c", 8), "w4a8": ("int8act.c", 4), "w8a8": ("int8act.c", 8)}
ARGTYPES = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64,
            ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int]


def kernel(kind: str, level: isa.Level, cache: Path) -> tuple[Callable, str]:
    """The C function `<kind>_linear` built for `level`, and the tile code its build reports."""
    source = KERNEL_DIR / KINDS[kind][0]
    lib = build.build(source, cache, level).lib
    fn = getattr(lib, f"{kind}_linear")
    fn.argtypes, fn.restype = ARGTYPES, ctypes.c_int
    report = getattr(lib, f"{'int8act' if source.name == 'int8act.c' else kind}_isa")
    report.restype = ctypes.c_char_p
    return fn, report().decode()


def caller(fn: Callable, tiles: torch.Tensor, n: int, threads: int) -> Callable[[torch.Tensor], torch.Tensor]:
    def call(x: torch.Tensor) -> torch.Tensor:
        y = torch.empty(x.shape[0], n)
        if fn(x.data_ptr(), x.shape[0], x.shape[1], tiles.data_ptr(), n, GROUP, None, y.data_ptr(), threads):
            raise RuntimeError("kernel refused its arguments")
        return y
    return call


def bench(kind: str, name: str, k: int, n: int, fns: dict[str, Callable], args) -> None:
    bits = KINDS[kind][1]
    size = n * k * (0.5 + 4 / GROUP if bits == 4 else 1 + 4 / GROUP)   # codes plus the per-group table
    copies = max(1, int(COLD_BYTES / size))
    tiles = [(w4a16.prepare(random_packed(n, k)) if bits == 4 else w8a16.prepare(random_packed8(n, k))).tiles
             for _ in range(copies)]
    calls = {label: rotating([caller(fn, t, n, args.threads) for t in tiles]) for label, fn in fns.items()}
    times = interleaved_times(calls, k, n, ROWS, args.repeats)
    for label, ts in times.items():
        cells = "  ".join(f"M={m}: {t * 1e6:7.0f} us" for m, t in zip(ROWS, ts))
        print(f"{kind:5s} {name:8s} K={k:5d} N={n:5d} {label:20s} {cells}  | M=1 {size / ts[0] / 1e9:5.1f} GB/s"
              f"  M16/M1 {ts[1] / ts[0]:5.1f}", flush=True)


def main() -> None:
    parser = bench_parser(__doc__)
    parser.add_argument("--levels", default=",".join(level.name for level in isa.runnable()))
    parser.add_argument("--kinds", default=",".join(KINDS))
    parser.add_argument("--shapes", default=",".join(s[0] for s in SHAPES))
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    levels = {level.name: level for level in isa.machine_levels()}
    wanted = [levels[name] for name in args.levels.split(",")]
    print(f"threads {args.threads}, CC={build.compiler()}, levels {', '.join(level.name for level in wanted)}")
    with tempfile.TemporaryDirectory(prefix="bench-isa-") as tmp:
        for kind in args.kinds.split(","):
            fns = {}
            for level in wanted:
                fn, code = kernel(kind, level, Path(tmp))
                fns[f"{level.name} ({code})"] = fn
            for name, k, n in SHAPES:
                if name in args.shapes.split(","):
                    bench(kind, name, k, n, fns, args)


if __name__ == "__main__":
    main()
