"""The cache root: $FLOWEDGE_HOME when set (with ~ expanded), else ~/.cache/flowedge; and one resolver,
home.py's, so the datasets, the cluster keys and the models never disagree on where it is."""
from __future__ import annotations

import ast
import sys
from pathlib import Path

import pytest

import flowedge
from flowedge import datasets
from flowedge.home import HOME_ENV, flowedge_home
from flowedge.transport import security

PACKAGE = Path(flowedge.__file__).resolve().parent


def test_flowedge_home_from_env(monkeypatch, tmp_path):
    monkeypatch.setenv("FLOWEDGE_HOME", str(tmp_path / "h"))
    assert flowedge_home() == tmp_path / "h"
    monkeypatch.setenv("FLOWEDGE_HOME", "~/fe-home")
    assert flowedge_home() == Path.home() / "fe-home"
    monkeypatch.delenv("FLOWEDGE_HOME")
    assert flowedge_home() == Path.home() / ".cache" / "flowedge"


@pytest.mark.parametrize("env", [None, "", "~/fe-home", "/srv/flowedge"])
def test_datasets_and_keys_live_under_the_one_root(monkeypatch, env):
    if env is None:
        monkeypatch.delenv(HOME_ENV, raising=False)
    else:
        monkeypatch.setenv(HOME_ENV, env)
    assert datasets.datasets_dir() == flowedge_home() / "datasets"
    assert security.default_keys_dir() == flowedge_home() / "keys"


def resolvers_outside_home_py() -> list[str]:
    """`path:line` of each place that reads $FLOWEDGE_HOME or spells the default root itself."""
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        if path == PACKAGE / "home.py":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Constant) and node.value in (HOME_ENV, ".cache", "~/.cache/flowedge"):
                found.append(f"{path.relative_to(PACKAGE)}:{node.lineno}")
    return found


def test_only_home_py_resolves_the_cache_root():
    assert resolvers_outside_home_py() == []


def test_the_resolver_check_can_fail(tmp_path, monkeypatch):
    (tmp_path / "home.py").write_text("")
    (tmp_path / "elsewhere.py").write_text('import os\nroot = os.environ.get("FLOWEDGE_HOME")\n')
    monkeypatch.setattr(sys.modules[__name__], "PACKAGE", tmp_path)
    assert resolvers_outside_home_py() == ["elsewhere.py:2"]
