"""The cache root: $FLOWEDGE_HOME when set (with ~ expanded), else ~/.cache/flowedge."""
from __future__ import annotations

from pathlib import Path

from flowedge.home import flowedge_home


def test_flowedge_home_from_env(monkeypatch, tmp_path):
    monkeypatch.setenv("FLOWEDGE_HOME", str(tmp_path / "h"))
    assert flowedge_home() == tmp_path / "h"
    monkeypatch.setenv("FLOWEDGE_HOME", "~/fe-home")
    assert flowedge_home() == Path.home() / "fe-home"
    monkeypatch.delenv("FLOWEDGE_HOME")
    assert flowedge_home() == Path.home() / ".cache" / "flowedge"
