"""CLI commands of the models package, run through click's test runner."""
from __future__ import annotations

import json

import pytest
from click.testing import CliRunner

from flowedge.errors import ConfigError, ModelError
from flowedge.models.model_commands import models, parse_layers, split
from flowedge.models.tiny import make_tiny_model


def test_models_list(monkeypatch, tmp_path):
    monkeypatch.setenv("FLOWEDGE_HOME", str(tmp_path))
    result = CliRunner().invoke(models, ["list"])
    assert result.exit_code == 0
    lines = result.output.splitlines()
    assert lines[0].split()[:4] == ["NAME", "ROLE", "SIZE", "CACHED"]
    assert any(line.startswith("qwen2.5-coder-1.5b") and "base" in line and "1117.3 MB" in line
               for line in lines)
    assert str(tmp_path) in lines[-1]


def test_models_pull_unknown_propagates_model_error(monkeypatch, tmp_path):
    monkeypatch.setenv("FLOWEDGE_HOME", str(tmp_path))
    result = CliRunner().invoke(models, ["pull", "nope"])
    assert isinstance(result.exception, ModelError)


def test_split_command(tmp_path):
    tiny = make_tiny_model(tmp_path / "m", num_layers=4)
    out = tmp_path / "shards"
    result = CliRunner().invoke(split, [str(tiny), "--stages", "2", "--out", str(out), "--layers", "1,3"])
    assert result.exit_code == 0, result.output
    assert "stage 1  layers [ 1,  4)" in result.output
    manifest = json.loads((out / "manifest.json").read_text())
    assert [s["layers"] for s in manifest["stages"]] == [[0, 1], [1, 4]]
    assert manifest["quant"] == "int4" and "quant=int4" in result.output   # W4A16 by default


def test_parse_layers():
    assert parse_layers("7,7,7,7") == [7, 7, 7, 7]
    assert parse_layers(None) is None
    with pytest.raises(ConfigError):
        parse_layers("7,x")
