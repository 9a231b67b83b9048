"""Turn a model spec (registry name, HF directory, .gguf file) into a Hugging Face directory.

GGUF files are converted once into config.json + tokenizer + one model.safetensors under
<home>/models/, because loading GGUF through transformers takes a minute and reloading the
converted directory takes about a second. Two storage formats (flowedge.json records which):
    models/<name>/       quant "int4": W4A16, decoder Linears packed (models/packing.py), the
                         norms and biases in float16 (the default). The embedding and lm_head of a
                         registry model are not stored: flowedge.json says where its GGUF holds them
                         and loaders dequantise them from there (models/gguf_tensors.py), bit-identical
                         to the float16 copies format 2 stored (1.48 GB for the real pair). A GGUF file
                         the user gave keeps the copies: the cache does not own that file.
    models/<name>-f16/   quant "none": every tensor in float16, a plain Hugging Face checkpoint
Nothing is ever stored in float32. A directory written by an older flowedge (float32, no "format"
in flowedge.json) is converted again, never read as the new format; a format-2 W4A16 checkpoint of a
registry model is migrated in place (its two 16-bit copies dropped, seconds instead of a conversion).
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
from flowedge.models import gguf_tensors, registry
from flowedge.models.packing import pack_entries, storage_quant
from flowedge.models.quant import DEFAULT_GROUP_SIZE
from flowedge.models.safetensors_io import _CODE_DTYPES, TensorEntry, file_sha256, write_safetensors
from flowedge.progress import Progress, Ticker

log = logging.getLogger(__name__)

CONVERTED_MARKER = "flowedge.json"
CONVERT_FORMAT = 3
_FORMAT_2_LAYOUT_KEPT = "none"   # a format-2 16-bit checkpoint is laid out as format 3: still read
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
    if fmt == "int4" and migrate_format2(target, gguf, entry.sha256):
        return target
    convert_gguf(gguf, target, source=name, sha256=entry.sha256, quant=fmt, reference_gguf=True)
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
    if marker.get("format") != CONVERT_FORMAT and \
            (marker.get("format"), marker.get("quant")) != (2, _FORMAT_2_LAYOUT_KEPT):
        log.info("%s was converted by an older flowedge (format %s, %s); migrating or converting again",
                 target, marker.get("format"), marker.get("dtype", "unknown dtype"))
        return False
    if sha256 is not None and marker.get("sha256") != sha256:
        return False
    if marker.get("quant") != fmt or not (target / "model.safetensors").is_file():
        return False
    if marker.get(gguf_tensors.MARKER_KEY):
        try:
            gguf_tensors.check_gguf(target, marker)
        except ModelError as exc:   # the GGUF went missing or was altered: fetch and convert again
            log.warning("%s", exc)
            return False
    return True


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
    group_size: int = DEFAULT_GROUP_SIZE, reference_gguf: bool = False,
) -> Path:
    """Dequantise a GGUF into an HF directory stored as `quant` (int4: W4A16, none: float16);
    written to a temp dir and renamed at the end. `reference_gguf` (int4, a GGUF the cache keeps):
    the embedding and lm_head are read from the GGUF at load instead of being stored."""
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
        refs = _gguf_refs(model, gguf) if reference_gguf and quant == "int4" else {}
        _write_state(model, tmp / "model.safetensors", quant, group_size, f"converting {source}: writing {quant}",
                     skip=set(refs))
        del model
        marker = {"format": CONVERT_FORMAT, "source": source, "sha256": sha256, "dtype": "float16",
                  "quant": quant, "group_size": group_size if quant == "int4" else None}
        if refs:
            marker[gguf_tensors.MARKER_KEY] = {**gguf_tensors.file_record(gguf, sha256, target),
                                               "tensors": {n: t.to_json() for n, t in refs.items()}}
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


def _gguf_refs(model: torch.nn.Module, gguf: Path) -> dict[str, gguf_tensors.GgufTensor]:
    """The 16-bit tensors the GGUF gives back bit for bit (dequantised, cast as `_store_dtype` would):
    those need no copy in the checkpoint."""
    state = model.state_dict()
    tied = bool(getattr(model.config, "tie_word_embeddings", False))
    wanted = {n: _store_dtype(n, state[n]) for n in gguf_tensors.HF_TO_GGUF
              if n in state and not (tied and n == "lm_head.weight")}
    located = gguf_tensors.locate(gguf, wanted)
    same = {n: t for n, t in located.items() if torch.equal(t.load(), state[n].to(t.dtype))}
    for name in set(located) - set(same):
        log.warning("%s: the GGUF's %s does not dequantise to the loaded tensor; storing a copy",
                    name, located[name].tensor)
    return same


def migrate_format2(target: Path, gguf: Path, sha256: str) -> bool:
    """Turn a format-2 W4A16 checkpoint of `gguf` into format 3 in place: drop the 16-bit embedding and
    lm_head copies the GGUF gives back bit for bit. False (convert again) where it does not apply."""
    from safetensors import safe_open

    try:
        marker = json.loads((target / CONVERTED_MARKER).read_text())
    except (FileNotFoundError, ValueError):
        return False
    ckpt = target / "model.safetensors"
    if (marker.get("format"), marker.get("quant"), marker.get("sha256")) != (2, "int4", sha256) or \
            not ckpt.is_file():
        return False
    with safe_open(str(ckpt), "pt") as f:
        kept = {n: f.get_slice(n) for n in f.keys()}
        kept = {n: (_CODE_DTYPES[sl.get_dtype()], tuple(sl.get_shape())) for n, sl in kept.items()}
    located = gguf_tensors.locate(gguf, {n: kept[n][0] for n in gguf_tensors.HF_TO_GGUF if n in kept})
    refs = {n: t for n, t in located.items()
            if t.shape == kept[n][1] and torch.equal(t.load(), gguf_tensors.read_tensor(ckpt, n))}
    if not refs:
        return False
    log.info("migrating %s: its %s are read from %s from now on", target, ", ".join(refs), gguf.name)
    entries = [TensorEntry(n, dtype, shape, lambda n=n: gguf_tensors.read_tensor(ckpt, n))
               for n, (dtype, shape) in kept.items() if n not in refs]
    tmp = target / f".model.safetensors.tmp-{os.getpid()}"
    try:
        write_safetensors(tmp, entries)
        os.replace(tmp, ckpt)
    finally:
        tmp.unlink(missing_ok=True)
    marker.update({"format": CONVERT_FORMAT, gguf_tensors.MARKER_KEY: {
        **gguf_tensors.file_record(gguf, sha256, target), "tensors": {n: t.to_json() for n, t in refs.items()}}})
    tmp_marker = target / f".{CONVERTED_MARKER}.tmp-{os.getpid()}"   # a new file: never through a hard link
    tmp_marker.write_text(json.dumps(marker, indent=1) + "\n")
    os.replace(tmp_marker, target / CONVERTED_MARKER)
    return True


def _write_state(model: torch.nn.Module, path: Path, quant: str, group_size: int, what: str,
                 skip: set[str] = frozenset()) -> None:
    """Write every parameter once, 16-bit (decoder Linears packed for int4), except `skip` (read from
    the GGUF); with tied embeddings lm_head.weight is left out."""
    tied = bool(getattr(model.config, "tie_word_embeddings", False))
    state = model.state_dict()
    entries = [
        TensorEntry(name, t.dtype, tuple(t.shape), lambda t=t: t.contiguous())
        for name, t in state.items()
        if not (tied and name == "lm_head.weight") and name not in skip
    ]
    store = {e.name: _store_dtype(e.name, state[e.name]) for e in entries}
    entries = pack_entries(entries, group_size, lambda e: store[e.name]) if quant == "int4" else \
        [TensorEntry(e.name, store[e.name], e.shape, _cast(e.load, store[e.name])) for e in entries]
    bar = Progress(what, sum(e.nbytes for e in entries))
    _, size = write_safetensors(path, entries, progress=bar.advance)
    bar.finish()
    log.info("wrote %s (%.1f MB, %d tensors)", path.name, size / 1e6, len(entries))
