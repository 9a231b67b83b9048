"""The native W4A16 kernel: bitwise row and thread invariance, accuracy, shapes, and the torch fallback."""
from __future__ import annotations

import shutil

import pytest
import torch

from flowedge.kernels import build, w4a16
from flowedge.models.quant import Int4Linear, pack_int4

pytestmark = pytest.mark.skipif(not w4a16.available(), reason="no C compiler: the fallback tests cover this")


def make(n: int, k: int, g: int = 32, seed: int = 0) -> tuple:
    gen = torch.Generator().manual_seed(seed)
    packed = pack_int4(torch.randn(n, k, generator=gen) * 0.05, g)
    return packed, w4a16.prepare(packed), torch.randn(64, k, generator=gen), torch.randn(n, generator=gen)


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).norm() / b.norm()).item()


@pytest.fixture
def rebuilt(monkeypatch, tmp_path):
    """Build (and load) the kernel afresh under a private FLOWEDGE_HOME with the env the test sets."""
    monkeypatch.setenv("FLOWEDGE_HOME", str(tmp_path))
    build.load.cache_clear()
    yield
    build.load.cache_clear()


@pytest.mark.parametrize("n,k", [(64, 256), (208, 512)])   # 208: 13 tiles, not a multiple of the wide step
def test_each_row_equals_the_row_alone_for_1_to_64_rows(n, k):
    _, weight, x, bias = make(n, k)
    alone = torch.cat([w4a16.linear(x[i:i + 1], weight, bias) for i in range(64)])
    for m in range(1, 65):
        assert torch.equal(w4a16.linear(x[:m], weight, bias), alone[:m]), f"M={m}"


def test_a_row_ignores_its_neighbours():
    _, weight, x, _ = make(64, 256)
    alone = w4a16.linear(x[:1], weight)
    for seed in range(4):
        others = torch.randn(11, 256, generator=torch.Generator().manual_seed(seed)) * 10 ** seed
        together = w4a16.linear(torch.cat([others[:seed * 3], x[:1], others[seed * 3:]]), weight)
        assert torch.equal(together[seed * 3], alone[0])


@pytest.mark.parametrize("m", [1, 2, 5, 19])   # each row-pass width splits the tiles its own way
def test_thread_count_does_not_change_a_bit(m):
    _, weight, x, bias = make(208, 512)
    one = w4a16.linear(x[:m], weight, bias, threads=1)
    for threads in (2, 3, 5, 64):
        assert torch.equal(w4a16.linear(x[:m], weight, bias, threads=threads), one)


@pytest.mark.parametrize("g", [32, 64, 128, 256])
def test_close_to_the_dequantized_reference_like_int4pack(g):
    packed, weight, x, bias = make(96, 1024, g)
    ref = x @ packed.dequantize().T + bias
    err = rel_err(w4a16.linear(x, weight, bias), ref)
    sz = torch.stack([packed.scales, packed.zeros], dim=-1).transpose(0, 1).contiguous()
    int4pack = torch.ops.aten._weight_int4pack_mm_for_cpu(
        x.bfloat16(), torch.ops.aten._convert_weight_to_int4pack_for_cpu(packed.codes(), 1), g, sz).float() + bias
    assert err < 5e-3 and err <= 1.5 * rel_err(int4pack, ref)


def test_bias_is_added_once():
    _, weight, x, bias = make(48, 128)
    assert torch.equal(w4a16.linear(x, weight, bias), w4a16.linear(x, weight) + bias)


def test_bad_inputs_are_refused():
    _, weight, x, _ = make(48, 128)
    with pytest.raises(ValueError, match="float32"):
        w4a16.linear(x.bfloat16(), weight)
    with pytest.raises(ValueError, match="N % 16"):
        w4a16.prepare(pack_int4(torch.randn(40, 128), 32))
    assert w4a16.linear(x[:0], weight).shape == (0, 48)


def test_int4_linear_uses_it_and_keeps_its_behaviour():
    packed, _, x, bias = make(48, 128)
    layer = Int4Linear.from_packed(packed, bias)
    assert layer.native and "kernel=native" in repr(layer)
    x3 = x[:12].reshape(2, 6, 128)
    assert layer(x3).shape == (2, 6, 48) and layer(x3).dtype == torch.float32
    assert layer(x3.bfloat16()).dtype == torch.bfloat16
    assert torch.equal(layer(x3)[1, 2], layer(x3[1, 2:3])[0])
    assert rel_err(layer(x[:12]), x[:12] @ packed.dequantize().T + bias) < 5e-3


def test_env_switch_falls_back_to_torch_int4pack(monkeypatch, rebuilt):
    monkeypatch.setenv(build.KERNELS_ENV, "torch")
    packed, _, x, bias = make(48, 128)
    layer = Int4Linear.from_packed(packed, bias)
    assert not w4a16.available() and not layer.native
    assert rel_err(layer(x), x @ packed.dequantize().T + bias) < 1e-2


def test_missing_compiler_falls_back_with_one_clear_line(monkeypatch, rebuilt, caplog):
    monkeypatch.setenv(build.CC_ENV, "/nonexistent/cc")
    assert w4a16.isa() is None and not w4a16.available()
    warnings = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert len(warnings) == 1 and "/nonexistent/cc" in warnings[0] and "torch's kernels" in warnings[0]
    packed, _, x, _ = make(48, 128)
    assert not Int4Linear.from_packed(packed, None).native


@pytest.mark.skipif(shutil.which("gcc") is None or w4a16.isa() != "avx512bf16", reason="needs gcc on AVX512-BF16")
def test_portable_build_is_row_invariant_and_accurate(monkeypatch, rebuilt):
    monkeypatch.setenv(build.CC_ENV, "gcc -mno-avx512f")   # an AVX2-only x86
    assert w4a16.isa() == "portable"
    packed, weight, x, bias = make(208, 256)
    full = w4a16.linear(x[:33], weight, bias)
    assert all(torch.equal(full[i], w4a16.linear(x[i:i + 1], weight, bias)[0]) for i in range(33))
    assert torch.equal(w4a16.linear(x[:33], weight, bias, threads=3), full)
    assert rel_err(full, x[:33] @ packed.dequantize().T + bias) < 5e-3


def test_compiles_without_a_graph_break_and_gives_the_same_bits():
    import torch._dynamo

    packed, _, x, bias = make(48, 128)
    layers = torch.nn.Sequential(Int4Linear.from_packed(packed, bias), torch.nn.SiLU())
    assert torch._dynamo.explain(layers)(x[:5]).graph_break_count == 0
    assert torch.equal(torch.compile(layers, backend="eager")(x[:5]), layers(x[:5]))
