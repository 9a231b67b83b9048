"""Turn a model spec (registry name, HF directory, .gguf file) into a Hugging Face directory.

GGUF files are dequantised once into config.json + tokenizer + one model.safetensors under
<home>/models/, because loading GGUF through transformers takes a minute and reloading the
converted directory takes about a second.
"""
from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import time
from pathlib import Path

import torch

from flowedge.errors import ModelError
from flowedge.models import registry
from flowedge.models.shards import TensorEntry, file_sha256, write_safetensors

log = logging.getLogger(__name__)

CONVERTED_MARKER = "flowedge.json"


def resolve_model(spec: str, *, home: Path | None = None, dtype: torch.dtype = torch.float32) -> Path:
    """Return an HF-format directory for `spec`, pulling and converting as needed (cached)."""
    home = Path(home) if home is not None else registry.flowedge_home()
    if spec in registry.MODELS:
        return _resolve_registry(spec, home, dtype)
    path = Path(spec).expanduser()
    if path.is_dir() and (path / "config.json").is_file():
        return path
    if path.is_file() and path.suffix.lower() == ".gguf":
        return _resolve_gguf_file(path.resolve(), home, dtype)
    raise ModelError(
        f"cannot resolve model {spec!r}: not a known name ({', '.join(sorted(registry.MODELS))}), "
        "a Hugging Face directory with config.json, or a .gguf file"
    )


def _resolve_registry(name: str, home: Path, dtype: torch.dtype) -> Path:
    entry = registry.get_entry(name)
    target = home / "models" / name
    if _converted(target, entry.sha256, dtype):
        return target
    gguf = registry.pull(name, home=home)
    convert_gguf(gguf, target, source=name, sha256=entry.sha256, dtype=dtype)
    return target


def _resolve_gguf_file(path: Path, home: Path, dtype: torch.dtype) -> Path:
    stat = path.stat()
    key = hashlib.sha256(f"{path}\0{stat.st_size}\0{stat.st_mtime_ns}".encode()).hexdigest()[:16]
    target = home / "models" / f"gguf-{key}"
    if _converted(target, None, dtype):
        return target
    log.info("hashing %s", path)
    convert_gguf(path, target, source=str(path), sha256=file_sha256(path), dtype=dtype)
    return target


def _converted(target: Path, sha256: str | None, dtype: torch.dtype) -> bool:
    try:
        marker = json.loads((target / CONVERTED_MARKER).read_text())
    except (FileNotFoundError, ValueError):
        return False
    if sha256 is not None and marker.get("sha256") != sha256:
        return False
    return marker.get("dtype") == _dtype_name(dtype) and (target / "model.safetensors").is_file()


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def convert_gguf(
    gguf: Path, target: Path, *, source: str, sha256: str, dtype: torch.dtype = torch.float32
) -> Path:
    """Dequantise a GGUF into an HF directory; written to a temp dir and renamed at the end."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = target.parent / f".{target.name}.tmp-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    try:
        start_s = time.monotonic()
        log.info("loading GGUF %s (%.1f MB)...", gguf.name, gguf.stat().st_size / 1e6)
        try:
            model = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=dtype)
            tokenizer = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
        except (OSError, ValueError, KeyError, RuntimeError) as exc:
            raise ModelError(f"cannot load GGUF {gguf}: {exc}") from exc
        log.info("loaded GGUF in %.1f s; writing safetensors...", time.monotonic() - start_s)
        model.config.save_pretrained(tmp)
        _clean_config(tmp / "config.json", type(model).__name__)
        tokenizer.save_pretrained(tmp)
        if getattr(model, "generation_config", None) is not None:
            model.generation_config.save_pretrained(tmp)
        _write_state(model, tmp / "model.safetensors")
        del model
        marker = {"source": source, "sha256": sha256, "dtype": _dtype_name(dtype)}
        (tmp / CONVERTED_MARKER).write_text(json.dumps(marker, indent=1) + "\n")
        if target.exists():
            shutil.rmtree(target)
        os.replace(tmp, target)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    log.info("converted %s -> %s in %.1f s", gguf.name, target, time.monotonic() - start_s)
    return target


def _clean_config(path: Path, architecture: str) -> None:
    """Drop the GGUF quantization_config: the written weights are plain dequantised tensors."""
    config = json.loads(path.read_text())
    config.pop("quantization_config", None)
    config["architectures"] = [architecture]
    path.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")


def _write_state(model: torch.nn.Module, path: Path) -> None:
    """Write every parameter once; with tied embeddings lm_head.weight is left out."""
    tied = bool(getattr(model.config, "tie_word_embeddings", False))
    state = model.state_dict()
    entries = [
        TensorEntry(name, t.dtype, tuple(t.shape), lambda t=t: t.contiguous())
        for name, t in state.items()
        if not (tied and name == "lm_head.weight")
    ]
    _, size = write_safetensors(path, entries)
    log.info("wrote %s (%.1f MB, %d tensors)", path.name, size / 1e6, len(entries))
