"""The ISA level the native kernels are built for: the best this CPU runs, or a lower one forced with
`FLOWEDGE_ISA` (A/B measurements, or a build that must match another machine's).

Each level is one build with its own compiler flags on top of `-march=native`, and build.py keys the
cached library on it, so forcing a level never reuses another level's build:
  x86-64   avx512 (F, BW, VL, DQ; the kernels use their AVX512-BF16 / VNNI tiles where the CPU has those,
           else their AVX2 ones), avx2 (AVX2, FMA, F16C; AVX-VNNI where the CPU has it), portable;
  aarch64  neon (dotprod / i8mm where the CPU has them), portable;
  others   portable.
"portable" is the plain C loop (`-DFLOWEDGE_PORTABLE`), the reference the others are checked against.
What a build actually compiled is what its library reports (`w4a16.isa()` and the others): flags in `CC`
come after the level's, so `CC="gcc -mno-avx512f"` still builds the AVX2 tiles on an AVX-512 CPU.
"""
from __future__ import annotations

import functools
import os
import platform
from dataclasses import dataclass
from pathlib import Path

from flowedge.errors import ConfigError

ISA_ENV = "FLOWEDGE_ISA"
CPUINFO = Path("/proc/cpuinfo")


@dataclass(frozen=True, slots=True)
class Level:
    """One build of the kernels: what the CPU must have (as /proc/cpuinfo spells it) and the flags."""

    name: str
    needs: frozenset[str]
    flags: tuple[str, ...]


PORTABLE = Level("portable", frozenset(), ("-DFLOWEDGE_PORTABLE",))
AVX2 = Level("avx2", frozenset({"avx2", "fma", "f16c"}), ("-mavx2", "-mfma", "-mf16c", "-mno-avx512f"))
AVX512 = Level("avx512", AVX2.needs | {"avx512f", "avx512bw", "avx512vl", "avx512dq"},
               ("-mavx2", "-mfma", "-mf16c", "-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq"))
NEON = Level("neon", frozenset({"asimd"}), ())
LEVELS = {"x86_64": (AVX512, AVX2, PORTABLE), "aarch64": (NEON, PORTABLE)}   # per machine, best first
MACHINE_ALIASES = {"amd64": "x86_64", "arm64": "aarch64"}


def machine_levels(machine: str | None = None) -> tuple[Level, ...]:
    """The levels there are for this machine (or `machine`), best first."""
    name = (machine or platform.machine()).lower()
    return LEVELS.get(MACHINE_ALIASES.get(name, name), (PORTABLE,))


@functools.lru_cache(maxsize=None)
def cpu_features(cpuinfo: Path = CPUINFO) -> frozenset[str]:
    """The first `flags` (x86) or `Features` (arm) line of /proc/cpuinfo; empty where there is none."""
    try:
        lines = cpuinfo.read_text(errors="replace").splitlines()
    except OSError:
        return frozenset()
    for line in lines:
        key, _, value = line.partition(":")
        if key.strip() in ("flags", "Features"):
            return frozenset(value.split())
    return frozenset()


def runnable(features: frozenset[str] | None = None, machine: str | None = None) -> tuple[Level, ...]:
    """The levels this CPU runs, best first (portable always)."""
    have = cpu_features() if features is None else features
    return tuple(level for level in machine_levels(machine) if level.needs <= have)


def chosen(features: frozenset[str] | None = None, machine: str | None = None) -> Level:
    """`FLOWEDGE_ISA`'s level when set, else the best this CPU runs. ConfigError for a level this machine
    has not, or one above this CPU (its kernels would die on an illegal instruction)."""
    can = runnable(features, machine)
    wanted = os.environ.get(ISA_ENV, "").strip().lower()
    if not wanted:
        return can[0]
    known = {level.name: level for level in machine_levels(machine)}
    if wanted not in known:
        raise ConfigError(f"{ISA_ENV}={wanted!r}: choose one of {', '.join(known)} on this machine")
    if known[wanted] not in can:
        have = cpu_features() if features is None else features
        missing = ", ".join(sorted(known[wanted].needs - have))
        raise ConfigError(f"{ISA_ENV}={wanted}: this CPU lacks {missing}; it runs "
                          f"{', '.join(level.name for level in can)}")
    return known[wanted]
