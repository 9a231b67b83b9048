"""Compile a kernel's C source once per machine and ISA level, and load it with ctypes.

The shared object goes to `$FLOWEDGE_HOME/kernels/<name>-<level>-<key>.so`, the key hashing the source
and the headers it includes with quotes (transitively: the tiled kernels share tiles.h), the compiler's
version, the flags it expands `-march=native` to and the level's flags (isa.py: the best level this CPU
runs, or `FLOWEDGE_ISA`): a new source or header, compiler, CPU or level builds anew, anything else
reuses the file. Flags in `CC` come last, so they override the level's (`CC="gcc -mno-avx512f"`). The
compiler writes to a private temporary name that is renamed into place, so processes building at once
never load a half-written file.

No compiler, a failed build or `FLOWEDGE_KERNELS=torch` -> `load()` returns None and says why once
(callers fall back to torch's kernels). A `FLOWEDGE_ISA` this CPU cannot run is a ConfigError instead:
the user asked for something else than what would run.
"""
from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import re
import shlex
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path

from flowedge.errors import BuildError
from flowedge.home import flowedge_home
from flowedge.kernels import isa

log = logging.getLogger(__name__)

KERNELS_ENV = "FLOWEDGE_KERNELS"   # "torch": never use the native kernels (A/B measurements)
CC_ENV = "CC"
FLAGS = ("-O3", "-march=native", "-shared", "-fPIC", "-fopenmp", "-ffp-contract=off", "-std=gnu11")
BUILD_TIMEOUT_S = 120
LOCAL_INCLUDE = re.compile(rb'^[ \t]*#[ \t]*include[ \t]*"([^"]+)"', re.MULTILINE)


@dataclass(frozen=True, slots=True)
class Built:
    """A loaded kernel library and where it came from."""

    lib: ctypes.CDLL
    path: Path
    compiled: bool   # False when an earlier build was reused


def disabled() -> bool:
    return os.environ.get(KERNELS_ENV, "").strip().lower() == "torch"


def compiler() -> list[str]:
    return shlex.split(os.environ.get(CC_ENV) or "gcc")


def split_cc(cc: list[str]) -> tuple[list[str], list[str]]:
    """`CC` as (the program, with any wrapper such as ccache; the flags from the first `-` on)."""
    at = next((i for i, arg in enumerate(cc) if arg.startswith("-")), len(cc))
    return cc[:at], cc[at:]


def _run(cmd: list[str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(cmd, capture_output=True, text=True, timeout=BUILD_TIMEOUT_S, check=False)


def _native_flags(cc: list[str]) -> str:
    """What -march=native means on this CPU (gcc prints the expanded options); '' if unknown."""
    try:
        out = _run([*cc, "-march=native", "-Q", "--help=target"]).stdout
    except (OSError, subprocess.TimeoutExpired):
        return ""
    return "\n".join(line.strip() for line in out.splitlines() if line.strip().startswith(("-march=", "-m")))


def inputs(source: Path) -> list[Path]:
    """`source` and the headers it includes with quotes, transitively, each found next to the file that
    includes it (as the compiler looks first); a missing one is left for the compiler to report."""
    found, pending = [source], [source]
    while pending:
        path = pending.pop()
        for name in LOCAL_INCLUDE.findall(path.read_bytes()):
            header = path.parent / name.decode()
            if header.is_file() and header not in found:
                found.append(header)
                pending.append(header)
    return found


def cache_key(source: Path, cc: list[str], level: isa.Level) -> str:
    try:
        version = _run([*cc, "--version"]).stdout
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise BuildError(f"compiler {shlex.join(cc)!r} cannot run ({exc})") from exc
    digest = hashlib.sha256()
    source_code, *headers = inputs(source)   # a source with no headers keys as it did before headers counted
    code = [source_code.read_bytes(), *(part for path in headers for part in (path.name.encode(), path.read_bytes()))]
    flags = (shlex.join(cc[1:]), _native_flags(cc), " ".join(FLAGS),   # CC="gcc -O0" is another build
             level.name, " ".join(level.flags))
    for part in (*code, version.encode(), *(f.encode() for f in flags)):
        digest.update(part)
        digest.update(b"\0")
    return digest.hexdigest()[:16]


def build(source: Path, cache_dir: Path | None = None, level: isa.Level | None = None) -> Built:
    """Compile `source` for `level` (default: isa.chosen()), or reuse its cached build, and load it.
    Raises BuildError (ConfigError for a FLOWEDGE_ISA this CPU cannot run)."""
    cc = compiler()
    level = level or isa.chosen()
    cache_dir = cache_dir or flowedge_home() / "kernels"
    target = cache_dir / f"{source.stem}-{level.name}-{cache_key(source, cc, level)}.so"
    compiled = False
    if not target.exists():
        cache_dir.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=f".{source.stem}-", suffix=".so", dir=cache_dir)
        os.close(fd)
        try:
            program, cc_flags = split_cc(cc)
            result = _run([*program, *FLAGS, *level.flags, *cc_flags, "-o", tmp, str(source)])
            if result.returncode != 0:
                raise BuildError(f"{shlex.join(cc)} failed on {source.name}: {_first_error(result.stderr)}")
            os.replace(tmp, target)
            compiled = True
        except (OSError, subprocess.TimeoutExpired) as exc:
            raise BuildError(f"compiler {shlex.join(cc)!r} cannot run ({exc})") from exc
        finally:
            if os.path.exists(tmp):
                os.unlink(tmp)
    try:
        return Built(ctypes.CDLL(str(target)), target, compiled)
    except OSError as exc:
        raise BuildError(f"cannot load {target}: {exc}") from exc


def _first_error(stderr: str) -> str:
    lines = [line for line in stderr.splitlines() if "error" in line] or stderr.splitlines() or ["no output"]
    return lines[0][:300]


@functools.lru_cache(maxsize=None)
def load(source: Path) -> Built | None:
    """The built library, or None (logged once) when disabled or it cannot be built here."""
    if disabled():
        log.info("native kernels off (%s=torch): using torch's kernels", KERNELS_ENV)
        return None
    try:
        built = build(source)
    except BuildError as exc:
        log.warning("native %s kernel unavailable, using torch's kernels: %s", source.stem, exc)
        return None
    if built.compiled:
        log.info("built native kernel %s", built.path)
    return built
