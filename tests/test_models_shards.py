"""Stage shard format: split a tiny model, check coverage, names, checksums and bad input."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from flowedge.errors import ChecksumError, ConfigError, ModelError
from flowedge.models.shard_refs import resolve_file
from flowedge.models.shards import Manifest, load_shard
from flowedge.models.split import balanced_layers, split_model
from flowedge.models.tiny import make_tiny_model

torch.set_num_threads(1)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("tiny") / "m", num_layers=5)


@pytest.fixture(scope="module")
def untied(tmp_path_factory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("tiny") / "u", num_layers=3, tie=False)


def test_balanced_layers_sizes_differ_by_at_most_one_earlier_first():
    assert balanced_layers(28, 4) == [7, 7, 7, 7]
    assert balanced_layers(5, 3) == [2, 2, 1]
    assert balanced_layers(24, 5) == [5, 5, 5, 5, 4]
    for layers in range(1, 30):
        for stages in range(1, layers + 1):
            counts = balanced_layers(layers, stages)
            assert sum(counts) == layers and max(counts) - min(counts) <= 1
            assert counts == sorted(counts, reverse=True)
    with pytest.raises(ConfigError):
        balanced_layers(3, 4)
    with pytest.raises(ConfigError):
        balanced_layers(3, 0)


@pytest.mark.parametrize("stages", [1, 2, 3, 4])
def test_union_of_shards_is_the_original_state_dict(tiny, tmp_path, stages):
    manifest = split_model(tiny, stages, tmp_path / "s", model_name="tiny")
    original = load_file(str(tiny / "model.safetensors"))
    union: dict[str, torch.Tensor] = {}
    head = load_shard(tmp_path / "s", "head")
    assert set(head) == {"model.embed_tokens.weight", "model.norm.weight"}
    union.update(head)
    for spec in manifest.stages:
        part = load_shard(tmp_path / "s", spec.index)
        layers = {int(name.split(".")[2]) for name in part}
        assert layers == set(range(spec.start, spec.end))
        assert not set(part) & set(union)
        union.update(part)
    assert set(union) == set(original)
    assert all(torch.equal(union[k], original[k]) for k in original)
    assert [s.end - s.start for s in manifest.stages] == balanced_layers(5, stages)


def test_manifest_json_layout_and_side_files(tiny, tmp_path):
    out = tmp_path / "s"
    manifest = split_model(tiny, 2, out, layers=[1, 4], model_name="tiny")
    data = json.loads((out / "manifest.json").read_text())
    assert data["format"] == 2 and data["quant"] == "none" and data["model"] == "tiny" and data["num_layers"] == 5
    assert data["hidden_size"] == 64 and data["dtype"] == "float32" and data["tied"] is True
    assert data["head"]["file"] == "head.safetensors"
    assert [s["layers"] for s in data["stages"]] == [[0, 1], [1, 5]]
    assert [s["file"] for s in data["stages"]] == ["stage-0.safetensors", "stage-1.safetensors"]
    assert data["stages"][1]["bytes"] == resolve_file(out, "stage-1.safetensors").size   # a reference
    assert Manifest.load(out) == manifest
    for name in ("config.json", "tokenizer.json", "tokenizer_config.json"):
        assert (out / name).is_file()
    assert not list(tmp_path.glob(".s.*")), "temporary directory left behind"


def test_untied_head_carries_lm_head(untied, tmp_path):
    manifest = split_model(untied, 3, tmp_path / "s")
    assert manifest.tied is False
    head = load_shard(tmp_path / "s", "head")
    assert "lm_head.weight" in head and head["lm_head.weight"].shape == (260, 64)


def test_flipped_byte_is_caught(tiny, tmp_path):
    out = tmp_path / "s"
    split_model(tiny, 3, out, copy=True)
    path = out / "stage-2.safetensors"
    data = bytearray(path.read_bytes())
    data[-5] ^= 0x01
    path.write_bytes(bytes(data))
    with pytest.raises(ChecksumError, match=r"shard stage-2\.safetensors is corrupt: sha256 [0-9a-f]{64} != manifest"):
        load_shard(out, 2)
    assert load_shard(out, 2, verify=False)  # still readable when the caller opts out
    load_shard(out, 1)  # other stages unaffected


@pytest.mark.parametrize("layers", [[2, 2], [1, 1, 1, 1], [5, 0, 0], [3, 3, -1]])
def test_bad_layers_rejected(tiny, tmp_path, layers):
    with pytest.raises(ConfigError, match="--layers"):
        split_model(tiny, 3, tmp_path / "s", layers=layers)
    assert not (tmp_path / "s").exists()


def test_bad_inputs(tiny, tmp_path):
    with pytest.raises(ConfigError):
        split_model(tiny, 6, tmp_path / "s")
    with pytest.raises(ModelError, match="no config.json"):
        split_model(tmp_path, 1, tmp_path / "s")
    with pytest.raises(ModelError, match="not a shard directory"):
        Manifest.load(tmp_path)
    junk = tmp_path / "junk"
    junk.mkdir()
    (junk / "notes.txt").write_text("mine")
    with pytest.raises(ConfigError, match="refusing to overwrite"):
        split_model(tiny, 2, junk)
    assert (junk / "notes.txt").read_text() == "mine"


def test_resplit_replaces_previous_split(tiny, tmp_path):
    out = tmp_path / "s"
    split_model(tiny, 4, out)
    manifest = split_model(tiny, 2, out)
    assert len(manifest.stages) == 2
    assert not (out / "stage-3.safetensors").exists() and not (out / "stage-3.safetensors.ref").exists()
    with pytest.raises(ConfigError):
        load_shard(out, 2)


def test_invalid_manifest_rejected(tiny, tmp_path):
    out = tmp_path / "s"
    split_model(tiny, 2, out)
    data = json.loads((out / "manifest.json").read_text())
    data["stages"][1]["layers"] = [2, 5]
    (out / "manifest.json").write_text(json.dumps(data))
    with pytest.raises(ModelError, match="bad layers"):
        Manifest.load(out)
    (out / "manifest.json").write_text("{not json")
    with pytest.raises(ModelError, match="invalid"):
        Manifest.load(out)
