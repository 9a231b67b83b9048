"""The contract every tiled kernel keeps (W4A16, W8A16, and W4A8 / W8A8 over the same tiles): a row's
result is bitwise the same whatever rows share the call or how many threads run it, in the native build
and the portable one; the bias is added once; bad input is refused; tiles concatenate; torch.compile
calls the custom op without a graph break."""
from __future__ import annotations

import shutil

import pytest
import torch
from kernel_helpers import KERNELS, make, rebuilt, rel_err  # noqa: F401 (rebuilt: a fixture)

from flowedge.kernels import build, int8act, tiled, w4a16
from flowedge.models.quant import Int4Linear
from flowedge.models.quant8 import Int8Linear

pytestmark = pytest.mark.skipif(not (w4a16.available() and int8act.available()),
                                reason="no C compiler: the fallback tests cover this")

KINDS = tuple(KERNELS)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("n,k", [(64, 256), (208, 512)])   # 208: 13 tiles, not a multiple of the wide step
def test_each_row_equals_the_row_alone_for_1_to_64_rows(kind, n, k):
    _, weight, x, bias, linear = make(kind, n, k)
    alone = torch.cat([linear(x[i:i + 1], weight, bias) for i in range(64)])
    for m in range(1, 65):
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
@pytest.mark.parametrize("m", [1, 2, 5, 19])   # each row-pass width splits the tiles its own way
def test_thread_count_does_not_change_a_bit(kind, m):
    _, weight, x, bias, linear = make(kind, 208, 512)
    one = linear(x[:m], weight, bias, threads=1)
    for threads in (2, 3, 5, 64):
        assert torch.equal(linear(x[:m], weight, bias, threads=threads), one)


@pytest.mark.parametrize("kind", KINDS)
def test_bias_is_added_once(kind):
    _, weight, x, bias, linear = make(kind, 48, 128)
    assert torch.equal(linear(x, weight, bias), linear(x, weight) + bias)


@pytest.mark.parametrize("kind", KINDS)
def test_bad_inputs_are_refused(kind):
    pack, prepare, _ = KERNELS[kind]
    _, weight, x, _, linear = make(kind, 48, 128)
    with pytest.raises(ValueError, match="float32"):
        linear(x.bfloat16(), weight)
    with pytest.raises(ValueError, match=r"N % 16 == 0 and G in 16\.\.256"):
        prepare(pack(torch.randn(40, 128), 32))
    assert linear(x[:0], weight).shape == (0, 48)


@pytest.mark.parametrize("kind", KINDS)
def test_tiles_concatenate_into_the_weight_of_both(kind):
    _, wa, x, _, linear = make(kind, 48, 128, seed=1)
    _, wb, _, _, _ = make(kind, 32, 128, seed=2)
    both = type(wa)(torch.cat([wa.tiles, wb.tiles]), 80, 128, 32)
    assert torch.equal(linear(x, both), torch.cat([linear(x, wa), linear(x, wb)], dim=1))


def test_each_kernel_has_its_custom_op():
    assert isinstance(w4a16.KERNEL.op, torch._ops.OpOverloadPacket)
    for name in ("w4a16", "w8a16", "w4a8", "w8a8"):
        assert hasattr(torch.ops.flowedge, f"{name}_linear")
    assert tiled.supports(32, 256, 64) and not tiled.supports(40, 256, 64) and not tiled.supports(32, 256, 512)


@pytest.mark.skipif(shutil.which("gcc") is None or w4a16.isa() != "avx512bf16" or int8act.isa() != "avx512vnni",
                    reason="needs gcc on AVX512-BF16 and VNNI")
@pytest.mark.parametrize("kind", KINDS)
def test_portable_build_is_row_invariant_and_agrees_with_the_native_one(kind, monkeypatch, rebuilt):
    """int8 activations: the same bits (the same integers and float operations); bf16: the last bits may
    differ (FMA and the dot product's order), never between rows of one build."""
    _, weight, x, bias, linear = make(kind, 208, 256)
    native = linear(x[:33], weight, bias)
    monkeypatch.setenv(build.CC_ENV, "gcc -mno-avx512f")   # an AVX2-only x86
    build.load.cache_clear()
    assert w4a16.isa() == "portable" and int8act.isa() == "portable"
    portable = linear(x[:33], weight, bias)
    assert all(torch.equal(portable[i], linear(x[i:i + 1], weight, bias)[0]) for i in range(33))
    assert torch.equal(linear(x[:33], weight, bias, threads=3), portable)
    if kind.endswith("a8"):
        assert torch.equal(portable, native)
    else:
        assert rel_err(portable, native) < 1e-5


@pytest.mark.parametrize("kind", KINDS)
def test_compiles_without_a_graph_break_and_gives_the_same_bits(kind, monkeypatch):
    import torch._dynamo

    monkeypatch.setenv(int8act.ACTIVATIONS_ENV, "int8" if kind.endswith("a8") else "bf16")
    packed, _, x, bias, _ = make(kind, 48, 128)
    layer = (Int4Linear if kind.startswith("w4") else Int8Linear).from_packed(packed, bias)
    assert layer.native and layer.int8 == kind.endswith("a8")
    layers = torch.nn.Sequential(layer, torch.nn.SiLU())
    assert torch._dynamo.explain(layers)(x[:5]).graph_break_count == 0
    assert torch.equal(torch.compile(layers, backend="eager")(x[:5]), layers(x[:5]))
