"""Stage shard format: one safetensors file per pipeline stage plus a head file and a manifest.

A stage process loads only its own file, so a device never holds more than its layer range.
Layout of a shard directory (format 2):
    config.json, tokenizer files       copied from the source model
    head.safetensors                   embed_tokens, final norm, lm_head (absent when tied), 16-bit
    stage-<i>.safetensors              model.layers.<j>.* for j in the stage's [start, end)
    manifest.json                      written last; sizes and sha256 of every file, the storage
                                       quantization ("none" or "int4") and its group size
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
import os
import re
import shutil
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import torch
from safetensors import safe_open
from safetensors.torch import load_file

from flowedge.errors import ChecksumError, ConfigError, ModelError
from flowedge.filenames import is_plain_file_name
from flowedge.models import gguf_tensors, packing, shard_refs
from flowedge.models.gguf_tensors import GgufTensor
from flowedge.models.quant import DEFAULT_GROUP_SIZE
from flowedge.models.safetensors_io import _CODE_DTYPES, TensorEntry, file_sha256, write_safetensors  # noqa: F401
from flowedge.progress import Progress as Bar

log = logging.getLogger(__name__)

FORMAT = 2
READABLE_FORMATS = (1, 2)
MANIFEST = "manifest.json"
HEAD_FILE = "head.safetensors"
HEAD_NAMES = ("model.embed_tokens.weight", "model.norm.weight", "lm_head.weight")
# Files other than weights that travel with a model directory (tokenizer, generation settings).
COPY_SUFFIXES = (".json", ".txt", ".model", ".jinja")
SKIP_COPY = {"model.safetensors.index.json", MANIFEST, "flowedge.json"}
_LAYER_RE = re.compile(r"^model\.layers\.(\d+)\.")
_CHUNK = 1 << 22

Progress = Callable[[str], None]


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

    def to_json(self) -> dict:
        return {
            "format": self.format, "model": self.model, "num_layers": self.num_layers,
            "hidden_size": self.hidden_size, "dtype": self.dtype, "tied": self.tied,
            "quant": self.quant, "group_size": self.group_size,
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
                   group_size=data.get("group_size"))

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


def balanced_layers(num_layers: int, stages: int) -> list[int]:
    """Layer counts per stage differing by at most one; earlier stages take the extra layers."""
    if stages < 1 or stages > num_layers:
        raise ConfigError(f"cannot split {num_layers} layers into {stages} stages")
    base, extra = divmod(num_layers, stages)
    return [base + (1 if i < extra else 0) for i in range(stages)]


def _layer_counts(num_layers: int, stages: int, layers: list[int] | None) -> list[int]:
    if layers is None:
        return balanced_layers(num_layers, stages)
    if len(layers) != stages or any(n < 1 for n in layers) or sum(layers) != num_layers:
        raise ConfigError(
            f"--layers {','.join(map(str, layers))} must be {stages} positive counts "
            f"summing to {num_layers}"
        )
    return list(layers)


class _TensorSource:
    """Tensor names -> file in a Hugging Face directory (single file or index-sharded), or the GGUF
    tensor a converted checkpoint reads its embedding / lm_head from."""

    def __init__(self, model_dir: Path) -> None:
        single = model_dir / "model.safetensors"
        index = model_dir / "model.safetensors.index.json"
        self.files: dict[str, Path | GgufTensor]
        if single.is_file():
            with safe_open(str(single), "pt") as f:
                self.files = {name: single for name in f.keys()}
            self.files.update(gguf_tensors.checkpoint_tensors(model_dir))
        elif index.is_file():
            weight_map = json.loads(index.read_text())["weight_map"]
            self.files = {name: model_dir / fname for name, fname in weight_map.items()}
        elif (model_dir / MANIFEST).is_file():   # another split: its head and stage files
            self.files = shard_tensor_files(model_dir)
        else:
            raise ModelError(f"{model_dir} has no model.safetensors (other weight formats unsupported)")

    def group_size(self) -> int:
        """A packed source's int4 group size, read from the shapes of its first packed weight."""
        prefix = sorted(packing.packed_prefixes(self.files))[0]
        with safe_open(str(self.files[prefix + ".qweight"]), "pt") as f:
            in_features = f.get_slice(prefix + ".qweight").get_shape()[1] * 2
        with safe_open(str(self.files[prefix + ".scales"]), "pt") as f:
            return in_features // f.get_slice(prefix + ".scales").get_shape()[1]

    def entries(self, names: Iterable[str]) -> list[TensorEntry]:
        out = []
        for name in names:
            path = self.files[name]
            if isinstance(path, GgufTensor):
                out.append(TensorEntry(name, path.dtype, path.shape, path.load))
                continue
            with safe_open(str(path), "pt") as f:
                sl = f.get_slice(name)
                dtype, shape = _CODE_DTYPES[sl.get_dtype()], tuple(sl.get_shape())
            out.append(TensorEntry(name, dtype, shape, _loader(path, name)))
        return out


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


def _loader(path: Path, name: str) -> Callable[[], torch.Tensor]:
    def load() -> torch.Tensor:
        with safe_open(str(path), "pt") as f:
            return f.get_tensor(name)
    return load


def _group_names(names: Iterable[str], ranges: list[tuple[int, int]], num_layers: int):
    head: list[str] = []
    stages: list[list[str]] = [[] for _ in ranges]
    for name in sorted(names, key=_natural_key):
        match = _LAYER_RE.match(name)
        if match is None:
            head.append(name)
            continue
        layer = int(match.group(1))
        if layer >= num_layers:
            raise ModelError(f"tensor {name} beyond num_hidden_layers={num_layers}")
        stages[next(i for i, (a, b) in enumerate(ranges) if a <= layer < b)].append(name)
    return head, stages


def _natural_key(name: str) -> list:
    return [int(part) if part.isdigit() else part for part in name.split(".")]


def split_model(
    model_dir: Path,
    stages: int,
    out: Path,
    layers: list[int] | None = None,
    progress: Progress | None = None,
    *,
    model_name: str | None = None,
    quant: str | None = None,
    group_size: int = DEFAULT_GROUP_SIZE,
    copy: bool = False,
) -> Manifest:
    """Cut a Hugging Face model directory into per-stage safetensors files under `out`.

    `quant`: None keeps the source's storage (a packed source stays packed); "int4" packs every
    decoder layer's Linear weights (W4A16); "none" needs an unpacked source. Files that hold the
    source's tensors unchanged are references into it unless `copy`.
    Files are written into a temporary sibling directory that is renamed into place at the
    end, so `out` is either absent, the previous complete split, or the new complete split.
    """
    model_dir, out = Path(model_dir), Path(out)
    config = _read_config(model_dir)
    num_layers, hidden = int(config["num_hidden_layers"]), int(config["hidden_size"])
    counts = _layer_counts(num_layers, stages, layers)
    bounds = [sum(counts[:i]) for i in range(stages + 1)]
    ranges = list(zip(bounds[:-1], bounds[1:]))
    source = _TensorSource(model_dir)
    stored = packing.quant_of(source.files)
    quant = quant or stored
    group = _split_group_size(source, stored, quant, group_size)
    tied = bool(config.get("tie_word_embeddings", False))
    head_names, stage_names = _group_names(source.files, ranges, num_layers)
    if tied:
        head_names = [n for n in head_names if n != "lm_head.weight"]
    elif "lm_head.weight" not in head_names:
        raise ModelError(f"{model_dir}: lm_head.weight missing and tie_word_embeddings is false")
    report = progress or (lambda msg: log.info("%s", msg))
    tmp = _fresh_tmp(out)
    head_entries = source.entries(head_names)
    bar = Bar(f"splitting {model_name or model_dir.name} into {stages} stages",
                   sum(e.nbytes for e in head_entries) + sum(e.nbytes for n in stage_names for e in source.entries(n)))
    try:
        _copy_side_files(model_dir, tmp)
        head_sha, head_bytes = _write_file(tmp / HEAD_FILE, head_entries, None if copy else source.files,
                                           bar.advance)
        report(f"wrote {HEAD_FILE} ({head_bytes / 1e6:.1f} MB)")
        specs = []
        for i, ((start, end), names) in enumerate(zip(ranges, stage_names)):
            fname = f"stage-{i}.safetensors"
            entries = source.entries(names)
            read = sum(e.nbytes for e in entries)   # the bar counts bytes read, packed or not
            if quant == "int4" and stored == "none":
                entries = packing.pack_entries(entries, group)
            ratio = read / max(sum(e.nbytes for e in entries), 1)
            refer = None if copy or (quant == "int4" and stored == "none") else source.files
            sha, size = _write_file(tmp / fname, entries, refer, lambda n, r=ratio: bar.advance(n * r))
            specs.append(StageSpec(i, start, end, fname, sha, size))
            report(f"wrote {fname}: layers [{start}, {end}) ({size / 1e6:.1f} MB)")
        manifest = Manifest(
            model=model_name or str(model_dir), num_layers=num_layers, hidden_size=hidden,
            dtype=_dtype_name(source, head_names), tied=tied,
            head=FileSpec(HEAD_FILE, head_sha, head_bytes), stages=tuple(specs),
            quant=quant, group_size=group,
        )
        (tmp / MANIFEST).write_text(json.dumps(manifest.to_json(), indent=1) + "\n")
        _swap_into_place(tmp, out)
        bar.finish()
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return manifest


def _write_file(path: Path, entries: list[TensorEntry], refer: dict[str, Path] | None,
                progress: Callable[[float], None]) -> tuple[str, int]:
    """Write `path`, or (`refer`: where each tensor is stored as is) its reference; (sha256, bytes)."""
    if refer is None:
        return write_safetensors(path, entries, progress=progress)
    return shard_refs.write_ref(path.with_name(path.name + shard_refs.REF_SUFFIX),
                                shard_refs.build_ref(entries, refer), progress)


def is_referenced(shard_dir: Path) -> bool:
    """True when the split's files are references into its checkpoint, and every one still resolves."""
    manifest = Manifest.load(shard_dir)
    return shard_refs.all_resolve(shard_dir, [manifest.head.file, *(s.file for s in manifest.stages)])


def _split_group_size(source: _TensorSource, stored: str, quant: str, group_size: int) -> int | None:
    if quant not in packing.QUANT_FORMATS:
        raise ConfigError(f"split quant must be one of {packing.QUANT_FORMATS}, got {quant!r}")
    if stored == "int4" and quant == "none":
        raise ConfigError("this model is stored W4A16 (int4): a full-precision split needs its 16-bit "
                          "conversion (quant none)")
    if quant == "none":
        return None
    if stored == "none":
        packing.check_group_size(group_size)
        return group_size
    return source.group_size()


def _read_config(model_dir: Path) -> dict:
    try:
        config = json.loads((model_dir / "config.json").read_text())
    except FileNotFoundError:
        raise ModelError(f"{model_dir} has no config.json") from None
    except ValueError as exc:
        raise ModelError(f"{model_dir}/config.json is invalid: {exc}") from None
    if "num_hidden_layers" not in config or "hidden_size" not in config:
        raise ModelError(f"{model_dir}/config.json lacks num_hidden_layers/hidden_size")
    return config


def _dtype_name(source: _TensorSource, head_names: list[str]) -> str:
    entry = source.entries([n for n in head_names if n.endswith("embed_tokens.weight")][:1] or
                           list(source.files)[:1])[0]
    return str(entry.dtype).removeprefix("torch.")


def _copy_side_files(model_dir: Path, dest: Path) -> None:
    """Tokenizer and config files: hard links where the file system allows (the 11 MB tokenizer of the
    real pair is otherwise stored once per split), copies elsewhere."""
    for path in model_dir.iterdir():
        if path.is_file() and path.suffix in COPY_SUFFIXES and path.name not in SKIP_COPY:
            try:
                os.link(path, dest / path.name)
            except OSError:
                shutil.copy2(path, dest / path.name)


def _fresh_tmp(out: Path) -> Path:
    if out.exists() and any(out.iterdir()) and not (out / MANIFEST).is_file():
        raise ConfigError(f"{out} exists and is not a shard directory; refusing to overwrite")
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.parent / f".{out.name}.tmp-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    return tmp


def _swap_into_place(tmp: Path, out: Path) -> None:
    """Rename tmp to out; an old split is moved aside first and removed after."""
    old = out.parent / f".{out.name}.old-{os.getpid()}"
    if out.exists():
        os.replace(out, old)
    os.replace(tmp, out)
    shutil.rmtree(old, ignore_errors=True)


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

