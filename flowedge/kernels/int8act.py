"""Int8 activations (W4A8, W8A8) over the W4A16 / W8A16 tiles: `linear4(x, w)`, `linear8(x, w)`.

Why: from a few rows on, the bf16 kernels are bound by `vdpbf16ps` (32 products an instruction), so a
16-row verification costs 5-8x one row. `vpdpbusd` (AVX512-VNNI) does 64 int8 products an instruction and
4-bit codes need only a mask or a shift, no table lookup. The weight tiles are the ones `w4a16.prepare` and
`w8a16.prepare` make, so one prepared weight serves either activation precision (`FLOWEDGE_ACTIVATIONS`).

Numerics (the same for every row whatever M, its row pass or the thread count; threads split N only):
  1. Per row and group of G inputs (the weight's groups): s_a = max |x| / 127 (fp32), q = round-half-even
     of x / s_a, in -127..127. It depends on the row alone: rows are invariant by construction.
  2. Per output n and group: S = sum over the group of (code - 8) * q (W4, code 0..15) or code * q (W8,
     code -127..127), in int32, exact (so its order does not matter; the AVX-512 build sums unsigned
     codes, code + 128 for W8, and starts its accumulator at -8 or -128 times sum q).
  3. W4: X_g = the fp32 sum of the group's unrounded x (16 strided lanes, then the lanes in order): the
     zero-point term uses the activations at full precision, so only the scale term sees int8 rounding.
  4. y[n] = over g in order: y = fma(float(S), scale * s_a, y); W4 then y = fma(zero, X_g, y); then
     y += bias[n] (W4: scale, zero the stored bf16 values; W8: the fp32 scale).
Every build (AVX512-VNNI; AVX2 with AVX-VNNI's `vpdpbusd` or `vpmaddubsw`; NEON with `sdot` / `smmla`; and
portable C using fmaf) computes the same integers and the same rounded float operations: they agree bit
for bit, unlike the bf16 kernels' builds.

Accuracy: int8 per group of 32 rounds x ~4x coarser than bf16 (docs/bench/w4a16-kernel.md has the figures).
"""
from __future__ import annotations

import os
from pathlib import Path

import torch

from flowedge.errors import ConfigError
from flowedge.kernels.tiled import TiledKernel
from flowedge.kernels.w4a16 import W4A16Weight
from flowedge.kernels.w8a16 import W8A16Weight

SOURCE = Path(__file__).with_name("int8act.c")
ACTIVATIONS_ENV = "FLOWEDGE_ACTIVATIONS"   # "bf16" (default) or "int8": what the native W4/W8 Linears compute in
ACTIVATIONS = ("bf16", "int8")
DEFAULT_ACTIVATIONS = "bf16"

KERNEL4 = TiledKernel(SOURCE, "w4a8", isa="int8act")
KERNEL8 = TiledKernel(SOURCE, "w8a8", isa="int8act")


def activations() -> str:
    """The activation precision asked for in the environment ('bf16' when unset)."""
    value = os.environ.get(ACTIVATIONS_ENV, "").strip().lower() or DEFAULT_ACTIVATIONS
    if value not in ACTIVATIONS:
        raise ConfigError(f"{ACTIVATIONS_ENV}={value!r}: choose one of {', '.join(ACTIVATIONS)}")
    return value


def available() -> bool:
    """True when the int8-activation kernels are built and loaded here (and not switched off)."""
    return KERNEL4.available()


def isa() -> str | None:
    """'avx512vnni', 'avx2vnni', 'avx2', 'neon-i8mm', 'neon-dotprod' or 'portable' (the tiles compiled in),
    None when unavailable."""
    return KERNEL4.isa()


def use_int8() -> bool:
    """Whether native Linears made now should run int8 activations: asked for, and the kernel runs here."""
    return activations() == "int8" and available()


def linear4(x: torch.Tensor, weight: W4A16Weight, bias: torch.Tensor | None = None,
            threads: int | None = None) -> torch.Tensor:
    """x [M, K] float32 -> [M, N] float32 over W4A16 tiles, activations int8 (`flowedge::w4a8_linear`
    under compile)."""
    return KERNEL4.linear(x, weight, bias, threads)


def linear8(x: torch.Tensor, weight: W8A16Weight, bias: torch.Tensor | None = None,
            threads: int | None = None) -> torch.Tensor:
    """x [M, K] float32 -> [M, N] float32 over W8A16 tiles, activations int8 (`flowedge::w8a8_linear`)."""
    return KERNEL8.linear(x, weight, bias, threads)
