"""Building C kernels: one build per source/compiler/CPU, reused after; clear errors without a compiler."""
from __future__ import annotations

import shutil

import pytest

from flowedge.kernels import build

pytestmark = pytest.mark.skipif(shutil.which("gcc") is None, reason="needs gcc")

SOURCE = "int add(int a, int b) { return a + b; }\n"


@pytest.fixture
def source(tmp_path):
    path = tmp_path / "adder.c"
    path.write_text(SOURCE)
    return path


def test_second_build_reuses_the_cached_library(source, tmp_path):
    first = build.build(source, tmp_path / "cache")
    second = build.build(source, tmp_path / "cache")
    assert first.compiled and not second.compiled and first.path == second.path
    assert second.lib.add(2, 3) == 5
    assert [p.name for p in (tmp_path / "cache").iterdir()] == [first.path.name]   # no temporaries left


def test_a_changed_source_builds_anew(source, tmp_path):
    first = build.build(source, tmp_path / "cache")
    source.write_text(SOURCE + "int sub(int a, int b) { return a - b; }\n")
    second = build.build(source, tmp_path / "cache")
    assert second.compiled and second.path != first.path and second.lib.sub(5, 3) == 2


def test_missing_compiler_is_a_build_error(source, tmp_path, monkeypatch):
    monkeypatch.setenv(build.CC_ENV, "/nonexistent/cc")
    with pytest.raises(build.BuildError, match="/nonexistent/cc.*cannot run"):
        build.build(source, tmp_path / "cache")


def test_compile_error_names_the_first_error(source, tmp_path):
    source.write_text("int broken( {\n")
    with pytest.raises(build.BuildError, match=r"failed on adder\.c: .*error"):
        build.build(source, tmp_path / "cache")
    assert not any((tmp_path / "cache").iterdir())


def test_load_returns_none_when_switched_off(source, monkeypatch, tmp_path):
    monkeypatch.setenv(build.KERNELS_ENV, "torch")
    monkeypatch.setenv("FLOWEDGE_HOME", str(tmp_path))
    build.load.cache_clear()
    try:
        assert build.load(source) is None and not (tmp_path / "kernels").exists()
    finally:
        build.load.cache_clear()
