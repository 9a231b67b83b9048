"""Building C kernels: one build per source (and the headers it includes)/compiler/CPU, reused after; clear
errors without a compiler."""
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


def test_extra_compiler_flags_are_another_build(source, tmp_path, monkeypatch):
    plain = build.build(source, tmp_path / "cache")
    monkeypatch.setenv(build.CC_ENV, "gcc -O0 -DFLOWEDGE_TEST=1")
    flagged = build.build(source, tmp_path / "cache")
    assert flagged.compiled and flagged.path != plain.path and flagged.lib.add(2, 3) == 5


def test_a_changed_header_rebuilds_every_source_that_includes_it(tmp_path):
    """Directly or through another header; a source that does not include it keeps its build."""
    (tmp_path / "shared.h").write_text("static int two(void) { return 2; }\n")
    (tmp_path / "wrap.h").write_text('#include "shared.h"\n')
    sources = {"a.c": '#include <stdint.h>\n#include "wrap.h"\nint a(void) { return two(); }\n',
               "b.c": ' # include "shared.h"\nint b(void) { return two() + 1; }\n', "c.c": SOURCE}
    for name, text in sources.items():
        (tmp_path / name).write_text(text)
    paths = [tmp_path / name for name in sources]
    assert [p.name for p in build.inputs(paths[0])] == ["a.c", "wrap.h", "shared.h"]
    first = [build.build(p, tmp_path / "cache") for p in paths]
    assert first[0].lib.a() == 2 and first[1].lib.b() == 3
    (tmp_path / "shared.h").write_text("static int two(void) { return 20; }\n")
    second = [build.build(p, tmp_path / "cache") for p in paths]
    assert [b.compiled for b in second] == [True, True, False] and second[2].path == first[2].path
    assert second[0].lib.a() == 20 and second[1].lib.b() == 21


def test_a_missing_header_is_left_to_the_compiler(tmp_path):
    source = tmp_path / "lost.c"
    source.write_text('#include "nowhere.h"\nint f(void) { return 1; }\n')
    assert build.inputs(source) == [source]
    with pytest.raises(build.BuildError, match=r"failed on lost\.c: .*nowhere\.h"):
        build.build(source, tmp_path / "cache")


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
