"""The native W4A16 kernel: accuracy next to torch's int4pack, Int4Linear on it, and the torch fallback
(the invariance every tiled kernel keeps: test_kernels_tiled.py)."""
from __future__ import annotations

import pytest
import torch
from kernel_helpers import check_native_linear
from kernel_helpers import make as make_kernel
from kernel_helpers import rebuilt, rel_err  # noqa: F401 (rebuilt: a fixture)

from flowedge.kernels import build, w4a16
from flowedge.models.quant import Int4Linear

pytestmark = pytest.mark.skipif(not w4a16.available(), reason="no C compiler: the fallback tests cover this")


def make(n: int, k: int, g: int = 32, seed: int = 0) -> tuple:
    """(packed, tiles, x [64, K], bias [N])"""
    return make_kernel("w4a16", n, k, g, seed)[:4]


@pytest.mark.parametrize("g", [32, 64, 128, 256])
def test_close_to_the_dequantized_reference_like_int4pack(g):
    packed, weight, x, bias = make(96, 1024, g)
    ref = x @ packed.dequantize().T + bias
    err = rel_err(w4a16.linear(x, weight, bias), ref)
    sz = torch.stack([packed.scales, packed.zeros], dim=-1).transpose(0, 1).contiguous()
    int4pack = torch.ops.aten._weight_int4pack_mm_for_cpu(
        x.bfloat16(), torch.ops.aten._convert_weight_to_int4pack_for_cpu(packed.codes(), 1), g, sz).float() + bias
    assert err < 5e-3 and err <= 1.5 * rel_err(int4pack, ref)


def test_int4_linear_uses_it_and_keeps_its_behaviour():
    packed, _, x, bias = make(48, 128)
    layer = Int4Linear.from_packed(packed, bias)
    check_native_linear(layer, x)
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

