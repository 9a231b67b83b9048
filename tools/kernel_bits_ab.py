"""Bit-for-bit A/B of the tiled kernels: a git revision's C sources against the working tree's.

    python tools/kernel_bits_ab.py [--base main] [--rows 33]            # this CPU's best ISA level
    FLOWEDGE_ISA=avx2 python tools/kernel_bits_ab.py                    # another level (kernels/isa.py)

For a change to the kernels that must not move a bit (a refactor, a scheduling change): both revisions'
W4A16, W8A16, W4A8 and W8A8 run on the same tiles (prepared by this tree's Python, the layout being
shared) for M = 1..rows, every group size, 1 to 3 threads, with and without a bias, on inputs spanning
12 decades with a NaN and a zero row; the first output that differs in any bit is reported (exit 1).
Both builds go to a temporary directory, never to $FLOWEDGE_HOME.
"""
from __future__ import annotations

import argparse
import ctypes
import io
import os
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

import torch

from flowedge.kernels import build, w4a16, w8a16
from flowedge.models.quant import pack_int4
from flowedge.models.quant8 import pack_int8

ROOT = Path(__file__).resolve().parent.parent
KERNELS = {"w4a16": ("w4a16.c", 4), "w8a16": ("w8a16.c", 8), "w4a8": ("int8act.c", 4), "w8a8": ("int8act.c", 8)}
ARGTYPES = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64,
            ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int]
N, K = 208, 768   # 13 tiles (not a multiple of the wide step); K takes every group size up to 256


def base_sources(rev: str, into: Path) -> Path:
    """flowedge/kernels as it is at `rev`, extracted under `into`."""
    tar = subprocess.run(["git", "-C", str(ROOT), "archive", rev, "flowedge/kernels"], capture_output=True,
                         check=True).stdout
    with tarfile.open(fileobj=io.BytesIO(tar)) as archive:
        archive.extractall(into, filter="data")
    return into / "flowedge" / "kernels"


def kernel(source: Path, name: str, cache: Path):
    lib = build.build(source, cache).lib
    fn = getattr(lib, f"{name}_linear")
    fn.argtypes, fn.restype = ARGTYPES, ctypes.c_int
    isa = getattr(lib, f"{'int8act' if source.name == 'int8act.c' else name}_isa")
    isa.restype = ctypes.c_char_p
    return fn, isa().decode()


def run(fn, x: torch.Tensor, tiles: torch.Tensor, g: int, bias: torch.Tensor | None, threads: int) -> torch.Tensor:
    out = torch.full((x.shape[0], N), float("nan"))
    rc = fn(x.data_ptr(), x.shape[0], K, tiles.data_ptr(), N, g, None if bias is None else bias.data_ptr(),
            out.data_ptr(), threads)
    if rc != 0:
        raise RuntimeError(f"kernel returned {rc}")
    return out


def compare(name: str, old, new, rows: int) -> int:
    """Calls compared; exits at the first difference."""
    bits = KERNELS[name][1]
    calls = 0
    for g in (16, 32, 64, 128, 256):
        gen = torch.Generator().manual_seed(g + bits)
        w = torch.randn(N, K, generator=gen) * 0.05
        tiles = (w4a16.prepare(pack_int4(w, g)) if bits == 4 else w8a16.prepare(pack_int8(w, g))).tiles
        x = torch.randn(rows, K, generator=gen) * torch.logspace(-6, 6, rows)[:, None]
        x[min(5, rows - 1), 7], x[rows // 2] = float("nan"), 0.0
        bias = torch.randn(N, generator=gen)
        for m in range(1, rows + 1):
            for threads in (1, 2, 3):
                for b in (bias, None):
                    a, c = (run(fn, x[:m].contiguous(), tiles, g, b, threads) for fn in (old, new))
                    if not torch.equal(a.view(torch.int32), c.view(torch.int32)):
                        sys.exit(f"{name}: differs at G={g} M={m} threads={threads} bias={b is not None}")
                    calls += 1
    return calls


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--base", default="main", help="the git revision to compare against")
    parser.add_argument("--rows", type=int, default=33, help="M from 1 to this")
    args = parser.parse_args()
    here = Path(w4a16.__file__).parent
    with tempfile.TemporaryDirectory(prefix="kernel-ab-") as tmp:
        base = base_sources(args.base, Path(tmp) / "src")
        print(f"CC={os.environ.get(build.CC_ENV) or 'gcc'!r}: {args.base} against {here}")
        for name, (source, _) in KERNELS.items():
            (old, old_isa), (new, new_isa) = (kernel(root / source, name, Path(tmp) / side)
                                              for root, side in ((base, "old"), (here, "new")))
            calls = compare(name, old, new, args.rows)
            print(f"{name:6s} {old_isa} / {new_isa}: {calls} calls, every output bit-identical")


if __name__ == "__main__":
    main()
