"""What the tiled weight kernels (w4a16.c, w8a16.c, and int8act.c's w4a8 and w8a8 over the same tiles)
share on the Python side: loading the built library with its C signatures, and the checked call
`<name>_linear(x, tiles, N, G, bias, out, threads)`.

All take a weight in tiles of 16 outputs by groups of G inputs and run the same contract (float32 x
[M, K] in, float32 [M, N] out, rows independent), so only the function names and the tile contents differ.
"""
from __future__ import annotations

import ctypes
from pathlib import Path

import torch

from flowedge.kernels import build

TILE = 16   # outputs per tile


def supports(out_features: int, in_features: int, group_size: int) -> bool:
    """Whether a weight's shape fits the tiled layout."""
    return (out_features % TILE == 0 and group_size % 16 == 0 and 16 <= group_size <= 256
            and in_features % group_size == 0)


class TiledKernel:
    """The C library built from `source`, exporting `<name>_linear` and `<isa>_isa` (isa defaults to name;
    one library may hold several kernels)."""

    def __init__(self, source: Path, name: str, isa: str | None = None) -> None:
        self.source, self.name, self.isa_symbol = source, name, f"{isa or name}_isa"

    def library(self) -> ctypes.CDLL | None:
        built = build.load(self.source)   # cached; None when unavailable (logged once by build)
        if built is None:
            return None
        lib = built.lib
        typed = lib.__dict__.setdefault("_flowedge_typed", set())
        if self.name not in typed:
            fn = getattr(lib, f"{self.name}_linear")
            fn.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p, ctypes.c_int64,
                           ctypes.c_int64, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int]
            fn.restype = ctypes.c_int
            getattr(lib, self.isa_symbol).restype = ctypes.c_char_p
            typed.add(self.name)
        return lib

    def available(self) -> bool:
        return self.library() is not None

    def isa(self) -> str | None:
        lib = self.library()
        return None if lib is None else getattr(lib, self.isa_symbol)().decode()

    def call(self, x: torch.Tensor, tiles: torch.Tensor, out_features: int, in_features: int, group_size: int,
             bias: torch.Tensor | None, threads: int) -> torch.Tensor:
        """x [M, K] float32 -> [M, N] float32 through the C function."""
        lib = self.library()
        label = self.name.upper()
        if lib is None:
            raise RuntimeError(f"native {label} kernel unavailable (see the log for why)")
        m, k = x.shape
        if k != in_features or x.dtype != torch.float32:
            raise ValueError(f"x must be float32 [M, {in_features}], got {x.dtype} {tuple(x.shape)}")
        out = torch.empty(m, out_features, dtype=torch.float32)
        if m == 0:
            return out
        x = x.contiguous()
        if bias is not None and (bias.dtype != torch.float32 or not bias.is_contiguous()):
            bias = bias.float().contiguous()
        rc = getattr(lib, f"{self.name}_linear")(x.data_ptr(), m, k, tiles.data_ptr(), out_features, group_size,
                                                 None if bias is None else bias.data_ptr(), out.data_ptr(), threads)
        if rc != 0:
            raise RuntimeError(f"{self.name}_linear failed (M={m}, K={k}, N={out_features})")
        return out
