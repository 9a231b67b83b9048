"""W8A16 weights: how they are quantized (a Q8_0 block keeps its codes, a Q6_K one its values to within
~1/8 (32/254) of its coarser sub-block's step), checked, and dequantised."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from flowedge.errors import ConfigError
from flowedge.models.quant8 import PackedInt8, pack_int8, packable8


def _gguf_roundtrip(w: torch.Tensor, qtype: str) -> torch.Tensor:
    from gguf import GGMLQuantizationType, dequantize, quants

    kind = GGMLQuantizationType[qtype]
    return torch.from_numpy(dequantize(quants.quantize(np.ascontiguousarray(w.numpy()), kind), kind).copy())


def test_a_q8_0_tensor_keeps_its_codes_exactly():
    w = _gguf_roundtrip(torch.randn(32, 256, generator=torch.Generator().manual_seed(0)) * 0.05, "Q8_0")
    packed = pack_int8(w)
    assert torch.equal(packed.dequantize(), w)


def test_a_q6_k_tensor_is_held_to_an_eighth_of_its_step():
    """Q6_K values (gguf cannot write them): d * sc * q per sub-block of 16, q in -32..31, sc a signed byte."""
    gen = torch.Generator().manual_seed(1)
    q = torch.randint(-32, 32, (32, 16, 16), generator=gen).float()
    sc = torch.randint(1, 128, (32, 16, 1), generator=gen).float()
    w = (q * sc * 1e-4).reshape(32, 256)
    err = (pack_int8(w).dequantize() - w).abs().reshape(32, 8, 32)
    step = sc.reshape(32, 8, 2).amax(-1, keepdim=True) * 1e-4   # the coarser Q6_K step of a group's two sub-blocks
    assert (err <= step * 0.127).all()   # half an int8 step when max |q| = 32: 32/254 of a Q6_K step
    assert err.max() > 0   # not trivially exact: the bound is what is tested


def test_codes_scales_and_shapes():
    w = torch.randn(48, 96, generator=torch.Generator().manual_seed(2))
    w[0, :32] = 0                                          # an all-zero group: codes 0, a harmless scale
    p = pack_int8(w)
    assert p.qweight.dtype == torch.int8 and tuple(p.qweight.shape) == (48, 96)
    assert p.scales.dtype == torch.float32 and tuple(p.scales.shape) == (48, 3)
    assert p.group_size == 32 and p.qweight.abs().max() == 127 and (p.qweight[0, :32] == 0).all()
    assert torch.allclose(p.dequantize(), w, atol=p.scales.max().item() / 2 + 1e-7)
    assert torch.equal(pack_int8(torch.cat([w] * 50)).qweight, torch.cat([p.qweight] * 50))   # rows independent


def test_check_refuses_what_is_not_w8a16():
    p = pack_int8(torch.randn(16, 64))
    p.check("ok")
    with pytest.raises(ConfigError, match="not a W8A16 weight"):
        PackedInt8(p.qweight.view(torch.uint8), p.scales).check("layer 0 v_proj")
    with pytest.raises(ConfigError):
        PackedInt8(p.qweight, p.scales.half()).check("x")


def test_packable8():
    assert packable8(256, 1536) is None and packable8(151936, 896) is None
    assert "out_features" in packable8(40, 64) and "group size" in packable8(16, 40)
