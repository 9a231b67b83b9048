"""Referenced shard files: a split stores no second copy of its checkpoint, yet every stage still
fetches, checksums and loads exactly the bytes a copied split holds."""
from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from flowedge.core.sampling import SamplingParams
from flowedge.engine.local import generate_ar_staged
from flowedge.errors import ChecksumError, ModelError
from flowedge.models.shard_refs import REF_SUFFIX, RefFile, resolve_file, tensor_locations
from flowedge.models.shards import is_referenced, load_shard
from flowedge.models.split import split_model
from flowedge.models.stage import StageModel, StageParts
from flowedge.models.tiny import make_tiny_model
from flowedge.node import shard_fetch
from flowedge.node.partition_plan import ensure_split
from flowedge.transport import protocol as proto

PROMPTS = [[5, 17, 3, 99, 42, 7], [1, 2, 3, 4], [200, 100, 50, 25, 12], [77] * 6]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("tiny") / "m", num_layers=5, tie=False)


@pytest.fixture(scope="module")
def packed(tiny, tmp_path_factory) -> Path:
    """A W4A16 checkpoint (packing writes real stage files; its head is already a reference)."""
    out = tmp_path_factory.mktemp("w4a16") / "packed"
    split_model(tiny, 1, out, quant="int4")
    return out


def _bytes(split: Path, name: str) -> bytes:
    stored = resolve_file(split, name)
    return stored.read_bytes() if isinstance(stored, Path) else b"".join(stored.blocks())


@pytest.mark.parametrize("source", ["tiny", "packed"])
def test_referenced_split_is_byte_identical_to_a_copied_one(request, tmp_path, source):
    model = request.getfixturevalue(source)
    refs = split_model(model, 3, tmp_path / "refs", layers=[1, 3, 1])
    copies = split_model(model, 3, tmp_path / "copies", layers=[1, 3, 1], copy=True)
    assert refs == copies   # same files, sizes and sha256 in the manifest
    assert not list((tmp_path / "refs").glob("*.safetensors")), "a referenced split copies no tensors"
    assert is_referenced(tmp_path / "refs") and not is_referenced(tmp_path / "copies")
    for spec in (refs.head, *refs.stages):
        want = (tmp_path / "copies" / spec.file).read_bytes()
        assert _bytes(tmp_path / "refs", spec.file) == want
        ref = resolve_file(tmp_path / "refs", spec.file)
        assert isinstance(ref, RefFile) and ref.sha256() == spec.sha256
        for offset, length in [(0, 7), (5, 300), (len(ref.prefix) - 3, 50), (len(want) - 9, 100), (1, len(want))]:
            assert ref.read(offset, length) == want[offset:offset + length], (spec.file, offset, length)
    for which in ("head", 0, 1, 2):
        got, want = load_shard(tmp_path / "refs", which), load_shard(tmp_path / "copies", which)
        assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in want)


@pytest.mark.parametrize("source", ["tiny", "packed"])
def test_stages_loaded_from_references_answer_token_for_token(request, tmp_path, source):
    model = request.getfixturevalue(source)
    split_model(model, 2, tmp_path / "refs", layers=[2, 3])
    split_model(model, 2, tmp_path / "copies", layers=[2, 3], copy=True)
    runs = []
    for where in (tmp_path / "refs", tmp_path / "copies", model):
        whole = StageModel.load(where)   # embed + every layer + lm_head
        runs.append([generate_ar_staged(whole, p, 12, SamplingParams()).token_ids for p in PROMPTS])
    assert runs[0] == runs[1] == runs[2] and sum(map(len, runs[0])) > 12


def test_head_serves_a_referenced_shard_that_fetches_and_verifies(packed, tmp_path):
    split = tmp_path / "split"
    manifest = split_model(packed, 2, split)
    served = shard_fetch.stage_files(split, 2)
    assert served.ref is not None and not served.path.exists()
    assign = proto.Assign(stage_index=2, layer_start=manifest.stages[1].start, layer_end=5,
                          shard_sha256=served.sha256, shard_bytes=served.size, side_files=served.side_files,
                          model="tiny", next_addr="", quant="int4", source_dir=str(split))
    queue: list[proto.ShardChunk] = []
    got = shard_fetch.fetch(assign, tmp_path / "home", lambda req: queue.append(shard_fetch.read_chunk(served, req)),
                            lambda timeout_s: queue.pop(0) if queue else None)
    assert (got / manifest.stages[1].file).read_bytes() == _bytes(split, manifest.stages[1].file)


def test_a_changed_checkpoint_is_caught_and_resplit(tiny, tmp_path):
    model = tmp_path / "model"
    shutil.copytree(tiny, model)
    split = tmp_path / "split"
    ensure_split(model, [2, 3], split, "tiny", quant="none")
    assert is_referenced(split)
    ckpt = model / "model.safetensors"
    data = bytearray(ckpt.read_bytes())
    offset = tensor_locations(ckpt)["model.layers.4.mlp.down_proj.weight"][2]
    data[offset + 3] ^= 0x01   # a flipped bit in a layer-4 weight (stage 1's)
    ckpt.write_bytes(bytes(data))
    os.utime(ckpt, ns=(1, 1))   # a new mtime (a conversion writes a new file: new inode and mtime)
    with pytest.raises(ChecksumError, match="stage-1.safetensors is corrupt"):
        load_shard(split, 1)
    with pytest.raises(ChecksumError):
        StageModel.load(split, StageParts(2, 5))
    assert not is_referenced(split)   # the next start splits again rather than fail every stage's check
    # A checkpoint written again with another layout: the references no longer resolve, and the next
    # start splits afresh instead of reading the wrong bytes.
    ckpt.write_bytes(b"")
    save_file(load_file(str(tiny / "model.safetensors")), str(ckpt), metadata={"note": "x" * 100})
    with pytest.raises(ModelError, match="split again"):
        load_shard(split, 1)
    assert not is_referenced(split)
    ensure_split(model, [2, 3], split, "tiny", quant="none")
    assert is_referenced(split)
    ckpt.unlink()
    with pytest.raises(ModelError, match="missing"):
        load_shard(split, 0)


def test_an_older_copied_split_is_replaced_by_references(tiny, tmp_path):
    shards = tmp_path / "shards"   # the head's $FLOWEDGE_HOME/shards: splits named <model>-<counts>[-int4]
    split = shards / f"{tiny.name}-2-3"
    split_model(tiny, 2, split, layers=[2, 3], copy=True)
    before = sum(p.stat().st_size for p in split.iterdir())
    split_model(tiny, 2, shards / f"{tiny.name}-1-4", layers=[1, 4], copy=True)    # an older flowedge's copy
    split_model(tiny, 2, shards / f"{tiny.name}-4-1", layers=[4, 1])                # references: kept
    split_model(tiny, 2, shards / "other-2-3", layers=[2, 3], copy=True)           # not this model's: kept
    ensure_split(tiny, [2, 3], split, "tiny", quant="none")
    after = sum(p.stat().st_size for p in split.iterdir() if p.suffix != ".json" or p.name == "manifest.json")
    assert is_referenced(split) and after < before / 4
    assert (split / ("head.safetensors" + REF_SUFFIX)).is_file()
    assert sorted(p.name for p in shards.iterdir()) == sorted([split.name, f"{tiny.name}-4-1", "other-2-3"])
