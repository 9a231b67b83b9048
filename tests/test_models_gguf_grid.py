"""A 4-bit GGUF tensor is carried into W4A16 on its own grid: the values come back up to the bfloat16
rounding of scale and zero, where re-quantizing them lands on another grid (a second quantization)."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from flowedge.models.gguf_grid import block_grid, on_grid, pack_on_grid, pack_source
from flowedge.models.gguf_model import read_gguf
from flowedge.models.quant import pack_int4
from flowedge.models.tiny import make_tiny_model
from flowedge.models.tiny_gguf import write_tiny_gguf


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).norm() / b.norm()).item()


def _q4_k_blocks(n: int, seed: int = 0) -> np.ndarray:
    """Random Q4_K blocks (gguf cannot write them): any bytes are a block once d and dmin are sane."""
    rng = np.random.default_rng(seed)
    blocks = rng.integers(0, 256, (n, 144), dtype=np.uint8)
    blocks[:, 0:2] = np.full((n, 1), 2e-4, np.float16).view(np.uint8)     # d
    blocks[:, 2:4] = np.full((n, 1), 1e-3, np.float16).view(np.uint8)     # dmin
    return blocks


def test_q4_k_values_come_back_to_bfloat16_rounding():
    from gguf import GGMLQuantizationType, dequantize

    blocks = _q4_k_blocks(64)                                              # 8 rows of 2048
    values = torch.from_numpy(dequantize(blocks, GGMLQuantizationType.Q4_K).reshape(8, 2048).copy())
    step, base = (torch.from_numpy(a.reshape(8, -1)) for a in block_grid(blocks, "Q4_K"))
    err = rel_err(pack_on_grid(values, step, base).dequantize(), values)
    assert err < 5e-3 and err * 5 < rel_err(pack_int4(values, 32).dequantize(), values)


@pytest.fixture(scope="module")
def llama_gguf(tmp_path_factory):
    """Llama: llama.cpp permuted the q/k rows, so the grid's rows must follow them back."""
    d = tmp_path_factory.mktemp("grid")
    return read_gguf(write_tiny_gguf(make_tiny_model(d / "m", num_layers=1, arch="llama"), d / "m.gguf"))


def test_every_4_bit_layer_weight_comes_back_on_its_grid(llama_gguf):
    kinds = set()
    for source in llama_gguf.tensors:
        if not (source.name.startswith("model.layers.") and on_grid(source, 32)):
            continue
        values = source.load()
        assert rel_err(pack_source(source).dequantize(), values) < 5e-3, source.name   # a row off its grid: ~1
        kinds.add((source.qtype_name, bool(source.rope_heads)))
    assert {("Q4_0", True), ("Q4_1", False)} <= kinds   # k_proj (permuted rows), the MLP


def test_only_16_level_grids_at_group_size_32(llama_gguf):
    by_type = {s.qtype_name: s for s in llama_gguf.tensors if s.name.startswith("model.layers.")}
    assert on_grid(by_type["Q4_1"], 32) and not on_grid(by_type["Q4_1"], 64)
    assert not on_grid(by_type["Q8_0"], 32) and not on_grid(by_type["Q5_1"], 32)
    with pytest.raises(ValueError, match="no 16-level grid"):
        block_grid(np.zeros((1, 34), np.uint8), "Q8_0")
