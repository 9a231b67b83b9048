"""Content keys (models/content_hash.py): a model directory is known by what its files hold, not by its name;
a start asks again without hashing again; a file changed under the same name (same size) is hashed anew."""
from __future__ import annotations

import logging
import os
import shutil

import pytest

from flowedge.models import content_hash
from flowedge.models.content_hash import HashMemo, memo_at, model_sha256


@pytest.fixture
def hashed(monkeypatch) -> list[str]:
    """The names of the files actually read to hash them."""
    names: list[str] = []
    real = content_hash.sha256_of

    def counting(path):
        names.append(path.name)
        return real(path)

    monkeypatch.setattr(content_hash, "sha256_of", counting)
    return names


def _model(path, weights: bytes):
    path.mkdir(parents=True)
    (path / "config.json").write_text('{"num_hidden_layers": 1}')
    (path / "model.safetensors").write_bytes(weights)
    (path / "README.md").write_text("not part of the model")
    (path / ".model.safetensors.tmp").write_bytes(b"a half-written file")
    return path


def test_the_key_is_the_content_not_the_directory_name(tmp_path):
    memo = memo_at(tmp_path / "home")
    a = _model(tmp_path / "a" / "base", b"\x01" * 64)
    b = _model(tmp_path / "b" / "base", b"\x02" * 64)
    same = _model(tmp_path / "elsewhere", b"\x01" * 64)
    assert model_sha256(a, memo) != model_sha256(b, memo)
    assert model_sha256(a, memo) == model_sha256(same, memo)
    (a / "README.md").write_text("edited")   # not a file of the model
    assert model_sha256(a, memo) == model_sha256(same, memo)
    (a / "config.json").write_text('{"num_hidden_layers": 2}')   # a file of the model
    assert model_sha256(a, memo) != model_sha256(same, memo)


def test_a_start_does_not_hash_again_and_a_changed_file_is_hashed_anew(tmp_path, hashed):
    home = tmp_path / "home"
    model = _model(tmp_path / "m", b"\x01" * 64)
    first = model_sha256(model, memo_at(home))
    assert sorted(hashed) == ["config.json", "model.safetensors"]
    hashed.clear()
    assert model_sha256(model, memo_at(home)) == first and hashed == []   # a later start: from the memo
    st = (model / "model.safetensors").stat()
    (model / "model.safetensors").write_bytes(b"\x03" * 64)            # same size, same mtime put back
    os.utime(model / "model.safetensors", ns=(st.st_atime_ns, st.st_mtime_ns))
    assert model_sha256(model, memo_at(home)) != first and hashed == ["model.safetensors"]


def test_a_model_written_again_under_the_same_path_gets_a_new_key(tmp_path, hashed):
    home = tmp_path / "home"
    model = _model(tmp_path / "base", b"\x01" * 64)
    first = model_sha256(model, memo_at(home))
    shutil.rmtree(model)
    _model(model, b"\x02" * 64)
    assert model_sha256(model, memo_at(home)) != first


def test_a_damaged_memo_is_ignored_with_a_warning_and_rewritten(tmp_path, caplog):
    home = tmp_path / "home"
    home.mkdir()
    (home / content_hash.MEMO_FILE).write_text("{not json")
    model = _model(tmp_path / "m", b"\x01" * 64)
    with caplog.at_level(logging.WARNING, logger="flowedge.models.content_hash"):
        key = model_sha256(model, memo_at(home))
    assert "ignoring the hash memo" in caplog.text
    assert HashMemo(home / content_hash.MEMO_FILE).files   # written afresh
    assert model_sha256(model, memo_at(home)) == key
