"""Tiny test models: deterministic, cached, byte tokenizer round trip, draft agrees with base."""
from __future__ import annotations

import pytest
import torch
import transformers
from safetensors.torch import load_file

from flowedge.errors import ConfigError
from flowedge.models.tiny import make_tiny_model, make_tiny_pair

torch.set_num_threads(1)


def test_same_seed_same_weights_other_seed_differs(tmp_path):
    a = load_file(str(make_tiny_model(tmp_path / "a", seed=3) / "model.safetensors"))
    b = load_file(str(make_tiny_model(tmp_path / "b", seed=3) / "model.safetensors"))
    c = load_file(str(make_tiny_model(tmp_path / "c", seed=4) / "model.safetensors"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert not torch.equal(a["model.layers.0.mlp.up_proj.weight"], c["model.layers.0.mlp.up_proj.weight"])
    assert "lm_head.weight" not in a  # tied


def test_cached_and_rebuilt_on_parameter_change(tmp_path):
    out = make_tiny_model(tmp_path / "m")
    stamp = (out / "model.safetensors").stat().st_mtime_ns
    assert make_tiny_model(tmp_path / "m") == out
    assert (out / "model.safetensors").stat().st_mtime_ns == stamp
    make_tiny_model(tmp_path / "m", num_layers=3)
    assert transformers.AutoConfig.from_pretrained(out).num_hidden_layers == 3


def test_tokenizer_round_trips_text(tmp_path):
    tok = transformers.AutoTokenizer.from_pretrained(make_tiny_model(tmp_path / "m"))
    text = "def f(x):\n\treturn x + 1  # ok ~ {}[]"
    ids = tok(text)["input_ids"]
    assert ids == list(text.encode())  # one token per byte, id = byte value
    assert tok.decode(ids) == text
    assert (tok.eos_token_id, tok.bos_token_id) == (256, 257)
    assert tok("a<|endoftext|>")["input_ids"] == [97, 256]
    assert "user: hi" in tok.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False)


def test_untied_llama_variant_loads(tmp_path):
    out = make_tiny_model(tmp_path / "m", arch="llama", tie=False, num_layers=2, vocab=272)
    model = transformers.AutoModelForCausalLM.from_pretrained(out)
    assert type(model).__name__ == "LlamaForCausalLM" and model.config.vocab_size == 272
    assert not torch.equal(model.lm_head.weight, model.model.embed_tokens.weight)


def test_bad_parameters(tmp_path):
    with pytest.raises(ConfigError):
        make_tiny_model(tmp_path / "m", vocab=200)
    with pytest.raises(ConfigError):
        make_tiny_model(tmp_path / "m", arch="gpt9")
    with pytest.raises(ConfigError):
        make_tiny_pair(tmp_path / "p", base_layers=2, draft_layers=3)


def test_pair_agrees_often_but_not_always(tmp_path):
    base_dir, draft_dir = make_tiny_pair(tmp_path / "p")
    base = transformers.AutoModelForCausalLM.from_pretrained(base_dir)
    draft = transformers.AutoModelForCausalLM.from_pretrained(draft_dir)
    assert (base.config.num_hidden_layers, draft.config.num_hidden_layers) == (4, 2)
    ids = torch.randint(0, 256, (4, 32), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        agree = (base(ids).logits.argmax(-1) == draft(ids).logits.argmax(-1)).float().mean().item()
        # greedy output is varied, not one repeated token
        generated = base.generate(ids[:1, :4], max_new_tokens=16, do_sample=False)[0, 4:]
    assert 0.6 < agree < 0.98
    assert len(set(generated.tolist())) > 4
    assert make_tiny_pair(tmp_path / "p") == (base_dir, draft_dir)
