"""tools/llamacpp_build.py: a finished build is found and reused without asking PyPI; an unfinished one is not."""
from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tools"))

import llamacpp_build  # noqa: E402


def _fake_build(home: Path, version: str, isa: str, stamp: bool) -> Path:
    bin_dir = home / "peers" / f"llama.cpp-{version}-{isa}" / "src" / "build" / "bin"
    bin_dir.mkdir(parents=True)
    for target in llamacpp_build.TARGETS:
        (bin_dir / target).write_text("")
    if stamp:
        (bin_dir / llamacpp_build.STAMP).write_text("cmake ...\n")
    return bin_dir


def test_a_finished_build_is_reused_and_an_unfinished_one_is_not(tmp_path, monkeypatch):
    monkeypatch.setenv("FLOWEDGE_HOME", str(tmp_path))
    assert llamacpp_build.find_build("native") is None
    _fake_build(tmp_path, "2", "native", stamp=False)          # interrupted: no stamp
    assert llamacpp_build.find_build("native") is None
    _fake_build(tmp_path, "9.0.0", "native", stamp=True)
    done = _fake_build(tmp_path, "10.0.0", "native", stamp=True)   # newer, though "1" < "9" as text
    assert llamacpp_build.find_build("native") == done and llamacpp_build.find_build("avx2") is None
    monkeypatch.setattr(llamacpp_build, "download_sdist", lambda *a: (_ for _ in ()).throw(AssertionError("PyPI")))
    assert llamacpp_build.ensure_build("native", jobs=2, version=None) == done
    assert llamacpp_build.ensure_build("native", jobs=2, version="10.0.0") == done


def test_the_isa_flag_sets_differ_only_in_what_they_should():
    assert "-DGGML_NATIVE=ON" in llamacpp_build.ISA_FLAGS["native"]
    assert {"-DGGML_NATIVE=OFF", "-DGGML_AVX2=ON", "-DGGML_AVX512=OFF"} <= set(llamacpp_build.ISA_FLAGS["avx2"])
    assert "-DGGML_RPC=ON" in llamacpp_build.COMMON_FLAGS and "-DLLAMA_CURL=OFF" in llamacpp_build.COMMON_FLAGS
