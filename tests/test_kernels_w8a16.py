"""The native W8A16 kernel: equal to a float64 reference up to float32 rounding, closer to the float weight
than W4A16, Int8Linear on it, and the fallback (the invariance every tiled kernel keeps: test_kernels_tiled.py)."""
from __future__ import annotations

import pytest
import torch
from kernel_helpers import check_native_linear
from kernel_helpers import make as make_kernel
from kernel_helpers import rebuilt, rel_err  # noqa: F401 (rebuilt: a fixture)

from flowedge.kernels import build, w8a16
from flowedge.models.quant8 import Int8Linear, pack_int8

pytestmark = pytest.mark.skipif(not w8a16.available(), reason="no C compiler: the fallback tests cover this")


def make(n: int, k: int, g: int = 32, seed: int = 0) -> tuple:
    """(packed, tiles, x [64, K], bias [N])"""
    return make_kernel("w8a16", n, k, g, seed)[:4]


def exact(x: torch.Tensor, packed, bias: torch.Tensor | None = None) -> torch.Tensor:
    """The kernel's maths in float64: bf16(x) @ (code * scale)^T (+ bias)."""
    y = x.bfloat16().double() @ packed.dequantize().double().T
    return y if bias is None else y + bias.double()


@pytest.mark.parametrize("g", [16, 32, 64, 256])
def test_equals_the_float64_reference_to_float32_rounding(g):
    packed, weight, x, bias = make(96, 1024, g)
    assert rel_err(w8a16.linear(x, weight, bias), exact(x, packed, bias)) < 2e-6


def test_a_wrong_layout_would_be_caught():
    """The reference test can fail: codes of the neighbouring output or input give a large error."""
    packed, weight, x, _ = make(96, 256)
    swapped = type(packed)(packed.qweight.roll(1, dims=1).contiguous(), packed.scales)
    assert rel_err(w8a16.linear(x, weight), exact(x, swapped)) > 0.1


def test_closer_to_the_float_weight_than_w4a16():
    from flowedge.kernels import w4a16
    from flowedge.models.quant import pack_int4

    gen = torch.Generator().manual_seed(3)
    w, x = torch.randn(96, 512, generator=gen) * 0.05, torch.randn(8, 512, generator=gen)
    ref = x.double() @ w.double().T
    err8 = rel_err(w8a16.linear(x, w8a16.prepare(pack_int8(w))), ref)
    assert err8 < 1e-2   # int8 steps of max|w|/127 per group of 32; bf16(x) adds ~1e-3
    if w4a16.available():
        assert err8 * 10 < rel_err(w4a16.linear(x, w4a16.prepare(pack_int4(w))), ref)


def test_int8_linear_uses_it_and_keeps_its_behaviour():
    packed, _, x, bias = make(48, 128)
    layer = Int8Linear.from_packed(packed, bias)
    check_native_linear(layer, x)


def test_env_switch_falls_back_to_a_bfloat16_weight(monkeypatch, rebuilt):
    monkeypatch.setenv(build.KERNELS_ENV, "torch")
    packed, _, x, bias = make(48, 128)
    layer = Int8Linear.from_packed(packed, bias)
    assert not w8a16.available() and not layer.native and layer.weight.dtype == torch.bfloat16
    assert rel_err(layer(x), exact(x, packed, bias)) < 1e-2

