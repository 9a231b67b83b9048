"""Turn a model spec (registry name, HF directory, .gguf file) into a Hugging Face directory.

GGUF files are converted once into config.json + tokenizer + one model.safetensors under
<home>/models/, because loading GGUF through transformers takes a minute and reloading the
converted directory takes about a second. Two storage formats (flowedge.json records which):
    models/<name>/       quant "int4": W4A16, decoder Linears packed (models/packing.py), the
                         embedding, norms, biases and lm_head in float16 (the default)
    models/<name>-f16/   quant "none": every tensor in float16, a plain Hugging Face checkpoint
Nothing is ever stored in float32. A directory written by an older flowedge (float32, no "format"
in flowedge.json) is converted again, never read as the new format.
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
from flowedge.models.packing import pack_entries, storage_quant
from flowedge.models.quant import DEFAULT_GROUP_SIZE
from flowedge.models.safetensors_io import TensorEntry, file_sha256, write_safetensors
from flowedge.progress import Progress, Ticker

log = logging.getLogger(__name__)

CONVERTED_MARKER = "flowedge.json"
CONVERT_FORMAT = 2
STORE_DTYPE = torch.float16
_F16_MAX = torch.finfo(torch.float16).max


def resolve_model(spec: str, *, home: Path | None = None, quant: str = "int4") -> Path:
    """Return an HF-format directory for `spec`, pulling and converting as needed (cached).

    `quant` picks the stored format of a converted GGUF (int4 and auto: W4A16; none and nf4: 16-bit,
    which nf4 quantizes while loading); a Hugging Face directory is returned as it is."""
    home = Path(home) if home is not None else registry.flowedge_home()
    fmt = storage_quant(quant)
    if spec in registry.MODELS:
        return _resolve_registry(spec, home, fmt)
    path = Path(spec).expanduser()
    if path.is_dir() and (path / "config.json").is_file():
        return path
    if path.is_file() and path.suffix.lower() == ".gguf":
        return _resolve_gguf_file(path.resolve(), home, fmt)
    raise ModelError(
        f"cannot resolve model {spec!r}: not a known name ({', '.join(sorted(registry.MODELS))}), "
        "a Hugging Face directory with config.json, or a .gguf file"
    )


def _suffix(fmt: str) -> str:
    return "" if fmt == "int4" else "-f16"


def _resolve_registry(name: str, home: Path, fmt: str) -> Path:
    entry = registry.get_entry(name)
    target = home / "models" / f"{name}{_suffix(fmt)}"
    if _converted(target, entry.sha256, fmt):
        return target
    gguf = registry.pull(name, home=home)
    convert_gguf(gguf, target, source=name, sha256=entry.sha256, quant=fmt)
    return target


def _resolve_gguf_file(path: Path, home: Path, fmt: str) -> Path:
    stat = path.stat()
    key = hashlib.sha256(f"{path}\0{stat.st_size}\0{stat.st_mtime_ns}".encode()).hexdigest()[:16]
    target = home / "models" / f"gguf-{key}{_suffix(fmt)}"
    if _converted(target, None, fmt):
        return target
    log.info("hashing %s", path)
    convert_gguf(path, target, source=str(path), sha256=file_sha256(path), quant=fmt)
    return target


def _converted(target: Path, sha256: str | None, fmt: str) -> bool:
    try:
        marker = json.loads((target / CONVERTED_MARKER).read_text())
    except (FileNotFoundError, ValueError):
        return False
    if marker.get("format") != CONVERT_FORMAT:
        log.info("%s was converted by an older flowedge (%s); converting again", target,
                 marker.get("dtype", "unknown dtype"))
        return False
    if sha256 is not None and marker.get("sha256") != sha256:
        return False
    return marker.get("quant") == fmt and (target / "model.safetensors").is_file()


def _store_dtype(name: str, tensor: torch.Tensor) -> torch.dtype:
    """float16 (finer than bfloat16 for dequantised GGUF weights); bfloat16 for a tensor beyond its range."""
    if not tensor.is_floating_point():
        return tensor.dtype
    if tensor.numel() and tensor.abs().max().item() > _F16_MAX:
        log.warning("%s exceeds the float16 range; stored as bfloat16", name)
        return torch.bfloat16
    return STORE_DTYPE


def _cast(load, dtype: torch.dtype):
    return lambda: load().to(dtype)


def convert_gguf(
    gguf: Path, target: Path, *, source: str, sha256: str, quant: str = "int4",
    group_size: int = DEFAULT_GROUP_SIZE,
) -> Path:
    """Dequantise a GGUF into an HF directory stored as `quant` (int4: W4A16, none: float16);
    written to a temp dir and renamed at the end."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = target.parent / f".{target.name}.tmp-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    try:
        start_s = time.monotonic()
        log.info("loading GGUF %s (%.1f MB)...", gguf.name, gguf.stat().st_size / 1e6)
        try:
            with Ticker(f"converting {source}: reading the GGUF (about a minute per GB)"):
                model = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name,
                                                             dtype=torch.float32)
                tokenizer = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
        except (OSError, ValueError, KeyError, RuntimeError) as exc:
            raise ModelError(f"cannot load GGUF {gguf}: {exc}") from exc
        log.info("loaded GGUF in %.1f s; writing safetensors...", time.monotonic() - start_s)
        model.config.save_pretrained(tmp)
        _clean_config(tmp / "config.json", type(model).__name__)
        tokenizer.save_pretrained(tmp)
        if getattr(model, "generation_config", None) is not None:
            model.generation_config.save_pretrained(tmp)
        _write_state(model, tmp / "model.safetensors", quant, group_size, f"converting {source}: writing {quant}")
        del model
        marker = {"format": CONVERT_FORMAT, "source": source, "sha256": sha256, "dtype": "float16",
                  "quant": quant, "group_size": group_size if quant == "int4" else None}
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


def _write_state(model: torch.nn.Module, path: Path, quant: str, group_size: int, what: str) -> None:
    """Write every parameter once, 16-bit (decoder Linears packed for int4); with tied embeddings
    lm_head.weight is left out."""
    tied = bool(getattr(model.config, "tie_word_embeddings", False))
    state = model.state_dict()
    entries = [
        TensorEntry(name, t.dtype, tuple(t.shape), lambda t=t: t.contiguous())
        for name, t in state.items()
        if not (tied and name == "lm_head.weight")
    ]
    store = {e.name: _store_dtype(e.name, state[e.name]) for e in entries}
    entries = pack_entries(entries, group_size, lambda e: store[e.name]) if quant == "int4" else \
        [TensorEntry(e.name, store[e.name], e.shape, _cast(e.load, store[e.name])) for e in entries]
    bar = Progress(what, sum(e.nbytes for e in entries))
    _, size = write_safetensors(path, entries, progress=bar.advance)
    bar.finish()
    log.info("wrote %s (%.1f MB, %d tensors)", path.name, size / 1e6, len(entries))
