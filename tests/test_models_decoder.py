"""flowedge's own decoder against transformers' eager model (the oracle), and its config reader."""
from __future__ import annotations

import json

import pytest
import torch

from flowedge.errors import ModelError
from flowedge.models.config import ModelConfig
from flowedge.models.stage import StageModel, StageParts, bool_to_float_mask, causal_mask
from flowedge.models.tiny import make_tiny_model


@pytest.fixture(scope="module", params=["qwen2", "llama"])
def tiny(request, tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp(request.param), arch=request.param, tie=request.param == "qwen2")


def _oracle_logits(model_dir, ids):
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        return hf(input_ids=ids[None]).logits[0]


def _close(got, want):
    scale = want.abs().max()
    assert (got - want).abs().max() <= 1e-5 * scale, float((got - want).abs().max() / scale)


def test_prefill_matches_transformers(tiny):
    ids = torch.randint(0, 258, (24,), generator=torch.Generator().manual_seed(1))
    model = StageModel.load(tiny)
    cache = model.new_cache()
    h = model.forward_layers(model.embed(ids), torch.arange(24), bool_to_float_mask(causal_mask(24, 0)), cache)
    _close(model.logits(h), _oracle_logits(tiny, ids))


def test_token_by_token_decoding_matches_transformers(tiny):
    ids = torch.randint(0, 258, (10,), generator=torch.Generator().manual_seed(2))
    model = StageModel.load(tiny)
    cache, rows = model.new_cache(capacity=4), []      # capacity 4: the cache grows on the way
    for i in range(10):
        h = model.forward_layers(model.embed(ids[i:i + 1]), torch.arange(i, i + 1),
                                 bool_to_float_mask(causal_mask(1, i)), cache)
        rows.append(model.logits(h))
    _close(torch.cat(rows), _oracle_logits(tiny, ids))


def test_stages_chained_equal_the_whole_model(tiny):
    ids = torch.arange(5, 17)
    mask = bool_to_float_mask(causal_mask(12, 0))
    whole = StageModel.load(tiny)
    want = whole.logits(whole.forward_layers(whole.embed(ids), torch.arange(12), mask, whole.new_cache()))
    first = StageModel.load(tiny, StageParts(0, 2, embed=True))
    last = StageModel.load(tiny, StageParts(2, 4, head=True))
    h = first.forward_layers(first.embed(ids), torch.arange(12), mask, first.new_cache())
    got = last.logits(last.forward_layers(h, torch.arange(12), mask, last.new_cache()))
    assert torch.equal(got, want)


def test_stage_processes_need_no_transformers():
    import subprocess
    import sys

    code = ("import sys; import flowedge.daemon.stage_node, flowedge.models.stage, flowedge.models.decoder; "
            "sys.exit(1 if 'transformers' in sys.modules else 0)")
    assert subprocess.run([sys.executable, "-c", code]).returncode == 0


def test_config_reads_both_families(tiny):
    config = ModelConfig.load(tiny)
    raw = json.loads((tiny / "config.json").read_text())
    assert config.hidden_size == raw["hidden_size"] and config.num_hidden_layers == raw["num_hidden_layers"]
    assert config.group == raw["num_attention_heads"] // raw["num_key_value_heads"]
    assert config.attention_bias == (raw["model_type"] == "qwen2")


@pytest.mark.parametrize("change, words", [
    ({"model_type": "gpt2"}, "not supported"),
    ({"rope_scaling": {"rope_type": "yarn", "factor": 4.0}}, "rope scaling"),
    ({"num_key_value_heads": 3}, "do not group"),
    ({"hidden_size": "wide"}, "bad value"),
])
def test_config_refuses_what_the_decoder_cannot_run(tiny, tmp_path, change, words):
    raw = json.loads((tiny / "config.json").read_text()) | change
    (tmp_path / "config.json").write_text(json.dumps(raw))
    with pytest.raises(ModelError, match=words):
        ModelConfig.load(tmp_path)


def test_config_names_a_missing_field(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "qwen2"}))
    with pytest.raises(ModelError, match="lacks"):
        ModelConfig.load(tmp_path)
