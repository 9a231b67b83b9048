"""W4A16 at rest: the portable packed layout, W4A16 shards, and loading them without a float copy."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from torch import nn

from flowedge.core.sampling import SamplingParams
from flowedge.engine.drafter import load_draft_model
from flowedge.engine.local import generate_ar, generate_ar_staged
from flowedge.errors import ConfigError, ModelError
from flowedge.models.quant import Int4Linear, pack_int4, unpack_codes
from flowedge.models.shards import Manifest, load_shard
from flowedge.models.split import split_model
from flowedge.models.stage import StageModel, StageParts, is_packed
from flowedge.models.tiny import make_tiny_model

torch.set_num_threads(1)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("tiny") / "m", num_layers=4)


@pytest.fixture(scope="module")
def packed(tiny, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("split") / "s"
    split_model(tiny, 2, out, model_name="tiny", quant="int4")
    return out


def test_packed_layout_round_trips_and_matches_the_kernel():
    gen = torch.Generator().manual_seed(0)
    weight = torch.randn(48, 128, generator=gen) * 0.05
    w = pack_int4(weight, 32)
    assert w.qweight.dtype == torch.uint8 and tuple(w.qweight.shape) == (48, 64)
    assert w.scales.dtype == w.zeros.dtype == torch.bfloat16 and tuple(w.scales.shape) == (48, 4)
    assert w.group_size == 32 and w.in_features == 128
    codes = unpack_codes(w.qweight)
    assert codes.min() >= 0 and codes.max() <= 15
    assert torch.equal(codes[:, 0] | codes[:, 1] << 4, w.qweight[:, 0].to(torch.int32))  # even column low
    assert (w.dequantize() - weight).abs().max() < 0.02   # 4-bit: within a step of the original
    linear = nn.Linear(128, 48)
    with torch.no_grad():
        linear.weight.copy_(weight)
    x = torch.randn(3, 128, generator=gen)
    by_layer = Int4Linear.from_linear(linear, 32)(x)
    by_pack = Int4Linear.from_packed(w, linear.bias.detach())(x)
    assert torch.equal(by_layer, by_pack)
    reference = x @ w.dequantize().T + linear.bias
    assert torch.allclose(by_pack, reference, atol=0.05, rtol=0.05)   # the kernel computes in bf16


def test_int4_split_writes_packed_stage_files_and_a_16_bit_head(tiny, packed):
    manifest = Manifest.load(packed)
    assert manifest.quant == "int4" and manifest.group_size == 32 and manifest.format == 2
    data = json.loads((packed / "manifest.json").read_text())
    assert data["quant"] == "int4" and all(len(s["sha256"]) == 64 for s in data["stages"])
    with safe_open(str(packed / "stage-0.safetensors"), "pt") as f:
        names = set(f.keys())
        assert "model.layers.0.self_attn.q_proj.qweight" in names
        assert not any(n.endswith("proj.weight") for n in names)   # no float Linear weight at rest
        assert f.get_tensor("model.layers.0.mlp.down_proj.qweight").dtype == torch.uint8
    assert "model.embed_tokens.weight" in load_shard(packed, "head")   # a reference to the 16-bit source
    full = split_model(tiny, 2, packed.parent / "fp", quant="none")
    for a, b in zip(manifest.stages, full.stages):
        assert a.bytes < 0.3 * b.bytes   # float32 source: 4 bytes a weight -> 0.625


def test_packed_stage_loads_the_same_numbers_as_quantizing_at_load(tiny, packed):
    stage = StageModel.load(packed, StageParts(2, 4))
    at_load = StageModel.load(tiny, StageParts(2, 4), quant="int4")
    assert not any(type(m) is nn.Linear for m in stage.layers.modules())
    for (name, a), (_, b) in zip(stage.layers.named_buffers(), at_load.layers.named_buffers()):
        assert torch.equal(a, b), name
    assert stage.dtype == torch.float32 and stage.new_cache().nbytes() == 0
    assert is_packed(packed) and not is_packed(tiny)


def test_int4_reference_is_the_same_wherever_the_weights_were_packed(tiny, packed):
    prompt = [5, 17, 99, 3, 42]
    staged = generate_ar_staged(StageModel.load(tiny, quant="int4"), prompt, 20, SamplingParams()).token_ids
    assert generate_ar(packed, prompt, 20, SamplingParams()).token_ids == staged   # W4A16 checkpoint
    assert generate_ar_staged(StageModel.load(packed, quant="auto"), prompt, 20, SamplingParams()).token_ids == staged


def test_a_packed_checkpoint_refuses_other_quantizations(packed):
    for quant in ("none", "nf4"):
        with pytest.raises(ModelError, match="stored W4A16"):
            StageModel.load(packed, StageParts(0, 2), quant=quant)
    with pytest.raises(ConfigError, match="stored W4A16"):
        split_model(packed, 2, packed.parent / "back", quant="none")


def test_resplitting_a_packed_split_keeps_its_codes(packed, tmp_path):
    again = split_model(packed, 4, tmp_path / "s4")
    assert again.quant == "int4" and again.group_size == 32
    name = "model.layers.2.mlp.up_proj.qweight"
    assert torch.equal(load_shard(packed, 1)[name], load_shard(tmp_path / "s4", 2)[name])
    assert (tmp_path / "s4" / "stage-2.safetensors.ref").is_file()   # the codes are read in place


def test_draft_from_packed_layers_holds_no_float_linear(packed):
    draft = load_draft_model(packed, "int4")
    assert not any(type(m) is nn.Linear for m in draft.layers.modules())
    assert draft.embed(torch.tensor([1, 2])).dtype == torch.float32


def test_format_1_manifest_is_read_as_full_precision(tiny, tmp_path):
    out = tmp_path / "old"
    split_model(tiny, 2, out)
    data = json.loads((out / "manifest.json").read_text())
    data["format"] = 1
    del data["quant"], data["group_size"]
    (out / "manifest.json").write_text(json.dumps(data))
    manifest = Manifest.load(out)
    assert manifest.quant == "none" and manifest.format == 1
    data["format"] = 3
    (out / "manifest.json").write_text(json.dumps(data))
    with pytest.raises(ModelError, match="format 3"):
        Manifest.load(out)
