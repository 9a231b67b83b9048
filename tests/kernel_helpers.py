"""Helpers for the native kernel tests: a random weight prepared for each tiled kernel, the relative error,
a fresh build under a private FLOWEDGE_HOME, and the kernels built for each ISA level this CPU runs."""
from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

from flowedge.kernels import build, int8act, isa, w4a16, w8a16
from flowedge.models.quant import pack_int4
from flowedge.models.quant8 import pack_int8

# kind -> (pack the float weight, prepare the tiles, the kernel); w4a8 and w8a8 read the bf16 kernels' tiles
KERNELS: dict[str, tuple[Callable, Callable, Callable]] = {
    "w4a16": (pack_int4, w4a16.prepare, w4a16.linear),
    "w8a16": (pack_int8, w8a16.prepare, w8a16.linear),
    "w4a8": (pack_int4, w4a16.prepare, int8act.linear4),
    "w8a8": (pack_int8, w8a16.prepare, int8act.linear8),
}


def make(kind: str, n: int, k: int, g: int = 32, seed: int = 0) -> tuple:
    """(packed weight [n, k], its tiles, x [64, k], bias [n], the kernel) from one seeded generator."""
    pack, prepare, linear = KERNELS[kind]
    gen = torch.Generator().manual_seed(seed)
    packed = pack(torch.randn(n, k, generator=gen) * 0.05, g)
    return packed, prepare(packed), torch.randn(64, k, generator=gen), torch.randn(n, generator=gen), linear


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


def check_native_linear(layer: torch.nn.Module, x: torch.Tensor) -> None:
    """A Linear on a native kernel says so, maps [..., K] to [..., N] in the input's dtype, and a row's
    output does not depend on the rows beside it."""
    assert layer.native and "kernel=native" in repr(layer)
    x3 = x[:12].reshape(2, 6, -1)
    assert layer(x3).shape == (2, 6, layer.out_features) and layer(x3).dtype == torch.float32
    assert layer(x3.bfloat16()).dtype == torch.bfloat16
    assert torch.equal(layer(x3)[1, 2], layer(x3[1, 2:3])[0])


@pytest.fixture
def rebuilt(monkeypatch, tmp_path):
    """Build (and load) the kernels afresh under a private FLOWEDGE_HOME with the env the test sets."""
    monkeypatch.setenv("FLOWEDGE_HOME", str(tmp_path))
    build.load.cache_clear()
    yield
    build.load.cache_clear()


LEVELS = tuple(level.name for level in isa.runnable())   # e.g. avx512, avx2, portable on an AVX-512 x86


@pytest.fixture(params=LEVELS)
def level(request, monkeypatch):
    """The test once per ISA level this CPU runs, the kernels built (or their cached build loaded) for it."""
    monkeypatch.setenv(isa.ISA_ENV, request.param)
    build.load.cache_clear()
    yield request.param
    build.load.cache_clear()
