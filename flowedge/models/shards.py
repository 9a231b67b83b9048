"""Stage shard format: one safetensors file per pipeline stage plus a head file and a manifest.

Written by `models/split.py`; read here. A stage process loads only its own file, so a device never holds
more than its layer range.
Layout of a shard directory (format 2):
    config.json, tokenizer files       copied from the source model
    head.safetensors                   embed_tokens, final norm, lm_head (absent when tied), 16-bit
    stage-<i>.safetensors              model.layers.<j>.* for j in the stage's [start, end)
    manifest.json                      written last; sizes and sha256 of every file, the storage
                                       quantization ("none" or "int4") and its group size, and the
                                       content key of the model it was cut from (source_sha256)
A file whose tensors are stored exactly as in the checkpoint (every head file; stage files unless
the split packs a 16-bit checkpoint) is written as `<file>.ref` instead (flowedge.models.shard_refs:
the header plus byte ranges of the checkpoint), so a split costs no second copy of the model; the
bytes and sha256 a stage fetches are those a copy would have. `copy=True` writes every file.
With quant "int4" a stage file holds its Linear weights packed (flowedge.models.packing): the
shard a stage fetches and loads is already W4A16. Format 1 (flowedge <= 0.1: no quant field,
float32 tensors) is still read, as quant "none".
"""
from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import torch
from safetensors import safe_open
from safetensors.torch import load_file

from flowedge.errors import ChecksumError, ConfigError, ModelError
from flowedge.filenames import is_plain_file_name
from flowedge.models import gguf_tensors, shard_refs
from flowedge.models.gguf_tensors import GgufTensor
from flowedge.models.safetensors_io import TensorEntry, file_sha256, write_safetensors  # noqa: F401

log = logging.getLogger(__name__)

FORMAT = 2
READABLE_FORMATS = (1, 2)
MANIFEST = "manifest.json"
HEAD_FILE = "head.safetensors"
HEAD_NAMES = ("model.embed_tokens.weight", "model.norm.weight", "lm_head.weight")

@dataclass(frozen=True, slots=True)
class StageSpec:
    index: int
    start: int
    end: int
    file: str
    sha256: str
    bytes: int


@dataclass(frozen=True, slots=True)
class FileSpec:
    file: str
    sha256: str
    bytes: int


@dataclass(frozen=True, slots=True)
class Manifest:
    model: str
    num_layers: int
    hidden_size: int
    dtype: str
    tied: bool
    head: FileSpec
    stages: tuple[StageSpec, ...]
    format: int = FORMAT
    quant: str = "none"               # storage: none (16/32-bit tensors) | int4 (W4A16 packed layers)
    group_size: int | None = None     # int4 only
    source_sha256: str = ""           # content key of the model split (content_hash.model_sha256); "" before

    def to_json(self) -> dict:
        return {
            "format": self.format, "model": self.model, "num_layers": self.num_layers,
            "hidden_size": self.hidden_size, "dtype": self.dtype, "tied": self.tied,
            "quant": self.quant, "group_size": self.group_size, "source_sha256": self.source_sha256,
            "head": {"file": self.head.file, "sha256": self.head.sha256, "bytes": self.head.bytes},
            "stages": [{"index": s.index, "layers": [s.start, s.end], "file": s.file,
                        "sha256": s.sha256, "bytes": s.bytes} for s in self.stages],
        }

    @classmethod
    def load(cls, shard_dir: Path) -> Manifest:
        path = Path(shard_dir) / MANIFEST
        try:
            data = json.loads(path.read_text())
            manifest = cls._from_json(data)
        except FileNotFoundError:
            raise ModelError(f"{shard_dir} is not a shard directory (no {MANIFEST})") from None
        except (ValueError, KeyError, TypeError) as exc:
            raise ModelError(f"invalid {path}: {exc}") from None
        manifest._check()
        return manifest

    @classmethod
    def _from_json(cls, data: dict) -> Manifest:
        if data["format"] not in READABLE_FORMATS:
            raise ValueError(f"format {data['format']} unsupported (this flowedge reads {READABLE_FORMATS})")
        stages = tuple(
            StageSpec(int(s["index"]), int(s["layers"][0]), int(s["layers"][1]), str(s["file"]),
                      str(s["sha256"]), int(s["bytes"]))
            for s in data["stages"]
        )
        head = data["head"]
        return cls(model=str(data["model"]), num_layers=int(data["num_layers"]),
                   hidden_size=int(data["hidden_size"]), dtype=str(data["dtype"]),
                   tied=bool(data["tied"]),
                   head=FileSpec(str(head["file"]), str(head["sha256"]), int(head["bytes"])),
                   stages=stages, format=int(data["format"]), quant=str(data.get("quant", "none")),
                   group_size=data.get("group_size"), source_sha256=str(data.get("source_sha256", "")))

    def _check(self) -> None:
        for name in [self.head.file, *(s.file for s in self.stages)]:
            if not is_plain_file_name(name):   # the manifest may come from a peer: stay in this directory
                raise ModelError(f"manifest names file {name[:60]!r}: only plain file names are allowed")
        expected = 0
        for i, stage in enumerate(self.stages):
            if stage.index != i or stage.start != expected or stage.end <= stage.start:
                raise ModelError(f"manifest stage {i} has bad layers [{stage.start}, {stage.end})")
            expected = stage.end
        if expected != self.num_layers:
            raise ModelError(f"manifest stages cover {expected} of {self.num_layers} layers")


def shard_tensor_files(shard_dir: Path) -> dict[str, Path | GgufTensor]:
    """name -> file for a shard or checkpoint directory: its safetensors files, the checkpoint files its
    `.ref`s point into (for the files not present themselves), and the GGUF tensors a converted
    checkpoint reads its embedding / lm_head from."""
    files: dict[str, Path | GgufTensor] = {}
    present = sorted(Path(shard_dir).glob("*.safetensors"))
    for path in present:
        with safe_open(str(path), "pt") as f:
            files.update({name: path for name in f.keys()})
    files.update(shard_refs.ref_tensor_files(shard_dir, skip={p.name for p in present}))
    files.update(gguf_tensors.checkpoint_tensors(shard_dir))
    return files


def is_referenced(shard_dir: Path) -> bool:
    """True when the split's files are references into its checkpoint, and every one still resolves."""
    manifest = Manifest.load(shard_dir)
    return shard_refs.all_resolve(shard_dir, [manifest.head.file, *(s.file for s in manifest.stages)])


def load_shard(
    shard_dir: Path, which: Literal["head"] | int, *, verify: bool = True
) -> dict[str, torch.Tensor]:
    """Load the head or one stage's tensors (original names), checking sha256 first."""
    shard_dir = Path(shard_dir)
    manifest = Manifest.load(shard_dir)
    spec = _file_spec(manifest, which)
    stored = shard_refs.resolve_file(shard_dir, spec.file)
    if stored is None:
        raise ModelError(f"shard {spec.file} missing from {shard_dir}")
    if verify:
        verify_file(stored, spec)
    if isinstance(stored, Path):
        return load_file(str(stored))
    return {seg.name: gguf_tensors.read_tensor(seg.source, seg.name) for seg in stored.segments}


def verify_file(stored: Path | shard_refs.RefFile, spec: FileSpec | StageSpec) -> None:
    """Size and sha256 of a shard file (or of the bytes its reference stands for) against the manifest."""
    size = stored.stat().st_size if isinstance(stored, Path) else stored.size
    if size != spec.bytes:
        raise ChecksumError(f"shard {spec.file} is corrupt: {size} bytes != manifest {spec.bytes}")
    actual = file_sha256(stored) if isinstance(stored, Path) else stored.sha256()
    if actual != spec.sha256:
        raise ChecksumError(f"shard {spec.file} is corrupt: sha256 {actual} != manifest {spec.sha256}")


def _file_spec(manifest: Manifest, which: Literal["head"] | int) -> FileSpec | StageSpec:
    if which == "head":
        return manifest.head
    if isinstance(which, int) and not isinstance(which, bool) and 0 <= which < len(manifest.stages):
        return manifest.stages[which]
    raise ConfigError(f"no shard {which!r}: expected 'head' or 0..{len(manifest.stages) - 1}")

