"""What the tiled weight kernels (w4a16.c, w8a16.c, and int8act.c's w4a8 and w8a8 over the same tiles)
share on the Python side: the weight type, loading the built library with its C signatures, the checked
call `<name>_linear(x, tiles, N, G, bias, out, threads)`, and the custom op `flowedge::<name>_linear`
that a compiled graph calls instead (no graph break).

All take a weight in tiles of 16 outputs by groups of G inputs and run the same contract (float32 x
[M, K] in, float32 [M, N] out, rows independent), so only the function names and the tile contents differ.
"""
from __future__ import annotations

import ctypes
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import torch

from flowedge.kernels import build

TILE = 16   # outputs per tile


def supports(out_features: int, in_features: int, group_size: int) -> bool:
    """Whether a weight's shape fits the tiled layout."""
    return (out_features % TILE == 0 and group_size % 16 == 0 and 16 <= group_size <= 256
            and in_features % group_size == 0)


class PackedShape(Protocol):
    """The shape of a portable packed weight a kernel repacks (`models.quant.PackedInt4` and
    `models.quant8.PackedInt8` are ones), described here so the kernels stay below the model code."""

    @property
    def out_features(self) -> int: ...

    @property
    def in_features(self) -> int: ...

    @property
    def group_size(self) -> int: ...


def checked_shape(w: PackedShape, label: str) -> tuple[int, int, int]:
    """(N, K, G) of a weight to repack; ValueError when the tiles cannot hold it."""
    n, k, g = w.out_features, w.in_features, w.group_size
    if not supports(n, k, g):
        raise ValueError(f"{label} kernel needs N % 16 == 0 and G in 16..256 dividing K (N={n}, K={k}, G={g})")
    return n, k, g


@dataclass(frozen=True, slots=True)
class TiledWeight:
    """A weight in a kernel's tiled layout: tiles uint8 [N/16, K/G, bytes per tile and group]."""

    tiles: torch.Tensor
    out_features: int
    in_features: int
    group_size: int


class TiledKernel:
    """The C library built from `source`, exporting `<name>_linear` and `<isa>_isa` (isa defaults to name;
    one library may hold several kernels). Making one registers its custom op, once per process."""

    def __init__(self, source: Path, name: str, isa: str | None = None) -> None:
        self.source, self.name, self.isa_symbol = source, name, f"{isa or name}_isa"
        self.op = _register_op(self)

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

    def linear(self, x: torch.Tensor, weight: TiledWeight, bias: torch.Tensor | None = None,
               threads: int | None = None) -> torch.Tensor:
        """x [M, K] float32 -> [M, N] float32 (plus a float32 bias [N]); `threads` defaults to torch's.

        Eager calls go straight to the C function (~3 us of overhead); under torch.compile the call is the
        custom op, so a compiled step has no graph break here (the op's eager dispatch would cost ~25 us a
        call, hence not used outside compile)."""
        if torch.compiler.is_compiling():
            return self.op(x, weight.tiles, weight.out_features, weight.in_features, weight.group_size, bias,
                           threads or 0)
        return self.call(x, weight.tiles, weight.out_features, weight.in_features, weight.group_size, bias,
                         threads or torch.get_num_threads())

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


def _register_op(kernel: TiledKernel) -> torch._ops.OpOverloadPacket:
    """Define `flowedge::<name>_linear` (the C call, and its output shape for tracing) and return it."""

    def run(x: torch.Tensor, tiles: torch.Tensor, out_features: int, in_features: int, group_size: int,
            bias: torch.Tensor | None, threads: int) -> torch.Tensor:
        return kernel.call(x, tiles, out_features, in_features, group_size, bias, threads or torch.get_num_threads())

    def shape(x: torch.Tensor, tiles: torch.Tensor, out_features: int, in_features: int, group_size: int,
              bias: torch.Tensor | None, threads: int) -> torch.Tensor:
        return x.new_empty(x.shape[0], out_features)

    op_name = f"{kernel.name}_linear"
    torch.library.custom_op(f"flowedge::{op_name}", run, mutates_args=()).register_fake(shape)
    return getattr(torch.ops.flowedge, op_name)
