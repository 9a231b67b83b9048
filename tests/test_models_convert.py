"""convert_gguf streams a GGUF into the checkpoint flowedge loads. The reference is the conversion it
replaced (kept below as `convert_with_transformers`): transformers loads the whole GGUF in float32,
every tensor is cast to 16 bits and packed. Both run on real GGUF files of the tiny models (written as
llama.cpp writes them, models/tiny_gguf.py); the checkpoints must be the same file, byte for byte."""
from __future__ import annotations

import json
import logging
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import transformers
from safetensors.torch import load_file

from flowedge.errors import ModelError
from flowedge.models.convert import CONVERT_FORMAT, convert_gguf
from flowedge.models.gguf_model import read_gguf
from flowedge.models.gguf_tensors import GgufTensor
from flowedge.models.gguf_grid import grid, pack_on_grid
from flowedge.models.packing import Packer, pack_entries, packs
from flowedge.models.quant8 import pack_int8
from flowedge.models.safetensors_io import TensorEntry, file_sha256, write_safetensors
from flowedge.models.tiny import make_tiny_model
from flowedge.models.tiny_gguf import exact_qtypes, write_tiny_gguf

torch.set_num_threads(1)
SHA = "0" * 64
REFERENCED = ("model.embed_tokens.weight", "lm_head.weight")
_VOLATILE = {"transformers_version", "_name_or_path", "_model_name_or_path", "quantization_config"}


def convert_with_transformers(gguf: Path, target: Path, quant: str, skip: tuple[str, ...] = ()) -> dict:
    """The conversion before streaming: the whole model dequantised through transformers (8.8-9.1 GB
    for the real 1.5B), then written as convert_gguf writes it. Returns the loaded float32 state."""
    model = transformers.AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name,
                                                              dtype=torch.float32)
    target.mkdir(parents=True)
    model.config.save_pretrained(target)
    state = model.state_dict()
    tied = model.config.tie_word_embeddings
    entries = [TensorEntry(n, t.dtype, tuple(t.shape), lambda t=t: t.contiguous()) for n, t in state.items()
               if not (tied and n == "lm_head.weight") and n not in skip]
    f16 = torch.finfo(torch.float16).max
    store = {e.name: torch.bfloat16 if state[e.name].abs().max() > f16 else torch.float16 for e in entries}
    entries = pack_entries(entries, 32, lambda e: store[e.name], packers(gguf, state)) if quant == "int4" else \
        [TensorEntry(e.name, store[e.name], e.shape, lambda e=e: e.load().to(store[e.name])) for e in entries]
    write_safetensors(target / "model.safetensors", entries)
    return state


def packers(gguf: Path, state: dict) -> dict[str, Packer]:
    """The layer weights the GGUF keeps at 6-8 bits (W8A16) or on a 4-bit grid (kept), packed from
    transformers' float32 values; the grid itself can only come from the GGUF's blocks."""
    out = {}
    for s in read_gguf(gguf).tensors:
        if not packs(s.name, s.shape, 32):
            continue
        if s.qtype_name in ("Q6_K", "Q8_0"):
            out[s.name] = Packer(8, lambda n=s.name: pack_int8(state[n]))
        elif s.qtype_name in ("Q4_0", "Q4_1", "Q4_K"):
            out[s.name] = Packer(4, lambda n=s.name, s=s: pack_on_grid(state[n], *grid(s)))
    return out


def _config(path: Path) -> dict:
    config = transformers.AutoConfig.from_pretrained(path).to_dict()
    return {k: v for k, v in config.items() if k not in _VOLATILE}


def _tiny_gguf(tmp: Path, arch: str = "qwen2", tie: bool = True, **kwargs) -> tuple[Path, Path]:
    model = make_tiny_model(tmp / f"{arch}-{tie}", num_layers=2, arch=arch, tie=tie)
    return model, write_tiny_gguf(model, tmp / "gguf" / f"{arch}-{tie}.gguf", **kwargs)


@pytest.mark.parametrize("arch,tie,quant,refs", [
    ("qwen2", True, "int4", False), ("qwen2", False, "none", False), ("qwen2", False, "int4", True),
    ("llama", False, "int4", False), ("llama", True, "none", False),
])
def test_the_streamed_checkpoint_is_the_one_transformers_loading_gave(tmp_path, arch, tie, quant, refs):
    _, gguf = _tiny_gguf(tmp_path, arch, tie)
    new = convert_gguf(gguf, tmp_path / "new", source="tiny", sha256=SHA, quant=quant, reference_gguf=refs)
    skip = REFERENCED if refs else ()
    state = convert_with_transformers(gguf, tmp_path / "old", quant, skip)
    a, b = load_file(str(new / "model.safetensors")), load_file(str(tmp_path / "old" / "model.safetensors"))
    assert list(a) == list(b) and a, "same tensors, same order"
    for name in a:
        assert a[name].dtype == b[name].dtype and torch.equal(a[name], b[name]), name
    assert file_sha256(new / "model.safetensors") == file_sha256(tmp_path / "old" / "model.safetensors")
    assert _config(new) == _config(tmp_path / "old") | {"architectures": [type_name(arch)]}
    marker = json.loads((new / "flowedge.json").read_text())
    assert (marker["format"], marker["quant"], marker["sha256"]) == (CONVERT_FORMAT, quant, SHA)
    wide = {n[: -len(".qweight8")] for n in a if n.endswith(".qweight8")}
    assert wide == ({f"model.layers.{i}.self_attn.q_proj" for i in range(2)} if quant == "int4" else set())
    held = marker.get("gguf_tensors", {}).get("tensors", {})
    assert set(held) == (set(REFERENCED) if refs else set())
    for name, record in held.items():   # read from the GGUF at load: what transformers gave, in float16
        assert torch.equal(GgufTensor.from_json(name, gguf, record).load(), state[name].half())
    tok = transformers.AutoTokenizer.from_pretrained(new)
    assert tok.decode(tok("def f(x):").input_ids) == "def f(x):" and tok.eos_token == "<|endoftext|>"


def type_name(arch: str) -> str:
    return {"qwen2": "Qwen2ForCausalLM", "llama": "LlamaForCausalLM"}[arch]


@pytest.mark.parametrize("quant", ["int4", "none"])
def test_a_tensor_beyond_the_float16_range_is_stored_in_bfloat16_as_before(tmp_path, quant):
    model = make_tiny_model(tmp_path / "m", num_layers=1, tie=False)
    big = tmp_path / "big"
    shutil.copytree(model, big)
    state = load_file(str(model / "model.safetensors"))
    state["model.norm.weight"][3] = 7e4
    state["model.layers.0.mlp.up_proj.weight"][5, 9] = -1e5
    write_safetensors(big / "model.safetensors",
                      [TensorEntry(n, t.dtype, tuple(t.shape), lambda t=t: t) for n, t in state.items()])
    gguf = write_tiny_gguf(big, tmp_path / "big.gguf", qtypes=exact_qtypes)
    new = convert_gguf(gguf, tmp_path / "new", source="big", sha256=SHA, quant=quant)
    convert_with_transformers(gguf, tmp_path / "old", quant)
    assert file_sha256(new / "model.safetensors") == file_sha256(tmp_path / "old" / "model.safetensors")
    stored = load_file(str(new / "model.safetensors"))
    assert stored["model.norm.weight"].dtype == torch.bfloat16
    assert stored["model.layers.0.mlp.gate_proj" + (".weight" if quant == "none" else ".scales")].dtype == \
        (torch.float16 if quant == "none" else torch.bfloat16)
    if quant == "none":
        assert stored["model.layers.0.mlp.up_proj.weight"].dtype == torch.bfloat16


def test_llama_q_and_k_rows_are_put_back_in_hugging_face_order(tmp_path):
    model, gguf = _tiny_gguf(tmp_path, "llama", False, qtypes=exact_qtypes)   # F32: values kept exactly
    out = convert_gguf(gguf, tmp_path / "out", source="tiny", sha256=SHA, quant="none")
    stored, original = load_file(str(out / "model.safetensors")), load_file(str(model / "model.safetensors"))
    assert set(stored) == set(original)
    assert all(torch.equal(stored[n], original[n].half()) for n in original)
    q = "model.layers.1.self_attn.q_proj.weight"
    assert not torch.equal(torch.from_numpy(_gguf_rows(gguf, "blk.1.attn_q.weight")).half(), stored[q])


def _gguf_rows(gguf: Path, name: str):
    from gguf import GGUFReader

    return next(t.data for t in GGUFReader(gguf).tensors if t.name == name).copy()


def test_an_unknown_architecture_is_one_clear_error(tmp_path):
    model = make_tiny_model(tmp_path / "m", num_layers=1)
    gguf = write_tiny_gguf(model, tmp_path / "m.gguf", architecture="mamba")
    with pytest.raises(ModelError) as info:
        convert_gguf(gguf, tmp_path / "out", source="m", sha256=SHA)
    assert "'mamba'" in str(info.value) and "llama, qwen2" in str(info.value) and "\n" not in str(info.value)
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("keep", [3, 60, 2000, 0.5, "all but the last data byte"])
def test_a_truncated_gguf_is_a_clear_error(tmp_path, keep):
    from gguf import GGUFReader

    _, gguf = _tiny_gguf(tmp_path)
    data = gguf.read_bytes()
    end = max(t.data_offset + t.n_bytes for t in GGUFReader(gguf).tensors)
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(data[:{0.5: len(data) // 2, "all but the last data byte": end - 1}.get(keep, keep)])
    with pytest.raises(ModelError, match=r"GGUF .*cut short") as info:
        convert_gguf(cut, tmp_path / "models" / "out", source="cut", sha256=SHA)
    assert "\n" not in str(info.value)
    assert not list(tmp_path.glob("models/*")) and not list(tmp_path.glob("models/.*"))


def test_progress_is_reported_per_tensor(tmp_path, caplog):
    _, gguf = _tiny_gguf(tmp_path)
    caplog.set_level(logging.INFO, "flowedge.progress")
    convert_gguf(gguf, tmp_path / "out", source="tiny", sha256=SHA)
    assert any("converting tiny: writing int4" in r.getMessage() and "done" in r.getMessage()
               for r in caplog.records)


def test_no_model_is_built_and_transformers_is_imported_for_the_tokenizer_only(tmp_path, monkeypatch):
    _, gguf = _tiny_gguf(tmp_path)

    def refuse(*args, **kwargs):
        raise AssertionError("the conversion built a transformers model")

    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained", refuse)
    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_config", refuse)
    convert_gguf(gguf, tmp_path / "out", source="tiny", sha256=SHA)
    code = ("import sys; import flowedge.models.convert, flowedge.models.gguf_model, flowedge.models.resolve; "
            "sys.exit('transformers' in sys.modules)")
    assert subprocess.run([sys.executable, "-c", code], check=False).returncode == 0
