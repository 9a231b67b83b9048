"""Row-invariant W8A16 matmul on CPU: `linear(x, weight)` over a weight prepared once from `PackedInt8`.

Why: the GGUF files flowedge converts keep the tensors that matter most (attn_v and ffn_down in half of
the layers, the output matrix) at 6-8 bits (Q6_K, Q8_0); squeezing them into 4 bits cost agreement with
the float model. 8-bit codes with a float32 scale per group of 32 hold those values to within ~1/8 of a
Q6_K step (Q8_0: exactly). Same guarantees as w4a16.py: a row's result depends neither on the rows
sharing the call nor on the thread count.

Numerics (the same for every row whatever M, its row pass or the thread count; threads take whole
16-output tiles, never a part of K):
  1. x is rounded to bfloat16 (round to nearest even), the "A16".
  2. Per output n and group g of G inputs: S = sum over the group of code * bf16(x) in fp32 (codes are
     integers in -127..127, exact in bf16). AVX512-BF16 build: one `vdpbf16ps` accumulator over the
     input pairs (2k, 2k+1) in k order. AVX2 and NEON builds: fused multiply-adds in k order. Portable
     build: a plain fp32 sum in k order (no FMA).
  3. y[n] = sum over g in order of: y = fma(S, scale, y) (portable: multiply then add), then y += bias[n].
The builds (one per ISA level, kernels/isa.py) differ in the last bits from each other, never between
rows of one build.

Prepared layout (9 bits a weight at G=32): uint8 [N/16, K/G, 64 + 16G]: per tile of 16 outputs and
group, 16 float32 scales, then G/2 blocks of 32 codes; byte 2i + e of block j is output i's code at
k = 2j + e. Tiles are independent: concatenating two prepared weights along dim 0 is the weight of both.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import torch

from flowedge.kernels import tiled
from flowedge.kernels.tiled import TILE, PackedShape, TiledKernel, TiledWeight

SOURCE = Path(__file__).with_name("w8a16.c")
REPACK_ROWS = 4096


class PackedWeight8(PackedShape, Protocol):
    """The portable W8A16 layout the kernel repacks (`models.quant8.PackedInt8` is one), read only."""

    @property
    def qweight(self) -> torch.Tensor: ...   # int8 [N, K]

    @property
    def scales(self) -> torch.Tensor: ...    # float32 [N, K / G]


@dataclass(frozen=True, slots=True)
class W8A16Weight(TiledWeight):
    """A weight in the kernel's tiled layout: tiles uint8 [N/16, K/G, 64 + 16G]."""


KERNEL = TiledKernel(SOURCE, "w8a16")
supports = tiled.supports


def available() -> bool:
    """True when the native kernel is built and loaded here (and not switched off)."""
    return KERNEL.available()


def isa() -> str | None:
    """'avx512bf16', 'avx2', 'neon' or 'portable' (the tiles compiled in), None when unavailable."""
    return KERNEL.isa()


def prepare(w: PackedWeight8) -> W8A16Weight:
    """Repack the portable layout into tiles (REPACK_ROWS outputs at a time)."""
    n, k, g = tiled.checked_shape(w, "W8A16")
    parts = [_repack(q, s, g) for q, s in zip(w.qweight.split(REPACK_ROWS), w.scales.split(REPACK_ROWS))]
    return W8A16Weight(torch.cat(parts).contiguous(), n, k, g)


def _repack(qweight: torch.Tensor, scales: torch.Tensor, g: int) -> torch.Tensor:
    # qweight: int8 [n, K], scales: float32 [n, K/G] -> uint8 [n/16, K/G, 64 + 16G]
    n, ng = scales.shape
    codes = qweight.view(torch.uint8).reshape(n // TILE, TILE, ng, g // 2, 2)
    codes = codes.permute(0, 2, 3, 1, 4).reshape(n // TILE, ng, 16 * g)
    table = scales.float().reshape(n // TILE, TILE, ng).transpose(1, 2).contiguous().view(torch.uint8)
    return torch.cat([table, codes], dim=-1)


def linear(x: torch.Tensor, weight: W8A16Weight, bias: torch.Tensor | None = None,
           threads: int | None = None) -> torch.Tensor:
    """x [M, K] float32 -> [M, N] float32 (plus a float32 bias [N]); `threads` defaults to torch's.
    Under torch.compile the call is the custom op `flowedge::w8a16_linear` (no graph break)."""
    return KERNEL.linear(x, weight, bias, threads)
