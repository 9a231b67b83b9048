"""Turn a model spec (registry name, HF directory, .gguf file) into a Hugging Face directory.

GGUF files are converted once (models/convert.py, streamed tensor by tensor) into config.json +
tokenizer + one model.safetensors under <home>/models/, because dequantising and packing a GGUF
takes minutes and loading the converted directory about a second. Two storage formats (flowedge.json
records which):
    models/<name>/       quant "int4": W4A16, decoder Linears packed (models/packing.py), the
                         norms and biases in float16 (the default). The embedding and lm_head of a
                         registry model are not stored: flowedge.json says where its GGUF holds them
                         and loaders dequantise them from there (models/gguf_tensors.py), bit-identical
                         to the float16 copies format 2 stored (1.48 GB for the real pair). A GGUF file
                         the user gave keeps the copies: the cache does not own that file. Since
                         format 4 the layer Linears the GGUF keeps at 6-8 bits are stored W8A16.
    models/<name>-f16/   quant "none": every tensor in float16, a plain Hugging Face checkpoint
Nothing is ever stored in float32. A directory written by an older flowedge (float32, no "format"
in flowedge.json; a W4A16 one before format 4) is converted again, never read as the new format; a
16-bit checkpoint of format 2 or 3 is laid out as format 4's and still read.
"""
from __future__ import annotations

import json
import logging
from pathlib import Path

from flowedge.errors import ModelError
from flowedge.home import flowedge_home
from flowedge.models import gguf_tensors, registry
from flowedge.models.convert import CHECKPOINT_KEY, CONVERT_FORMAT, CONVERTED_MARKER, convert_gguf
from flowedge.models.packing import storage_quant
from flowedge.models.content_hash import memo_at
from flowedge.models.safetensors_io import file_sha256

log = logging.getLogger(__name__)

_LAYOUT_KEPT = {(2, "none"), (3, "none")}   # older 16-bit checkpoints are laid out as format 4's: still read


def resolve_model(spec: str, *, home: Path | None = None, quant: str = "int4") -> Path:
    """Return an HF-format directory for `spec`, pulling and converting as needed (cached).

    `quant` picks the stored format of a converted GGUF (int4 and auto: W4A16; none and nf4: 16-bit,
    which nf4 quantizes while loading); a Hugging Face directory is returned as it is."""
    home = Path(home) if home is not None else flowedge_home()
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
    convert_gguf(gguf, target, source=name, sha256=entry.sha256, quant=fmt, reference_gguf=True)
    return target


def _resolve_gguf_file(path: Path, home: Path, fmt: str) -> Path:
    """A GGUF the user gave, converted once per content: keyed and checked by its sha256 (memoized by
    the file's stamp, so a start hashes it only when it changed), so a file replaced under the same path
    is converted anew, never served from the old one's conversion."""
    memo = memo_at(home)
    sha256 = memo.sha256(path)
    memo.save()
    target = home / "models" / f"gguf-{sha256[:16]}{_suffix(fmt)}"
    if _converted(target, sha256, fmt):
        return target
    convert_gguf(path, target, source=str(path), sha256=sha256, quant=fmt)
    return target


def _converted(target: Path, sha256: str | None, fmt: str) -> bool:
    try:
        marker = json.loads((target / CONVERTED_MARKER).read_text())
    except (FileNotFoundError, ValueError):
        return False
    if marker.get("format") != CONVERT_FORMAT and (marker.get("format"), marker.get("quant")) not in _LAYOUT_KEPT:
        log.info("%s was converted by an older flowedge (format %s, %s); converting again",
                 target, marker.get("format"), marker.get("dtype", "unknown dtype"))
        return False
    if sha256 is not None and marker.get("sha256") != sha256:
        log.warning("%s was converted from a GGUF of sha256 %s…, not the %s… asked for: converting again",
                    target, str(marker.get("sha256"))[:12], sha256[:12])
        return False
    if marker.get("quant") != fmt or not (target / "model.safetensors").is_file():
        return False
    if not _checkpoint_intact(target / "model.safetensors", marker.get(CHECKPOINT_KEY)):
        return False
    if marker.get(gguf_tensors.MARKER_KEY):
        try:
            gguf_tensors.check_gguf(target, marker)
        except ModelError as exc:   # the GGUF went missing or was altered: fetch and convert again
            log.warning("%s", exc)
            return False
    return True


def _checkpoint_intact(path: Path, record: dict | None) -> bool:
    """False for a converted checkpoint that is no longer what was written (truncated, overwritten, bit
    rot that changed its mtime): the caller converts again rather than failing at every start. A marker
    from before the record was kept has none: trusted as before."""
    if record is None:
        return True
    st = path.stat()
    if (st.st_size, st.st_mtime_ns) == (record["bytes"], record["mtime_ns"]):
        return True
    if st.st_size == record["bytes"] and file_sha256(path) == record["sha256"]:
        return True   # touched, not changed
    log.warning("%s is damaged (%d bytes, %d written; its sha256 differs): converting again",
                path, st.st_size, record["bytes"])
    return False

