"""The native W8A16 kernel: bitwise row and thread invariance, accuracy against a float reference, shapes,
the portable build and the fallback."""
from __future__ import annotations

import shutil

import pytest
import torch

from flowedge.kernels import build, w8a16
from flowedge.models.quant8 import Int8Linear, pack_int8

pytestmark = pytest.mark.skipif(not w8a16.available(), reason="no C compiler: the fallback tests cover this")


def make(n: int, k: int, g: int = 32, seed: int = 0) -> tuple:
    gen = torch.Generator().manual_seed(seed)
    packed = pack_int8(torch.randn(n, k, generator=gen) * 0.05, g)
    return packed, w8a16.prepare(packed), torch.randn(64, k, generator=gen), torch.randn(n, generator=gen)


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


def exact(x: torch.Tensor, packed, bias: torch.Tensor | None = None) -> torch.Tensor:
    """The kernel's maths in float64: bf16(x) @ (code * scale)^T (+ bias)."""
    y = x.bfloat16().double() @ packed.dequantize().double().T
    return y if bias is None else y + bias.double()


@pytest.fixture
def rebuilt(monkeypatch, tmp_path):
    monkeypatch.setenv("FLOWEDGE_HOME", str(tmp_path))
    build.load.cache_clear()
    yield
    build.load.cache_clear()


@pytest.mark.parametrize("n,k", [(64, 256), (208, 512)])   # 208: 13 tiles, not a multiple of the wide step
def test_each_row_equals_the_row_alone_for_1_to_64_rows(n, k):
    _, weight, x, bias = make(n, k)
    alone = torch.cat([w8a16.linear(x[i:i + 1], weight, bias) for i in range(64)])
    for m in range(1, 65):
        assert torch.equal(w8a16.linear(x[:m], weight, bias), alone[:m]), f"M={m}"


def test_a_row_ignores_its_neighbours():
    _, weight, x, _ = make(64, 256)
    alone = w8a16.linear(x[:1], weight)
    for seed in range(4):
        others = torch.randn(11, 256, generator=torch.Generator().manual_seed(seed)) * 10 ** seed
        together = w8a16.linear(torch.cat([others[:seed * 3], x[:1], others[seed * 3:]]), weight)
        assert torch.equal(together[seed * 3], alone[0])


@pytest.mark.parametrize("m", [1, 2, 5, 19])
def test_thread_count_does_not_change_a_bit(m):
    _, weight, x, bias = make(208, 512)
    one = w8a16.linear(x[:m], weight, bias, threads=1)
    for threads in (2, 3, 5, 64):
        assert torch.equal(w8a16.linear(x[:m], weight, bias, threads=threads), one)


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


def test_bias_is_added_once():
    _, weight, x, bias = make(48, 128)
    assert torch.equal(w8a16.linear(x, weight, bias), w8a16.linear(x, weight) + bias)


def test_bad_inputs_are_refused():
    _, weight, x, _ = make(48, 128)
    with pytest.raises(ValueError, match="float32"):
        w8a16.linear(x.bfloat16(), weight)
    with pytest.raises(ValueError, match="N % 16"):
        w8a16.prepare(pack_int8(torch.randn(40, 128), 32))
    assert w8a16.linear(x[:0], weight).shape == (0, 48)


def test_tiles_concatenate_into_the_weight_of_both():
    a, wa, x, _ = make(48, 128, seed=1)
    b, wb, _, _ = make(32, 128, seed=2)
    both = w8a16.W8A16Weight(torch.cat([wa.tiles, wb.tiles]), 80, 128, 32)
    assert torch.equal(w8a16.linear(x, both), torch.cat([w8a16.linear(x, wa), w8a16.linear(x, wb)], dim=1))


def test_int8_linear_uses_it_and_keeps_its_behaviour():
    packed, _, x, bias = make(48, 128)
    layer = Int8Linear.from_packed(packed, bias)
    assert layer.native and "kernel=native" in repr(layer)
    x3 = x[:12].reshape(2, 6, 128)
    assert layer(x3).shape == (2, 6, 48) and layer(x3).dtype == torch.float32
    assert layer(x3.bfloat16()).dtype == torch.bfloat16
    assert torch.equal(layer(x3)[1, 2], layer(x3[1, 2:3])[0])


def test_env_switch_falls_back_to_a_bfloat16_weight(monkeypatch, rebuilt):
    monkeypatch.setenv(build.KERNELS_ENV, "torch")
    packed, _, x, bias = make(48, 128)
    layer = Int8Linear.from_packed(packed, bias)
    assert not w8a16.available() and not layer.native and layer.weight.dtype == torch.bfloat16
    assert rel_err(layer(x), exact(x, packed, bias)) < 1e-2


@pytest.mark.skipif(shutil.which("gcc") is None or w8a16.isa() != "avx512bf16", reason="needs gcc on AVX512-BF16")
def test_portable_build_is_row_invariant_and_accurate(monkeypatch, rebuilt):
    monkeypatch.setenv(build.CC_ENV, "gcc -mno-avx512f")   # an AVX2-only x86
    assert w8a16.isa() == "portable"
    packed, weight, x, bias = make(208, 256)
    full = w8a16.linear(x[:33], weight, bias)
    assert all(torch.equal(full[i], w8a16.linear(x[i:i + 1], weight, bias)[0]) for i in range(33))
    assert torch.equal(w8a16.linear(x[:33], weight, bias, threads=3), full)
    assert rel_err(full, exact(x[:33], packed, bias)) < 2e-6


def test_compiles_without_a_graph_break_and_gives_the_same_bits():
    import torch._dynamo

    packed, _, x, bias = make(48, 128)
    layers = torch.nn.Sequential(Int8Linear.from_packed(packed, bias), torch.nn.SiLU())
    assert torch._dynamo.explain(layers)(x[:5]).graph_break_count == 0
    assert torch.equal(torch.compile(layers, backend="eager")(x[:5]), layers(x[:5]))
