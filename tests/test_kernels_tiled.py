"""The contract every tiled kernel keeps (W4A16, W8A16, and W4A8 / W8A8 over the same tiles): a row's
result is bitwise the same whatever rows share the call or how many threads run it, at every ISA level this
CPU runs (AVX-512, AVX2, portable on x86); each level agrees with the portable reference (int8 activations
bit for bit); the bias is added once; bad input is refused; tiles concatenate; torch.compile calls the
custom op without a graph break. tests/test_kernels_neon.py checks the NEON tiles the same way under qemu."""
from __future__ import annotations

import shutil

import pytest
import torch
from kernel_helpers import KERNELS, LEVELS, level, make, rebuilt, rel_err  # noqa: F401 (fixtures)

from flowedge.kernels import build, int8act, isa, tiled, w4a16
from flowedge.models.quant import Int4Linear
from flowedge.models.quant8 import Int8Linear

pytestmark = pytest.mark.skipif(not (w4a16.available() and int8act.available()),
                                reason="no C compiler: the fallback tests cover this")

KINDS = tuple(KERNELS)


@pytest.mark.parametrize("kind", KINDS)
# 208: 13 tiles, not a multiple of the wide step; 400: 25 tiles, three 1-row steps of 8 (AVX-512) and one over
@pytest.mark.parametrize("n,k", [(64, 256), (208, 512), (400, 256)])
def test_each_row_equals_the_row_alone_for_1_to_64_rows(level, kind, n, k):
    _, weight, x, bias, linear = make(kind, n, k)
    alone = torch.cat([linear(x[i:i + 1], weight, bias) for i in range(64)])
    for m in range(1, 65):
        assert torch.equal(linear(x[:m], weight, bias), alone[:m]), f"M={m}"


@pytest.mark.parametrize("kind", KINDS)
def test_a_row_ignores_its_neighbours(level, kind):
    _, weight, x, _, linear = make(kind, 64, 256)
    alone = linear(x[:1], weight)
    for seed in range(4):
        others = torch.randn(11, 256, generator=torch.Generator().manual_seed(seed)) * 10 ** seed
        together = linear(torch.cat([others[:seed * 3], x[:1], others[seed * 3:]]), weight)
        assert torch.equal(together[seed * 3], alone[0])


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("m", [1, 2, 5, 19])   # each row-pass width splits the tiles its own way
@pytest.mark.parametrize("n", [208, 400])
def test_thread_count_does_not_change_a_bit(level, kind, m, n):
    _, weight, x, bias, linear = make(kind, n, 512)
    one = linear(x[:m], weight, bias, threads=1)
    for threads in (2, 3, 5, 64):
        assert torch.equal(linear(x[:m], weight, bias, threads=threads), one)


@pytest.mark.parametrize("kind", KINDS)
def test_bias_is_added_once(level, kind):
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
def test_tiles_concatenate_into_the_weight_of_both(level, kind):
    _, wa, x, _, linear = make(kind, 48, 128, seed=1)
    _, wb, _, _, _ = make(kind, 32, 128, seed=2)
    both = type(wa)(torch.cat([wa.tiles, wb.tiles]), 80, 128, 32)
    assert torch.equal(linear(x, both), torch.cat([linear(x, wa), linear(x, wb)], dim=1))


def test_each_kernel_has_its_custom_op():
    assert isinstance(w4a16.KERNEL.op, torch._ops.OpOverloadPacket)
    for name in ("w4a16", "w8a16", "w4a8", "w8a8"):
        assert hasattr(torch.ops.flowedge, f"{name}_linear")
    assert tiled.supports(32, 256, 64) and not tiled.supports(40, 256, 64) and not tiled.supports(32, 256, 512)


@pytest.mark.parametrize("kind", KINDS)
def test_each_level_agrees_with_the_portable_reference(level, kind):
    """int8 activations: the same bits (the same integers and float operations); bf16: the last bits may
    differ (FMA, the dot product's order, AVX2's zero point taking the -8), never between rows of one build."""
    _, weight, x, bias, linear = make(kind, 208, 256)
    here = linear(x[:33], weight, bias)
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv(isa.ISA_ENV, "portable")
        build.load.cache_clear()
        assert w4a16.isa() == "portable" and int8act.isa() == "portable"
        reference = linear(x[:33], weight, bias)
    build.load.cache_clear()
    if kind.endswith("a8"):
        assert torch.equal(here, reference)
    else:
        assert rel_err(here, reference) < 1e-5


# level -> (the bf16 kernels' tile code, the int8 kernels'): avx512 runs the AVX-512 tiles where the CPU has
# their extensions, else the AVX2 ones; the int8 AVX2 tiles use AVX-VNNI where there is one
TILE_CODES = {"avx512": ({"avx512bf16", "avx2"}, {"avx512vnni", "avx2vnni", "avx2"}),
              "avx2": ({"avx2"}, {"avx2vnni", "avx2"}), "neon": ({"neon"}, {"neon-i8mm", "neon-dotprod", "portable"}),
              "portable": ({"portable"}, {"portable"})}


def test_each_level_builds_its_own_tiles(level):
    bf16_codes, int8_codes = TILE_CODES[level]
    assert w4a16.isa() in bf16_codes and int8act.isa() in int8_codes


@pytest.mark.skipif(shutil.which("gcc") is None or "avx2" not in LEVELS, reason="needs gcc on an AVX2 x86")
def test_cc_flags_come_after_the_level_so_an_avx512_cpu_can_build_as_an_avx2_one(monkeypatch, rebuilt):
    monkeypatch.setenv(build.CC_ENV, "gcc -mno-avx512f")
    assert w4a16.isa() == "avx2" and int8act.isa().startswith("avx2")
    monkeypatch.setenv(build.CC_ENV, "gcc -mno-avx512f -mno-avxvnni")   # an AVX2 CPU before AVX-VNNI
    build.load.cache_clear()
    assert int8act.isa() == "avx2"
    _, weight, x, bias, linear = make("w8a8", 208, 256)
    assert torch.equal(linear(x[:9], weight, bias), torch.cat([linear(x[i:i + 1], weight, bias) for i in range(9)]))


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
