"""Row-invariant W4A16 matmul on CPU: `linear(x, weight)` over a weight prepared once from `PackedInt4`.

Why our own kernel: torch's `_weight_int4pack_mm_for_cpu` rounds a row differently depending on how many
rows share the call (so T=0 speculation drifts from `ar`), and costs 3.6x for 8 rows what one row costs.
Here each 16-output weight tile is unpacked once per pass of up to 12 rows and reused for every row
(figures: docs/bench/w4a16-kernel.md, `tools/bench_w4a16.py`).

Numerics (the same for every row whatever M, its row pass or the thread count; threads take whole
16-output tiles, never a part of K):
  1. x is rounded to bfloat16 (round to nearest even), the "A16".
  2. Per output n and group g of G inputs: S = sum over the group of (code - 8) * bf16(x) in fp32.
     AVX512-BF16 build: one `vdpbf16ps` accumulator over the input pairs (2k, 2k+1) in k order.
     AVX2 and NEON builds: S' = sum of code * bf16(x), fused multiply-adds in k order, the code as
     stored (0..15): the -8 goes into the zero point (step 4 with zero - 8 * scale, one rounding).
     Portable build: a plain fp32 sum in k order, multiply then add (`-ffp-contract=off`: no FMA).
  3. X_g = sum of the group's bf16(x) in fp32: 16 strided lanes, then the lanes in order.
  4. y[n] = sum over g in order of: y = fma(S, scale, y); y = fma(zero, X_g, y) (portable: separate
     multiply and add), then y += bias[n]. scale and zero are the stored bfloat16 values, exactly.
The builds (one per ISA level, kernels/isa.py) differ in the last bits from each other, never between
rows of one build.

Prepared layout (about 5 bits a weight at G=32, like the stored one): uint8 [N/16, K/G, 64 + 8G], per tile
of 16 outputs and group: 16 scales, 16 zeros (bf16), then G/8 blocks of 16 dwords; dword i holds output
i's codes for k = 8b..8b+7 as nibbles c0 c2 c4 c6 c1 c3 c5 c7 (low to high), so a 4p-bit shift of the
dword leaves (c_2p, c_2p+1) in the low bits of its two 16-bit halves, ready for a 16-entry table lookup.
Tiles are independent: concatenating two prepared weights along dim 0 is the weight of both outputs.

Threads: the C code runs OpenMP in the libgomp torch already loaded (same soname), so it shares torch's
thread pool instead of spinning a second one; `threads` defaults to `torch.get_num_threads()`.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import torch

from flowedge.kernels import tiled
from flowedge.kernels.tiled import TILE, PackedShape, TiledKernel, TiledWeight

SOURCE = Path(__file__).with_name("w4a16.c")
REPACK_ROWS = 4096   # outputs repacked at once (bounds the temporaries for a vocabulary-sized lm_head)


class PackedWeight(PackedShape, Protocol):
    """The portable W4A16 layout the kernel repacks (`models.quant.PackedInt4` is one), read only."""

    @property
    def qweight(self) -> torch.Tensor: ...   # uint8 [N, K / 2]

    @property
    def scales(self) -> torch.Tensor: ...    # bfloat16 [N, K / G]

    @property
    def zeros(self) -> torch.Tensor: ...     # bfloat16 [N, K / G]


@dataclass(frozen=True, slots=True)
class W4A16Weight(TiledWeight):
    """A weight in the kernel's tiled layout: tiles uint8 [N/16, K/G, 64 + 8G]."""


KERNEL = TiledKernel(SOURCE, "w4a16")
supports = tiled.supports


def available() -> bool:
    """True when the native kernel is built and loaded here (and not switched off)."""
    return KERNEL.available()


def isa() -> str | None:
    """'avx512bf16', 'avx2', 'neon' or 'portable' (the tiles compiled in), None when unavailable."""
    return KERNEL.isa()


def prepare(w: PackedWeight) -> W4A16Weight:
    """Repack the portable layout into tiles (one pass, REPACK_ROWS outputs at a time)."""
    n, k, g = tiled.checked_shape(w, "W4A16")
    parts = [_repack(q, s, z, g) for q, s, z in zip(w.qweight.split(REPACK_ROWS), w.scales.split(REPACK_ROWS),
                                                   w.zeros.split(REPACK_ROWS))]
    return W4A16Weight(torch.cat(parts).contiguous(), n, k, g)


def _repack(qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, g: int) -> torch.Tensor:
    # qweight: [n, K/2] bytes (c_2j | c_2j+1 << 4) -> [n/16, K/G, 64 + 8G]
    n, ng = scales.shape
    q = qweight.reshape(n, -1, 4)                                  # [n, K/8, 4]: codes (c0c1)(c2c3)(c4c5)(c6c7)
    lo, hi = q & 15, q >> 4
    codes = torch.stack([lo[..., 0] | lo[..., 1] << 4, lo[..., 2] | lo[..., 3] << 4,
                         hi[..., 0] | hi[..., 1] << 4, hi[..., 2] | hi[..., 3] << 4], dim=-1)
    codes = codes.reshape(n // TILE, TILE, ng, g // 8, 4).permute(0, 2, 3, 1, 4).reshape(n // TILE, ng, 8 * g)

    def table(t: torch.Tensor) -> torch.Tensor:                     # [n, ng] bf16 -> [n/16, ng, 32] bytes
        return t.reshape(n // TILE, TILE, ng).transpose(1, 2).contiguous().view(torch.uint8)

    return torch.cat([table(scales), table(zeros), codes], dim=-1)


def linear(x: torch.Tensor, weight: W4A16Weight, bias: torch.Tensor | None = None,
           threads: int | None = None) -> torch.Tensor:
    """x [M, K] float32 -> [M, N] float32 (plus a float32 bias [N]); `threads` defaults to torch's.
    Under torch.compile the call is the custom op `flowedge::w4a16_linear` (no graph break)."""
    return KERNEL.linear(x, weight, bias, threads)
