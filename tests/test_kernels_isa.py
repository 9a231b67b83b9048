"""The ISA level the kernels build for: read from the CPU's features, the best one unless FLOWEDGE_ISA
forces a lower one, a clear error for one the CPU cannot run, and one cached build per level."""
from __future__ import annotations

import ctypes
import shutil

import pytest

from flowedge.errors import ConfigError
from flowedge.kernels import build, isa

AVX2_BOX = frozenset({"sse2", "avx", "avx2", "fma", "f16c", "bmi2"})   # an Intel N100's level
ZEN4_BOX = AVX2_BOX | {"avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512_bf16", "avx512_vnni"}


def names(levels) -> list[str]:
    return [level.name for level in levels]


def test_features_come_from_the_first_flags_or_features_line(tmp_path):
    x86 = tmp_path / "x86"
    x86.write_text("processor\t: 0\nflags\t\t: fpu sse2 avx2 fma\n\nprocessor\t: 1\nflags\t\t: fpu\n")
    arm = tmp_path / "arm"
    arm.write_text("processor\t: 0\nFeatures\t: fp asimd asimddp i8mm\nCPU part\t: 0xd0b\n")
    assert isa.cpu_features(x86) == {"fpu", "sse2", "avx2", "fma"}
    assert isa.cpu_features(arm) == {"fp", "asimd", "asimddp", "i8mm"}
    assert isa.cpu_features(tmp_path / "missing") == frozenset()


def test_the_best_level_the_cpu_runs_is_the_default(monkeypatch):
    monkeypatch.delenv(isa.ISA_ENV, raising=False)
    assert names(isa.runnable(ZEN4_BOX, "x86_64")) == ["avx512", "avx2", "portable"]
    assert isa.chosen(ZEN4_BOX, "x86_64") is isa.AVX512
    assert isa.chosen(AVX2_BOX, "AMD64") is isa.AVX2
    assert isa.chosen(frozenset({"sse2", "avx"}), "x86_64") is isa.PORTABLE   # Sandy Bridge: no AVX2
    assert isa.chosen(frozenset({"fp", "asimd"}), "aarch64") is isa.NEON
    assert isa.chosen(frozenset(), "riscv64") is isa.PORTABLE


def test_flowedge_isa_forces_a_lower_level(monkeypatch):
    monkeypatch.setenv(isa.ISA_ENV, " AVX2 ")
    assert isa.chosen(ZEN4_BOX, "x86_64") is isa.AVX2
    monkeypatch.setenv(isa.ISA_ENV, "portable")
    assert isa.chosen(ZEN4_BOX, "x86_64") is isa.PORTABLE
    assert isa.chosen(frozenset({"asimd"}), "aarch64") is isa.PORTABLE


def test_a_level_above_the_cpu_or_unknown_is_refused_saying_why(monkeypatch):
    monkeypatch.setenv(isa.ISA_ENV, "avx512")
    with pytest.raises(ConfigError, match=r"FLOWEDGE_ISA=avx512: this CPU lacks avx512bw, avx512dq, avx512f, "
                                          r"avx512vl; it runs avx2, portable"):
        isa.chosen(AVX2_BOX, "x86_64")
    monkeypatch.setenv(isa.ISA_ENV, "neon")
    with pytest.raises(ConfigError, match=r"FLOWEDGE_ISA='neon': choose one of avx512, avx2, portable"):
        isa.chosen(ZEN4_BOX, "x86_64")


def test_cc_is_split_into_the_program_and_its_flags():
    assert build.split_cc(["gcc", "-mno-avx512f", "-O2"]) == (["gcc"], ["-mno-avx512f", "-O2"])
    assert build.split_cc(["ccache", "gcc"]) == (["ccache", "gcc"], [])


@pytest.mark.skipif(shutil.which("gcc") is None, reason="needs gcc")
def test_each_level_is_its_own_cached_build(tmp_path):
    source = tmp_path / "which.c"
    source.write_text('const char *which(void) {\n#ifdef FLOWEDGE_PORTABLE\nreturn "portable";\n#else\n'
                      'return "simd";\n#endif\n}\n')
    best = isa.runnable()[0]
    built = {level.name: build.build(source, tmp_path / "cache", level) for level in (best, isa.PORTABLE)}
    for lib in built.values():
        lib.lib.which.restype = ctypes.c_char_p
    assert built["portable"].lib.which() == b"portable"
    if best is not isa.PORTABLE:
        assert built[best.name].lib.which() == b"simd" and built[best.name].path != built["portable"].path
        assert built[best.name].path.name.startswith(f"which-{best.name}-")
    assert not build.build(source, tmp_path / "cache", isa.PORTABLE).compiled
