"""Quantization backends on a tiny layer stack: accuracy, size, skips, unavailability."""
from __future__ import annotations

import pytest
import torch
from torch import nn

from flowedge.errors import BackendUnavailable, ConfigError
from flowedge.models import quant
from flowedge.models.quant import Int4Linear, available_backends, quantize_int4_weight, quantize_module

torch.set_num_threads(1)
USABLE = [b for b, reason in available_backends("cpu").items() if reason is None and b != "none"]


class Block(nn.Module):
    """A decoder-MLP-like stack plus an lm_head that must be left alone by default."""

    def __init__(self, out_last: int = 64) -> None:
        super().__init__()
        gen = torch.Generator().manual_seed(0)
        self.up = nn.Linear(128, 256)
        self.down = nn.Linear(256, 128, bias=False)
        self.odd = nn.Linear(128, out_last)
        self.lm_head = nn.Linear(128, 96, bias=False)
        with torch.no_grad():  # Gaussian weights, like trained layers (NF4 is built for them)
            for p in self.parameters():
                p.copy_(torch.randn(p.shape, generator=gen) * 0.05)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.down(torch.nn.functional.silu(self.up(x)))
        return torch.cat([self.odd(h), self.lm_head(h)], dim=-1)


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def test_none_is_a_noop():
    block = Block()
    before = {k: v.clone() for k, v in block.state_dict().items()}
    report = quantize_module(block, "none")
    assert report.quantized == 0 and report.bytes_after == report.bytes_before > 0
    assert all(torch.equal(before[k], v) for k, v in block.state_dict().items())


@pytest.mark.parametrize("backend", USABLE)
def test_backend_close_to_fp32_and_smaller(backend):
    block = Block()
    x = torch.randn(2, 7, 128, generator=torch.Generator().manual_seed(1))
    ref = block(x).detach()
    report = quantize_module(block, backend)
    out = block(x)
    assert out.dtype == torch.float32 and out.shape == ref.shape
    assert rel_err(out, ref) < 0.2  # two stacked 4-bit layers, ~0.09 each
    assert report.backend == backend and report.quantized == 3
    assert report.bytes_after < report.bytes_before / 3
    assert type(block.lm_head) is nn.Linear  # head untouched unless asked
    assert type(block.up) is not nn.Linear
    again = quantize_module(block, backend)  # already-quantized layers are not touched twice
    assert again.quantized == 0 and again.skipped == []
    assert torch.equal(block(x), out)


@pytest.mark.parametrize("backend", USABLE)
def test_bad_shape_is_skipped_and_reported(backend):
    block = Block(out_last=40)  # 40 is neither a multiple of 16 (int4) nor of 32 (nf4)
    x = torch.randn(3, 128, generator=torch.Generator().manual_seed(2))
    ref = block(x).detach()
    report = quantize_module(block, backend)
    assert report.quantized == 2
    assert len(report.skipped) == 1 and report.skipped[0].startswith("odd: out_features 40")
    assert type(block.odd) is nn.Linear
    assert rel_err(block(x), ref) < 0.2


def test_int4_in_features_not_multiple_of_group_is_skipped():
    stack = nn.Sequential(nn.Linear(96, 64), nn.Linear(64, 64))
    report = quantize_module(stack, "int4", group_size=64)
    assert report.quantized == 1
    assert report.skipped == ["0: in_features 96 not a multiple of group size 64"]


@pytest.mark.parametrize("backend", USABLE)
def test_single_layer_error_is_small(backend):
    gen = torch.Generator().manual_seed(4)
    stack = nn.Sequential(nn.Linear(256, 128))
    with torch.no_grad():
        stack[0].weight.copy_(torch.randn(128, 256, generator=gen) * 0.05)
    x = torch.randn(16, 256, generator=gen)
    ref = stack(x).detach()
    quantize_module(stack, backend)
    assert rel_err(stack(x), ref) < 0.1


def test_lm_head_quantized_when_asked():
    block = Block()
    report = quantize_module(block, "int4", skip_names=())
    assert report.quantized == 4 and isinstance(block.lm_head, Int4Linear)


def test_int4_codes_dequantise_to_the_weight():
    w = torch.randn(32, 64, generator=torch.Generator().manual_seed(3))
    codes, sz = quantize_int4_weight(w, 32)
    assert codes.dtype == torch.int32 and int(codes.min()) >= 0 and int(codes.max()) <= 15
    assert sz.shape == (2, 32, 2)
    scale = sz[..., 0].t().repeat_interleave(32, dim=1)  # [N, K]
    zero = sz[..., 1].t().repeat_interleave(32, dim=1)
    deq = (codes.float() - 8) * scale + zero
    assert (deq - w).abs().max() <= scale.max() / 2 + 1e-6


def test_int4_linear_keeps_leading_dims_and_bias():
    lin = nn.Linear(64, 32)
    q = Int4Linear.from_linear(lin, 32)
    x = torch.randn(2, 3, 5, 64)
    assert q(x).shape == (2, 3, 5, 32)
    assert rel_err(q(x), lin(x)) < 0.1


def test_unavailable_backend_names_an_alternative(monkeypatch):
    monkeypatch.setattr(quant, "_probe", lambda b, d: "no kernel for this CPU" if b == "nf4" else None)
    with pytest.raises(BackendUnavailable, match=r"nf4 needs bitsandbytes.*no kernel.*use --quant int4"):
        quantize_module(Block(), "nf4")
    assert available_backends()["nf4"] == "no kernel for this CPU"
    assert quant.default_backend("cpu") == "int4"


def test_unknown_backend_and_bad_group_size():
    with pytest.raises(ConfigError, match="unknown quantization backend"):
        quantize_module(Block(), "int3")
    with pytest.raises(ConfigError, match="group size"):
        quantize_module(Block(), "int4", group_size=48)


def test_draft_model_is_4bit_throughout_and_keeps_its_tied_embedding(tmp_path):
    from flowedge.engine.drafter import load_draft_model
    from flowedge.models.stage import StageModel
    from flowedge.models.tiny import make_tiny_model

    model_dir = make_tiny_model(tmp_path / "draft", vocab=272)   # 272 = 17 * 16: int4-able on CPU
    ref = StageModel.load(model_dir)
    draft = load_draft_model(model_dir, "int4")
    assert isinstance(draft.lm_head, Int4Linear)
    assert all(not isinstance(m, nn.Linear) for m in draft.layers.modules())
    assert torch.equal(draft.embed_tokens.weight, ref.embed_tokens.weight)   # lookup stays exact
    hidden = ref.embed(torch.arange(3, 19))
    assert rel_err(draft.logits(hidden), ref.logits(hidden)) < 0.1
    assert isinstance(load_draft_model(model_dir, "none").lm_head, nn.Linear)
    with pytest.raises(ConfigError, match="draft quant must be one of"):
        load_draft_model(model_dir, "fp8")
