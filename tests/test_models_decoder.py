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

    code = ("import sys; import flowedge.node.stage_node, flowedge.models.stage, flowedge.models.decoder; "
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


@pytest.fixture(scope="module")
def w4a16(tmp_path_factory):
    """A tiny W4A16 checkpoint wide enough for the native kernel's tiles."""
    from flowedge.models.split import split_model

    root = tmp_path_factory.mktemp("w4a16")
    base = make_tiny_model(root / "base", hidden=128, heads=4, kv_heads=2, intermediate=256)
    split_model(base, 1, root / "packed", quant="int4")
    return root / "packed"


def _native_or_skip(model):
    from flowedge.models.quant import Int4Linear

    if not all(m.native for m in model.modules() if isinstance(m, Int4Linear)):
        pytest.skip("the native W4A16 kernel cannot be built here")


def _context(model, n_past: int = 20):
    cache = model.new_cache()
    ids = torch.arange(7, 7 + n_past)
    model.forward_layers(model.embed(ids), torch.arange(n_past), bool_to_float_mask(causal_mask(n_past, 0)), cache)
    return cache


@pytest.mark.parametrize("threads", [1, 2])
def test_w4a16_rows_are_the_same_whatever_rows_share_the_forward(w4a16, threads):
    """The native runtime's exactness rule: a row's logits never depend on how many rows share the forward."""
    torch.set_num_threads(threads)
    try:
        model = StageModel.load(w4a16)
        _native_or_skip(model)
        cache = _context(model)
        tokens = torch.arange(30, 62)
        allowed = torch.ones(32, 20 + 32, dtype=torch.bool)
        allowed[:, 20:] = torch.eye(32, dtype=torch.bool)        # 32 siblings: each sees the past and itself
        hidden = model.embed(tokens)
        positions = torch.full((32,), 20)
        for n in range(1, 33):
            past = cache.length
            mask = bool_to_float_mask(allowed[:n, : past + n])
            rows = model.logits(model.forward_layers(hidden[:n], positions[:n], mask, cache))
            cache.truncate(past)
            for i in {0, n // 2, n - 1}:
                alone_mask = bool_to_float_mask(torch.cat([allowed[i, :past], torch.tensor([True])])[None])
                alone = model.logits(model.forward_layers(hidden[i:i + 1], positions[i:i + 1], alone_mask, cache))
                cache.truncate(past)
                assert torch.equal(rows[i], alone[0]), (n, i)
    finally:
        torch.set_num_threads(1)


def test_w4a16_requests_batched_equal_each_alone(w4a16):
    model = StageModel.load(w4a16)
    _native_or_skip(model)
    caches = [_context(model, 20), _context(model, 9)]
    hidden, sizes = model.embed(torch.arange(40, 52)), [5, 7]
    masks = [bool_to_float_mask(causal_mask(n, c.length)) for n, c in zip(sizes, caches)]
    positions = torch.cat([torch.arange(c.length, c.length + n) for n, c in zip(sizes, caches)])
    alone = [model.forward_layers(h, p, m, _context(model, c.length)) for h, p, m, c in
             zip(hidden.split(sizes), positions.split(sizes), masks, caches)]
    together = model.forward_packed(hidden, positions, masks, caches)
    assert torch.equal(together, torch.cat(alone))


def test_fused_projections_give_the_same_bits(w4a16, monkeypatch):
    from flowedge.models import decoder

    fused = StageModel.load(w4a16)
    _native_or_skip(fused)
    assert fused.layers[0].self_attn.qkv is not None and fused.layers[0].mlp.gate_up is not None
    monkeypatch.setattr(decoder.DecoderLayer, "fuse", lambda self: None)
    plain = StageModel.load(w4a16)
    ids = torch.arange(3, 30)
    mask = bool_to_float_mask(causal_mask(27, 0))
    outs = [m.logits(m.forward_layers(m.embed(ids), torch.arange(27), mask, m.new_cache())) for m in (fused, plain)]
    assert torch.equal(*outs)


@pytest.mark.parametrize("threads", [1, 2])
def test_fused_attention_gives_the_same_bits(w4a16, monkeypatch, threads):
    """RoPE + cache write + attention as one native call (the default) against the separate steps
    (FLOWEDGE_FUSED_ATTENTION=0): the same logits for a prefill, one-row decode steps and a tree level."""
    from flowedge.kernels import attention

    models = {}
    for value in ("1", "0"):
        monkeypatch.setenv(attention.FUSED_ENV, value)
        models[value] = StageModel.load(w4a16)
    _native_or_skip(models["1"])
    assert models["1"].layers[0].self_attn.fused_attention and not models["0"].layers[0].self_attn.fused_attention
    calls = []
    monkeypatch.setattr("flowedge.models.decoder.rope_attend",
                        lambda *a: calls.append(1) or attention.rope_attend(*a))
    torch.set_num_threads(threads)
    try:
        outs = {}
        for value, model in models.items():
            cache, got = _context(model), []
            for token in range(40, 46):   # one row a step
                past = cache.length
                got.append(model.logits(model.forward_layers(model.embed(torch.tensor([token])), torch.tensor([past]),
                                                             bool_to_float_mask(causal_mask(1, past)), cache)))
            allowed = torch.cat([torch.ones(4, cache.length, dtype=torch.bool), torch.eye(4, dtype=torch.bool)], 1)
            got.append(model.logits(model.forward_layers(model.embed(torch.arange(50, 54)),
                                                         torch.full((4,), cache.length), bool_to_float_mask(allowed),
                                                         cache)))
            outs[value] = torch.cat(got)
    finally:
        torch.set_num_threads(1)
    assert calls, "the fused call never ran"
    assert torch.equal(outs["1"], outs["0"])


def test_w4a16_lm_head_is_8_bit_where_the_kernel_runs_else_4_bit(w4a16):
    from flowedge.kernels import w8a16
    from flowedge.models.quant import Int4Linear
    from flowedge.models.quant8 import Int8Linear
    from flowedge.models.stage import VocabSlice

    for wide in (True, False):
        model = StageModel.load(w4a16, wide_lm_head=wide)
        head = model.lm_head.inner if isinstance(model.lm_head, VocabSlice) else model.lm_head
        kind = Int8Linear if wide and w8a16.available() else Int4Linear
        assert isinstance(head, kind) and head.out_features % 16 == 0
        assert model.logits(torch.zeros(2, model.config.hidden_size)).shape == (2, model.config.vocab_size)


def _with_w4_weights(model):
    """transformers' float32 model computing with the very weights W4A16 stores (4-bit layers, the 8-bit
    lm_head where its kernel runs; dequantised): an oracle for the quantized path that shares none of
    its code (kernel, layout, decoder)."""
    from flowedge.kernels import w8a16
    from flowedge.models.quant import pack_int4
    from flowedge.models.quant8 import pack_int8

    with torch.no_grad():
        for name, m in model.named_modules():
            if isinstance(m, torch.nn.Linear):
                pad = torch.zeros((-m.weight.shape[0]) % 16, m.weight.shape[1])   # whole kernel tiles
                pack = pack_int8 if name == "lm_head" and w8a16.available() else lambda w: pack_int4(w, 32)
                w = pack(torch.cat([m.weight, pad])).dequantize()[: m.weight.shape[0]]
                m.weight = torch.nn.Parameter(w)                                    # unties the lm_head
    return model


def test_w4a16_agrees_with_transformers_on_the_same_4_bit_weights(tiny_pair):
    """An independent check on the tiny pair: teacher-forced top-1 agreement of the W4A16 model with
    transformers' float32 model on the same 4-bit weights (only the bf16 rounding of activations differs:
    96.7% measured; a wrong kernel or layout lands near 1/V). Against the unquantized float32 tiny model the
    agreement is 42%: random weights drawn at std 0.3 are far from int4-friendly, so that figure is reported
    for the real pair only (tools/w4a16_agreement.py)."""
    from transformers import AutoModelForCausalLM

    from flowedge.bench.agreement import stage_logits, top1_agreement, transformers_logits

    base = tiny_pair[0]
    oracle = _with_w4_weights(AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32).eval())
    w4 = StageModel.load(base, quant="int4")
    gen = torch.Generator().manual_seed(3)
    sequences = [torch.randint(0, 258, (64,), generator=gen).tolist() for _ in range(8)]
    result = top1_agreement(transformers_logits(oracle), stage_logits(w4), sequences)
    assert result.positions == 8 * 64
    assert result.rate >= 0.95, result.rate
