"""A registry model's W4A16 checkpoint stores no 16-bit embedding / lm_head: they are dequantised from
the GGUF the cache keeps, and every loader (stage, head file, its stream to a remote stage, an old cache
converted again) gets the very tensors and bytes the float16 copies held. Uses a real GGUF of a tiny model
(models/tiny_gguf.py: the embedding as Q8_0 blocks, the lm_head as Q4_0, the rest mixed)."""
from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import shutil
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from flowedge.core.sampling import SamplingParams
from flowedge.engine.local import generate_ar_staged
from flowedge.errors import ModelError
from flowedge.models import registry, resolve
from flowedge.models.gguf_tensors import GgufEmbedding, GgufTensor, read_tensor
from flowedge.models.resolve import convert_gguf, resolve_model
from flowedge.models.shard_refs import RefFile, resolve_file
from flowedge.models.shards import is_referenced, load_shard, shard_tensor_files
from flowedge.models.split import split_model
from flowedge.models.stage import StageModel
from flowedge.models.tiny import make_tiny_model
from flowedge.models.tiny_gguf import write_tiny_gguf
from flowedge.node import shard_fetch
from flowedge.transport import protocol as proto

NAME = "qwen2.5-coder-0.5b"
REFERENCED = ("model.embed_tokens.weight", "lm_head.weight")
PROMPTS = [[5, 17, 3, 99, 42, 7], [200, 100, 50, 25, 12]]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("tiny") / "m", num_layers=3, tie=False)


@pytest.fixture(scope="module")
def gguf_file(tiny, tmp_path_factory) -> Path:
    """The tiny model as a real GGUF; its embedding (Q8_0) and lm_head (Q4_0) are quantized blocks."""
    return write_tiny_gguf(tiny, tmp_path_factory.mktemp("gguf") / f"{NAME}.gguf")


@pytest.fixture
def home(monkeypatch, gguf_file, tmp_path) -> Path:
    """A cache whose registry entry NAME is `gguf_file`."""
    pulled = tmp_path / "home" / "gguf" / f"{NAME}.gguf"
    pulled.parent.mkdir(parents=True)
    shutil.copy(gguf_file, pulled)
    sha = hashlib.sha256(pulled.read_bytes()).hexdigest()
    monkeypatch.setitem(registry.MODELS, NAME, dataclasses.replace(registry.MODELS[NAME], sha256=sha))

    def pull(name, home):
        if not pulled.is_file() or hashlib.sha256(pulled.read_bytes()).hexdigest() != sha:
            shutil.copy(gguf_file, pulled)   # what registry.pull does: fetch it again
        return pulled

    monkeypatch.setattr(registry, "pull", pull)
    return tmp_path / "home"


def _copies(home: Path, tmp_path: Path) -> Path:
    """The same conversion with 16-bit copies (what format 2 stored, and a user's own GGUF still gets)."""
    gguf = home / "gguf" / f"{NAME}.gguf"
    return convert_gguf(gguf, tmp_path / "copies", source=str(gguf), sha256=registry.MODELS[NAME].sha256)


def _names(path: Path) -> set[str]:
    with safe_open(str(path / "model.safetensors"), "pt") as f:
        return set(f.keys())


def test_checkpoint_reads_embedding_and_lm_head_from_the_gguf_bit_identically(home, tmp_path):
    out = resolve_model(NAME, home=home)
    copies = _copies(home, tmp_path)
    assert not set(REFERENCED) & _names(out) and set(REFERENCED) <= _names(copies)
    assert (out / "model.safetensors").stat().st_size < (copies / "model.safetensors").stat().st_size
    index = shard_tensor_files(out)
    for name in REFERENCED:
        assert isinstance(index[name], GgufTensor)
        assert torch.equal(read_tensor(index[name], name), read_tensor(copies / "model.safetensors", name))
    a, b = StageModel.load(out), StageModel.load(copies)
    assert isinstance(a.embed_tokens, GgufEmbedding)   # rows dequantised on lookup, no 16-bit matrix held
    ids = torch.tensor([[3, 259, 0], [7, 7, 128]])
    assert torch.equal(a.embed_tokens(ids), b.embed_tokens(ids)) and a.embed_tokens(ids).shape == (2, 3, 64)
    every = torch.arange(a.config.vocab_size)
    hidden = torch.randn(3, a.config.hidden_size, generator=torch.Generator().manual_seed(0))
    assert torch.equal(a.embed(every), b.embed(every)) and torch.equal(a.logits(hidden), b.logits(hidden))
    with pytest.raises(IndexError):
        a.embed(torch.tensor([a.config.vocab_size]))
    runs = [[generate_ar_staged(m, p, 10, SamplingParams()).token_ids for p in PROMPTS] for m in (a, b)]
    assert runs[0] == runs[1]


def test_head_file_streamed_from_the_gguf_is_the_copied_one_byte_for_byte(home, tmp_path):
    out = resolve_model(NAME, home=home)
    refs = split_model(out, 2, tmp_path / "refs")
    copies = split_model(_copies(home, tmp_path), 2, tmp_path / "copied", copy=True)
    assert refs.head == copies.head   # same bytes, so the same sha256 in the manifest as before
    assert is_referenced(tmp_path / "refs")   # a daemon reuses this split
    want = (tmp_path / "copied" / copies.head.file).read_bytes()
    ref = resolve_file(tmp_path / "refs", refs.head.file)
    assert isinstance(ref, RefFile) and any(isinstance(s.source, GgufTensor) for s in ref.segments)
    assert b"".join(ref.blocks()) == want
    for offset, length in [(0, 9), (len(ref.prefix) - 5, 777), (len(want) // 2 - 3, 4097), (len(want) - 11, 99)]:
        assert ref.read(offset, length) == want[offset:offset + length], (offset, length)
    # A last stage on another host fetches the head file over the wire: an ordinary file, same bytes.
    served = shard_fetch.head_file(tmp_path / "refs")
    stage_dir = tmp_path / "remote"
    stage_dir.mkdir()
    shutil.copy(tmp_path / "refs" / "manifest.json", stage_dir)
    assign = proto.Assign(stage_index=2, layer_start=refs.stages[1].start, layer_end=refs.num_layers,
                          shard_sha256=refs.stages[1].sha256, shard_bytes=refs.stages[1].bytes, side_files={},
                          model=NAME, next_addr="", quant="int4", source_dir="", head_sha256=refs.head.sha256,
                          head_bytes=refs.head.bytes)
    queue: list[proto.ShardChunk] = []
    shard_fetch.fetch_head_file(assign, stage_dir, lambda req: queue.append(shard_fetch.read_chunk(served, req)),
                                lambda timeout_s: queue.pop(0) if queue else None)
    assert (stage_dir / refs.head.file).read_bytes() == want
    head = load_shard(tmp_path / "refs", "head")
    assert all(torch.equal(head[n], read_tensor(tmp_path / "copied" / "head.safetensors", n)) for n in head)


def test_an_older_w4a16_cache_is_converted_again(home, tmp_path, monkeypatch):
    """Format 2 and 3 stored every layer Linear 4-bit; format 4 keeps the GGUF's 6-8 bit ones W8A16."""
    target = home / "models" / NAME
    gguf = home / "gguf" / f"{NAME}.gguf"
    for old in (2, 3):
        resolve_model(NAME, home=home)
        marker = json.loads((target / "flowedge.json").read_text())
        (target / "flowedge.json").write_text(json.dumps(marker | {"format": old}))
        conversions = []
        real = resolve.convert_gguf
        monkeypatch.setattr(resolve, "convert_gguf", lambda *a, **k: conversions.append(a) or real(*a, **k))
        assert resolve_model(NAME, home=home) == target and len(conversions) == 1
        assert json.loads((target / "flowedge.json").read_text())["format"] == resolve.CONVERT_FORMAT
        assert any(n.endswith(".qweight8") for n in _names(target))   # the tiny GGUF's Q8_0 attn_q
        monkeypatch.setattr(resolve, "convert_gguf", real)
    assert gguf.is_file()

def test_a_missing_or_altered_gguf_is_a_clear_error_and_resolving_fetches_it_again(home, tmp_path):
    out = resolve_model(NAME, home=home)
    gguf = home / "gguf" / f"{NAME}.gguf"
    gguf.rename(tmp_path / "away.gguf")
    with pytest.raises(ModelError, match=f"missing: run `flowedge models pull {NAME}`"):
        StageModel.load(out)
    data = bytearray((tmp_path / "away.gguf").read_bytes())
    at = GgufTensor.from_json("e", gguf, json.loads((out / "flowedge.json").read_text())["gguf_tensors"]
                              ["tensors"]["model.embed_tokens.weight"]).offset
    data[at + 40] ^= 0xFF
    gguf.write_bytes(bytes(data))
    os.utime(gguf, ns=(1, 10**9))
    with pytest.raises(ModelError, match="was altered .*flowedge models pull"):
        StageModel.load(out)
    assert resolve_model(NAME, home=home) == out   # fetched again (the fake pull), then usable
    StageModel.load(out)


def test_a_gguf_file_the_user_gives_keeps_its_copies(home, gguf_file):
    out = resolve_model(str(gguf_file), home=home)   # the cache does not own that file: no reference into it
    assert set(REFERENCED) <= _names(out) and "gguf_tensors" not in json.loads((out / "flowedge.json").read_text())


def test_a_cast_load_equals_casting_the_16_bit_tensor(home):
    tensor = shard_tensor_files(resolve_model(NAME, home=home))["lm_head.weight"]
    assert torch.equal(read_tensor(tensor, "lm_head.weight", torch.float32), tensor.load().float())
