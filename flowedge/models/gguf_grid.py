"""A 4-bit GGUF tensor carried into W4A16 on its own grid, instead of re-quantized from its values.

A Q4_K (Q4_0, Q4_1) block stores each group of 32 weights as `step * q + base`, q in 0..15. W4A16 stores
`(code - 8) * scale + zero` per group of 32, the same kind of grid: with scale = step, zero = base + 8 *
step and code = q, the values are the GGUF's own, up to the bfloat16 rounding of scale and zero (2e-3
relative on the real 1.5B's layers). Re-quantizing from the values instead (min/max of each group) lands
on another grid wherever llama.cpp's quantizer left a code unused at either end: 4.5e-2 relative, a
second quantization on top of the first, and the largest loss of agreement with the float model.

The groups are the GGUF's sub-blocks, so this holds at group size 32 only; other block types (Q5_*,
K-quants of other widths) have no 16-level grid and are re-quantized as before.
"""
from __future__ import annotations

import numpy as np
import torch

from flowedge.models.gguf_model import GgufSource, unpermute_rope
from flowedge.models.quant import PackedInt4

GROUP_SIZE = 32
GRID_TYPES = ("Q4_0", "Q4_1", "Q4_K")
_CHUNK_ROWS = 4096


def on_grid(source: GgufSource, group_size: int) -> bool:
    """Whether `source` can be carried over on its own grid at this group size."""
    return group_size == GROUP_SIZE and source.qtype_name in GRID_TYPES and len(source.shape) == 2


def block_grid(blocks: np.ndarray, qtype: str) -> tuple[np.ndarray, np.ndarray]:
    """Raw blocks [n, bytes] of one 4-bit type -> (step, base) float32 [n, sub-blocks of 32], as gguf's
    own dequantisation computes them (value = step * q + base, float32)."""
    def half(a: int, b: int) -> np.ndarray:
        return blocks[:, a:b].copy().view(np.float16).astype(np.float32)

    if qtype == "Q4_0":                       # d, 16 bytes of codes: (q - 8) * d
        d = half(0, 2)
        return d, -8 * d
    if qtype == "Q4_1":                       # d, m, 16 bytes of codes: q * d + m
        return half(0, 2), half(2, 4)
    if qtype == "Q4_K":                       # d, dmin, 12 bytes of 6-bit (sc, m), 128 bytes of codes
        from gguf.quants import Q4_K

        sc, m = Q4_K.get_scale_min(blocks[:, 4:16].copy())
        return half(0, 2) * sc.astype(np.float32), -(half(2, 4) * m.astype(np.float32))
    raise ValueError(f"{qtype} has no 16-level grid")


def grid(source: GgufSource) -> tuple[torch.Tensor, torch.Tensor]:
    """(step, base) float32 [N, K / 32] of a 4-bit GGUF matrix, in Hugging Face row order."""
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

    t = source.matrix(torch.float32)
    block_bytes = GGML_QUANT_SIZES[GGMLQuantizationType(source.qtype)][1]
    steps, bases = [], []
    for start in range(0, t.rows, _CHUNK_ROWS):
        end = min(start + _CHUNK_ROWS, t.rows)
        blocks = np.ascontiguousarray(t.block_rows(start, end)).reshape(-1, block_bytes)
        block_step, block_base = block_grid(blocks, source.qtype_name)
        steps.append(torch.from_numpy(block_step.reshape(end - start, -1)))
        bases.append(torch.from_numpy(block_base.reshape(end - start, -1)))
    step, base = torch.cat(steps), torch.cat(bases)
    if source.rope_heads:   # llama.cpp permuted whole rows: the grid's rows go with them
        step, base = unpermute_rope(step, source.rope_heads), unpermute_rope(base, source.rope_heads)
    return step, base


def pack_on_grid(weight: torch.Tensor, step: torch.Tensor, base: torch.Tensor) -> PackedInt4:
    """W4A16 of a [N, K] float32 weight whose groups of 32 lie on `step * q + base` (q in 0..15)."""
    n, k = weight.shape
    safe = torch.where(step != 0, step, torch.ones_like(step)).unsqueeze(-1)
    codes = ((weight.reshape(n, k // GROUP_SIZE, GROUP_SIZE) - base.unsqueeze(-1)) / safe).round().clamp(0, 15)
    codes = codes.to(torch.int32).reshape(n, k)
    qweight = (codes[:, 0::2] | (codes[:, 1::2] << 4)).to(torch.uint8)
    return PackedInt4(qweight.contiguous(), step.to(torch.bfloat16).contiguous(),
                      (base + 8 * step).to(torch.bfloat16).contiguous())


def pack_source(source: GgufSource) -> PackedInt4:
    """A 4-bit GGUF layer weight as W4A16 on its own grid (its float32 values, then their codes)."""
    step, base = grid(source)
    return pack_on_grid(source.load(), step, base)
