"""resolve_model: registry names, HF directories and .gguf files to one cached HF directory."""
from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest
import torch
import transformers
from safetensors import safe_open

from flowedge.errors import ModelError
from flowedge.models import registry, resolve
from flowedge.models.convert import convert_gguf
from flowedge.models.resolve import resolve_model
from flowedge.models.tiny import make_tiny_model
from flowedge.models.tiny_gguf import exact_qtypes, write_tiny_gguf

torch.set_num_threads(1)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("tiny") / "m", num_layers=2)


@pytest.fixture(scope="module")
def tiny_gguf(tiny, tmp_path_factory) -> Path:
    """The tiny model as a real GGUF, every tensor F32: converted, it holds the tiny model's values."""
    return write_tiny_gguf(tiny, tmp_path_factory.mktemp("gguf") / "tiny.gguf", qtypes=exact_qtypes)


@pytest.fixture
def conversions(monkeypatch) -> list[Path]:
    """The GGUFs resolve_model converted, in order."""
    done = []

    def convert(gguf, *args, **kwargs):
        done.append(gguf)
        return convert_gguf(gguf, *args, **kwargs)

    monkeypatch.setattr(resolve, "convert_gguf", convert)
    return done


def _copy(gguf: Path, to: Path) -> Path:
    shutil.copy(gguf, to)
    return to


def logits(model_dir: Path) -> torch.Tensor:
    model = transformers.Qwen2ForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    with torch.no_grad():
        return model(torch.tensor([[72, 101, 108, 108, 111]])).logits


def test_hf_directory_is_returned_as_is(tiny, tmp_path):
    assert resolve_model(str(tiny), home=tmp_path) == tiny
    assert not (tmp_path / "models").exists()


@pytest.mark.parametrize("spec", ["no-such-model", "/nonexistent/x.gguf", "README.md"])
def test_unresolvable_spec_explains_what_is_accepted(tmp_path, spec):
    with pytest.raises(ModelError) as info:
        resolve_model(spec, home=tmp_path)
    message = str(info.value)
    assert "\n" not in message and "qwen2.5-coder-1.5b" in message
    assert "Hugging Face directory" in message and ".gguf" in message


def test_directory_without_config_is_rejected(tmp_path):
    with pytest.raises(ModelError):
        resolve_model(str(tmp_path), home=tmp_path)


def test_gguf_file_is_converted_once(conversions, tiny, tiny_gguf, tmp_path):
    gguf = _copy(tiny_gguf, tmp_path / "some.gguf")
    home = tmp_path / "home"
    out = resolve_model(str(gguf), home=home, quant="none")
    assert out.parent == home / "models" and out.name.startswith("gguf-") and out.name.endswith("-f16")
    config = json.loads((out / "config.json").read_text())
    assert "quantization_config" not in config and config["architectures"] == ["Qwen2ForCausalLM"]
    with safe_open(str(out / "model.safetensors"), "pt") as f:
        assert "lm_head.weight" not in f.keys()  # tied: stored once
        assert f.get_tensor("model.embed_tokens.weight").dtype == torch.float16   # never float32 at rest
    marker = json.loads((out / "flowedge.json").read_text())
    assert marker["source"] == str(gguf.resolve()) and marker["dtype"] == "float16"
    assert marker["format"] == resolve.CONVERT_FORMAT and marker["quant"] == "none"
    assert marker["sha256"] == resolve.file_sha256(gguf)
    from safetensors.torch import load_file

    stored, original = load_file(str(out / "model.safetensors")), load_file(str(tiny / "model.safetensors"))
    assert all(torch.equal(stored[k], original[k].half()) for k in stored)   # the float16 rounding, no more
    assert torch.equal(logits(out).argmax(-1), logits(tiny).argmax(-1))
    assert (out / "tokenizer.json").is_file()
    assert resolve_model(str(gguf), home=home, quant="none") == out and len(conversions) == 1
    os.utime(gguf, ns=(0, 10**9))  # touched, not changed: the entry is keyed by content
    assert resolve_model(str(gguf), home=home, quant="none") == out and len(conversions) == 1
    with open(gguf, "ab") as f:    # other bytes under the same path: a new entry, converted anew
        f.write(b"\0" * 32)
    assert resolve_model(str(gguf), home=home, quant="none") != out and len(conversions) == 2


def test_gguf_is_stored_w4a16_by_default(tiny_gguf, tmp_path):
    from flowedge.models.stage import StageModel, StageParts

    gguf = _copy(tiny_gguf, tmp_path / "some.gguf")
    home = tmp_path / "home"
    packed = resolve_model(str(gguf), home=home)
    assert packed.name.startswith("gguf-") and not packed.name.endswith("-f16")
    marker = json.loads((packed / "flowedge.json").read_text())
    assert marker["quant"] == "int4" and marker["group_size"] == 32 and marker["dtype"] == "float16"
    with safe_open(str(packed / "model.safetensors"), "pt") as f:
        names = set(f.keys())
        assert "model.layers.0.mlp.up_proj.qweight" in names and "model.layers.0.mlp.up_proj.weight" not in names
        assert all(f.get_tensor(n).dtype in (torch.float16, torch.bfloat16, torch.uint8) for n in names)
    # Packing from the 16-bit values: the W4A16 checkpoint holds what quantizing the f16 one at load gives.
    f16 = resolve_model(str(gguf), home=home, quant="none")
    a = StageModel.load(packed, StageParts(0, 2))
    b = StageModel.load(f16, StageParts(0, 2), quant="int4")
    assert all(torch.equal(x, y) for x, y in zip(a.layers.buffers(), b.layers.buffers()))


def test_a_float32_conversion_from_an_older_flowedge_is_converted_again(conversions, tiny_gguf, tmp_path):
    gguf = _copy(tiny_gguf, tmp_path / "some.gguf")
    home = tmp_path / "home"
    out = resolve_model(str(gguf), home=home)
    marker = json.loads((out / "flowedge.json").read_text())
    (out / "flowedge.json").write_text(json.dumps({k: marker[k] for k in ("source", "sha256")} | {"dtype": "float32"}))
    assert resolve_model(str(gguf), home=home) == out and len(conversions) == 2
    assert json.loads((out / "flowedge.json").read_text())["format"] == resolve.CONVERT_FORMAT


def test_registry_name_pulls_and_converts(monkeypatch, conversions, tiny_gguf, tmp_path):
    gguf = _copy(tiny_gguf, tmp_path / "pulled.gguf")
    pulls = []
    monkeypatch.setattr(registry, "pull", lambda name, home: pulls.append(name) or gguf)
    home = tmp_path / "home"
    out = resolve_model("qwen2.5-coder-0.5b", home=home)
    assert out == home / "models" / "qwen2.5-coder-0.5b"   # W4A16; the 16-bit one is "<name>-f16"
    marker = json.loads((out / "flowedge.json").read_text())
    assert marker["sha256"] == registry.MODELS["qwen2.5-coder-0.5b"].sha256
    assert resolve_model("qwen2.5-coder-0.5b", home=home) == out
    assert pulls == ["qwen2.5-coder-0.5b"] and len(conversions) == 1


def test_failed_conversion_leaves_no_cache_entry(tmp_path):
    gguf = tmp_path / "broken.gguf"
    gguf.write_bytes(b"BAD")
    home = tmp_path / "home"
    with pytest.raises(ModelError, match="cannot read GGUF"):
        resolve_model(str(gguf), home=home)
    assert not list(home.glob("models/*")) and not list(home.glob("models/.*"))


@pytest.mark.real_model
@pytest.mark.skipif(not os.environ.get("FLOWEDGE_REAL_MODEL"), reason="set FLOWEDGE_REAL_MODEL=1")
def test_real_draft_model_resolves_and_generates():
    from transformers import AutoModelForCausalLM, AutoTokenizer

    out = resolve_model("qwen2.5-coder-0.5b", quant="none")
    model = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
    tok = AutoTokenizer.from_pretrained(out)
    ids = tok("def fibonacci(n):", return_tensors="pt").input_ids
    with torch.no_grad():
        text = tok.decode(model.generate(ids, max_new_tokens=8, do_sample=False)[0])
    assert text.startswith("def fibonacci(n):") and len(text) > len("def fibonacci(n):")


@pytest.mark.parametrize("damage", ["truncate", "overwrite"])
def test_a_damaged_converted_checkpoint_is_converted_again(conversions, tiny_gguf, tmp_path, damage):
    """Before: a truncated or overwritten model.safetensors in the cache passed the marker check and failed
    at every start until someone deleted the cache by hand."""
    gguf = _copy(tiny_gguf, tmp_path / "some.gguf")
    home = tmp_path / "home"
    out = resolve_model(str(gguf), home=home, quant="int4")
    ckpt = out / "model.safetensors"
    good = ckpt.read_bytes()
    os.utime(ckpt, ns=(0, 5 * 10**9))                         # touched, unchanged: kept, no conversion
    assert resolve_model(str(gguf), home=home, quant="int4") == out and len(conversions) == 1
    if damage == "truncate":
        ckpt.write_bytes(good[: len(good) // 2])
    else:
        ckpt.write_bytes(good[:-64] + bytes(64))
    assert resolve_model(str(gguf), home=home, quant="int4") == out and len(conversions) == 2
    assert ckpt.read_bytes() == good                          # the same bytes as the first conversion
