"""The int8-activation kernels (W4A8, W8A8 over the W4A16 / W8A16 tiles): the exact integer numerics against
a float64 model of them, accuracy against the float weights next to the bf16 kernels', zero and non-finite
rows, and the FLOWEDGE_ACTIVATIONS switch in the Linears (the invariance every tiled kernel keeps, and the
portable build's bits: test_kernels_tiled.py)."""
from __future__ import annotations

import pytest
import torch
from kernel_helpers import KERNELS, make, rel_err

from flowedge.errors import ConfigError
from flowedge.kernels import int8act, w4a16, w8a16
from flowedge.models.quant import Int4Linear, fuse_native
from flowedge.models.quant8 import Int8Linear

pytestmark = pytest.mark.skipif(not int8act.available(), reason="no C compiler: the fallback tests cover this")

KINDS = ("w4a8", "w8a8")


def bf16_kernel(kind: str):
    return KERNELS[kind.replace("a8", "a16")][2]


def model(kind: str, x: torch.Tensor, packed, bias: torch.Tensor | None = None) -> torch.Tensor:
    """The documented numerics in float64: per (row, group) s_a = max|x| / 127, q = round-half-even(x / s_a);
    y = sum_g scale * s_a * sum (code - 8) q + zero * sum x (W4), or sum_g scale * s_a * sum code q (W8)."""
    m, k = x.shape
    g = packed.group_size
    xg = x.reshape(m, k // g, g)
    s_a = xg.abs().amax(-1, keepdim=True) / 127
    q = torch.where(s_a > 0, torch.round(xg / s_a), torch.zeros_like(xg))   # torch.round: half to even
    n = packed.out_features
    if kind == "w4a8":
        codes = (packed.codes() - 8).double().reshape(n, k // g, g)
        scale, zero = packed.scales.double(), packed.zeros.double()
    else:
        codes = packed.qweight.double().reshape(n, k // g, g)
        scale, zero = packed.scales.double(), torch.zeros_like(packed.scales, dtype=torch.float64)
    s = torch.einsum("mgk,ngk->mng", q.double(), codes)              # exact integers
    y = (s * scale[None] * s_a.double().squeeze(-1)[:, None]).sum(-1)
    y = y + xg.double().sum(-1) @ zero.T
    return y if bias is None else y + bias.double()


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("g", [16, 32, 64, 256])
def test_equals_the_float64_model_of_its_numerics(kind, g):
    """Integer sums are exact: what is left is the fp32 epilogue's rounding (a wrong layout, activation
    order or scale would be off by far more: see the next test)."""
    packed, weight, x, bias, linear = make(kind, 96, 1024, g)
    assert rel_err(linear(x, weight, bias), model(kind, x, packed, bias)) < 1e-6


@pytest.mark.parametrize("kind", KINDS)
def test_a_wrong_layout_would_be_caught(kind):
    packed, weight, x, _, linear = make(kind, 96, 256)
    if kind == "w4a8":
        swapped = type(packed)(packed.qweight.roll(1, dims=1).contiguous(), packed.scales, packed.zeros)
    else:
        swapped = type(packed)(packed.qweight.roll(1, dims=1).contiguous(), packed.scales)
    assert rel_err(linear(x, weight), model(kind, x, swapped)) > 0.05


@pytest.mark.parametrize("kind", KINDS)
def test_accuracy_against_the_float_weights_next_to_bf16(kind):
    """Against x @ dequantize(W).T in float32: int8 rounds x ~4x coarser than bf16 does; bounded here."""
    packed, weight, x, bias, linear = make(kind, 256, 1536)
    ref = x @ packed.dequantize().T + bias
    err8, err16 = rel_err(linear(x, weight, bias), ref), rel_err(bf16_kernel(kind)(x, weight, bias), ref)
    assert err8 < 8e-3 and err8 < 6 * err16, (err8, err16)


@pytest.mark.parametrize("kind", KINDS)
def test_zero_and_non_finite_rows(kind):
    _, weight, x, bias, linear = make(kind, 48, 128)
    x = x[:3].clone()
    x[0] = 0
    x[1, 5] = float("nan")
    y = linear(x, weight, bias)
    assert torch.equal(y[0], bias) and y[1].isnan().any() and torch.isfinite(y[2]).all()


def test_the_switch_is_read_when_a_linear_is_made(monkeypatch):
    monkeypatch.delenv(int8act.ACTIVATIONS_ENV, raising=False)
    packed4, _, x, bias, _ = make("w4a8", 48, 128)
    packed8, _, _, _, _ = make("w8a8", 48, 128)
    assert int8act.activations() == "bf16"
    bf16 = (Int4Linear.from_packed(packed4, bias), Int8Linear.from_packed(packed8, bias))
    assert not any(layer.int8 for layer in bf16)
    monkeypatch.setenv(int8act.ACTIVATIONS_ENV, "int8")
    int8 = (Int4Linear.from_packed(packed4, bias), Int8Linear.from_packed(packed8, bias))
    assert all(layer.int8 and "native-int8" in repr(layer) for layer in int8)
    w4, w8 = (w4a16.prepare(packed4), w8a16.prepare(packed8))
    assert torch.equal(int8[0](x), int8act.linear4(x, w4, bias)) and torch.equal(bf16[0](x), w4a16.linear(x, w4, bias))
    assert torch.equal(int8[1](x), int8act.linear8(x, w8, bias)) and torch.equal(bf16[1](x), w8a16.linear(x, w8, bias))
    assert torch.equal(int8[0](x.reshape(4, 16, 128))[1, 3], int8[0](x[19:20])[0])
    fused = fuse_native([int8[0], Int4Linear.from_packed(packed4, None)])
    assert fused is not None and fused.int8 and torch.equal(fused(x)[:, :48], int8[0](x))
    assert fuse_native([int8[0], bf16[0]]) is None   # never one call mixing activation precisions
    monkeypatch.setenv(int8act.ACTIVATIONS_ENV, "fp8")
    with pytest.raises(ConfigError, match="FLOWEDGE_ACTIVATIONS"):
        Int4Linear.from_packed(packed4, bias)

