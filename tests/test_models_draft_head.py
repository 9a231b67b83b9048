"""Draft heads: the module, its W8A16 file with a checked sha256, `--draft` specs, the base's lm_head rows."""
from __future__ import annotations

import pytest
import torch

from flowedge.errors import ModelError
from flowedge.models.config import ModelConfig
from flowedge.models.draft_head import DraftHead, DraftHeadConfig, attach_lm_head, lm_head_rows
from flowedge.models.draft_head_io import (is_head_spec, load_head, read_config, resolve_head, save_head,
                                           sidecar, trained_path)
from flowedge.models.quant8 import Int8Linear
from flowedge.models.stage import StageModel, bool_to_float_mask, causal_mask

BASE = ModelConfig("qwen2", 64, 128, 4, 4, 2, 260, 16, attention_bias=True, name="tiny")


def _head(seed: int = 0) -> DraftHead:
    torch.manual_seed(seed)
    head = DraftHead(DraftHeadConfig.for_base(BASE, 96, 200)).eval()
    head.vocab_ids.copy_(torch.arange(60, 260))
    return head


def _run(head: DraftHead, n: int = 7) -> torch.Tensor:
    torch.manual_seed(1)
    emb, feats = torch.randn(n, 64) * 0.1, torch.randn(n, 64)
    return head.forward_cached(emb, feats, torch.arange(n), bool_to_float_mask(causal_mask(n, 0)), head.new_cache())


def test_a_head_file_is_w8a16_and_loads_to_the_same_outputs(tmp_path):
    head = _head()
    path = tmp_path / "h.safetensors"
    sha = save_head(head, path)
    assert sidecar(path).read_text().strip() == sha
    loaded = load_head(path)
    assert all(isinstance(m, Int8Linear) for m in loaded.linears().values())
    assert loaded.vocab_ids.tolist() == list(range(60, 260))
    assert read_config(path) == head.config
    ref, got = _run(head), _run(loaded)
    assert torch.allclose(ref, got, atol=0.05 * float(ref.abs().max())), "int8 weights drift too far"
    # int8 codes + a float scale per 32 inputs: about 9 bits a weight
    weights = sum(m.weight.numel() for m in head.linears().values())
    assert path.stat().st_size < 1.25 * weights + 20_000


def test_a_corrupt_or_unchecked_head_file_is_refused(tmp_path):
    path = tmp_path / "h.safetensors"
    save_head(_head(), path)
    raw = bytearray(path.read_bytes())
    raw[-5] ^= 0xFF
    path.write_bytes(bytes(raw))
    with pytest.raises(ModelError, match="corrupt"):
        load_head(path)
    sidecar(path).unlink()
    with pytest.raises(ModelError, match="sha256"):
        load_head(path)


def test_head_specs_resolve_by_name_or_path(tmp_path, monkeypatch):
    monkeypatch.setenv("FLOWEDGE_HOME", str(tmp_path))
    assert is_head_spec("head:mine") and is_head_spec("/x/h.safetensors")
    assert not is_head_spec("qwen2.5-coder-0.5b") and not is_head_spec(None)
    with pytest.raises(ModelError, match="no draft head named"):
        resolve_head("head:mine")
    path = trained_path("mine")
    save_head(_head(), path)
    assert resolve_head("head:mine") == path
    assert resolve_head(str(path)) == path
    with pytest.raises(ModelError, match="no draft head file"):
        resolve_head(str(tmp_path / "missing.safetensors"))


def test_a_head_checks_the_base_it_drafts_for():
    cfg = DraftHeadConfig.for_base(BASE, 96, 10_000)
    assert cfg.draft_vocab == BASE.vocab_size   # never more than the base's vocabulary
    cfg.check_base(BASE)
    with pytest.raises(ModelError, match="trained for tiny"):
        cfg.check_base(ModelConfig("qwen2", 128, 128, 4, 4, 2, 260, 32))


def test_lm_head_rows_are_the_base_models_own(tiny_pair):
    base_dir = tiny_pair[0]
    model = StageModel.load(base_dir)
    ids = torch.tensor([3, 70, 259])
    rows = lm_head_rows(base_dir, ids)
    assert torch.equal(rows.float(), model.lm_head.weight[ids].float())
    head = _head()
    attach_lm_head(head, lm_head_rows(base_dir, head.vocab_ids), quantize=False)
    h = torch.randn(2, 64)
    assert torch.allclose(head.logits(h), model.lm_head(h)[:, head.vocab_ids], atol=1e-5)
    with pytest.raises(ModelError, match="do not fit"):
        attach_lm_head(head, rows)


def test_a_head_neither_trained_nor_shipped_is_named_with_how_to_train_one(tmp_path, monkeypatch):
    monkeypatch.setenv("FLOWEDGE_HOME", str(tmp_path))
    with pytest.raises(ModelError, match="no draft head named 'qwen2.5-coder-1.5b'.*flowedge draft-head train"):
        resolve_head("head:qwen2.5-coder-1.5b")

