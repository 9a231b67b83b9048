"""The int8-activation kernels (W4A8, W8A8 over the W4A16 / W8A16 tiles): bitwise row and thread
invariance, the exact integer numerics against a float64 model of them, accuracy against the float
weights next to the bf16 kernels', the portable build agreeing bit for bit, and the FLOWEDGE_ACTIVATIONS
switch in the Linears."""
from __future__ import annotations

import shutil

import pytest
import torch

from flowedge.errors import ConfigError
from flowedge.kernels import build, int8act, w4a16, w8a16
from flowedge.models.quant import Int4Linear, fuse_native, pack_int4
from flowedge.models.quant8 import Int8Linear, pack_int8

pytestmark = pytest.mark.skipif(not int8act.available(), reason="no C compiler: the fallback tests cover this")

KINDS = ("w4", "w8")


def make(kind: str, n: int, k: int, g: int = 32, seed: int = 0) -> tuple:
    """(packed, prepared tiles, x [64, K], bias [N], the int8 kernel)"""
    gen = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=gen) * 0.05
    x, bias = torch.randn(64, k, generator=gen), torch.randn(n, generator=gen)
    if kind == "w4":
        packed = pack_int4(w, g)
        return packed, w4a16.prepare(packed), x, bias, int8act.linear4
    packed = pack_int8(w, g)
    return packed, w8a16.prepare(packed), x, bias, int8act.linear8


def bf16_kernel(kind: str):
    return w4a16.linear if kind == "w4" else w8a16.linear


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


def model(kind: str, x: torch.Tensor, packed, bias: torch.Tensor | None = None) -> torch.Tensor:
    """The documented numerics in float64: per (row, group) s_a = max|x| / 127, q = round-half-even(x / s_a);
    y = sum_g scale * s_a * sum (code - 8) q + zero * sum x (W4), or sum_g scale * s_a * sum code q (W8)."""
    m, k = x.shape
    g = packed.group_size
    xg = x.reshape(m, k // g, g)
    s_a = xg.abs().amax(-1, keepdim=True) / 127
    q = torch.where(s_a > 0, torch.round(xg / s_a), torch.zeros_like(xg))   # torch.round: half to even
    n = packed.out_features
    if kind == "w4":
        codes = (packed.codes() - 8).double().reshape(n, k // g, g)
        scale, zero = packed.scales.double(), packed.zeros.double()
    else:
        codes = packed.qweight.double().reshape(n, k // g, g)
        scale, zero = packed.scales.double(), torch.zeros_like(packed.scales, dtype=torch.float64)
    s = torch.einsum("mgk,ngk->mng", q.double(), codes)              # exact integers
    y = (s * scale[None] * s_a.double().squeeze(-1)[:, None]).sum(-1)
    y = y + xg.double().sum(-1) @ zero.T
    return y if bias is None else y + bias.double()


@pytest.fixture
def rebuilt(monkeypatch, tmp_path):
    monkeypatch.setenv("FLOWEDGE_HOME", str(tmp_path))
    build.load.cache_clear()
    yield
    build.load.cache_clear()


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("n,k", [(64, 256), (208, 512)])   # 208: 13 tiles, not a multiple of the wide step
def test_each_row_equals_the_row_alone_for_1_to_33_rows(kind, n, k):
    _, weight, x, bias, linear = make(kind, n, k)
    alone = torch.cat([linear(x[i:i + 1], weight, bias) for i in range(33)])
    for m in range(1, 34):
        assert torch.equal(linear(x[:m], weight, bias), alone[:m]), f"M={m}"


@pytest.mark.parametrize("kind", KINDS)
def test_a_row_ignores_its_neighbours(kind):
    _, weight, x, _, linear = make(kind, 64, 256)
    alone = linear(x[:1], weight)
    for seed in range(4):
        others = torch.randn(11, 256, generator=torch.Generator().manual_seed(seed)) * 10 ** seed
        together = linear(torch.cat([others[:seed * 3], x[:1], others[seed * 3:]]), weight)
        assert torch.equal(together[seed * 3], alone[0])


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("m", [1, 2, 5, 19])
def test_thread_count_does_not_change_a_bit(kind, m):
    _, weight, x, bias, linear = make(kind, 208, 512)
    one = linear(x[:m], weight, bias, threads=1)
    for threads in (2, 3, 64):
        assert torch.equal(linear(x[:m], weight, bias, threads=threads), one)


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
    if kind == "w4":
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


@pytest.mark.skipif(shutil.which("gcc") is None or int8act.isa() != "avx512vnni", reason="needs gcc on AVX512-VNNI")
@pytest.mark.parametrize("kind", KINDS)
def test_portable_build_agrees_bit_for_bit(kind, monkeypatch, rebuilt):
    _, weight, x, bias, linear = make(kind, 208, 256)
    fast = linear(x[:33], weight, bias)
    monkeypatch.setenv(build.CC_ENV, "gcc -mno-avx512f")   # an AVX2-only x86
    build.load.cache_clear()
    assert int8act.isa() == "portable"
    portable = linear(x[:33], weight, bias)
    assert torch.equal(portable, fast)
    assert all(torch.equal(portable[i], linear(x[i:i + 1], weight, bias)[0]) for i in range(33))
    assert torch.equal(linear(x[:33], weight, bias, threads=3), portable)


def test_the_switch_is_read_when_a_linear_is_made(monkeypatch):
    monkeypatch.delenv(int8act.ACTIVATIONS_ENV, raising=False)
    packed4, _, x, bias, _ = make("w4", 48, 128)
    packed8, _, _, _, _ = make("w8", 48, 128)
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


def test_compiles_without_a_graph_break_and_gives_the_same_bits(monkeypatch):
    import torch._dynamo

    monkeypatch.setenv(int8act.ACTIVATIONS_ENV, "int8")
    packed4, _, x, bias, _ = make("w4", 48, 128)
    packed8, _, _, _, _ = make("w8", 48, 48, g=16)
    layers = torch.nn.Sequential(Int4Linear.from_packed(packed4, bias), torch.nn.SiLU(),
                                 Int8Linear.from_packed(packed8, None))
    assert torch._dynamo.explain(layers)(x[:5]).graph_break_count == 0
    assert torch.equal(torch.compile(layers, backend="eager")(x[:5]), layers(x[:5]))
