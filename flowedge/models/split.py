"""Cut a model into stage shards (the format and its reader: shards.py).

Source tensors are looked up wherever the model stores them (one safetensors file, an index-sharded
checkpoint, another split, or the GGUF a converted checkpoint reads its embedding / lm_head from), grouped
by stage, optionally packed to W4A16, and written as files or as references into the source
(`shard_refs`). A split is built in a temporary sibling directory and swapped into place at the end.
"""
from __future__ import annotations

import json
import logging
import os
import re
import shutil
from collections.abc import Callable, Iterable
from pathlib import Path

import torch
from safetensors import safe_open

from flowedge.errors import ConfigError, ModelError
from flowedge.models import content_hash, gguf_tensors, packing, shard_refs
from flowedge.models.gguf_tensors import GgufTensor
from flowedge.models.quant import DEFAULT_GROUP_SIZE
from flowedge.models.safetensors_io import _CODE_DTYPES, TensorEntry, write_safetensors
from flowedge.models.shards import HEAD_FILE, MANIFEST, FileSpec, Manifest, StageSpec, shard_tensor_files
from flowedge.progress import Progress as Bar

log = logging.getLogger(__name__)

# Files other than weights that travel with a model directory (tokenizer, generation settings).
COPY_SUFFIXES = (".json", ".txt", ".model", ".jinja")
SKIP_COPY = {"model.safetensors.index.json", MANIFEST, "flowedge.json"}
_LAYER_RE = re.compile(r"^model\.layers\.(\d+)\.")

Progress = Callable[[str], None]


def balanced_layers(num_layers: int, stages: int) -> list[int]:
    """Layer counts per stage differing by at most one; earlier stages take the extra layers."""
    if stages < 1 or stages > num_layers:
        raise ConfigError(f"cannot split {num_layers} layers into {stages} stages")
    base, extra = divmod(num_layers, stages)
    return [base + (1 if i < extra else 0) for i in range(stages)]


def layer_counts(num_layers: int, stages: int, layers: list[int] | None) -> list[int]:
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



def split_model(model_dir: Path, stages: int, out: Path, layers: list[int] | None = None,
                progress: Progress | None = None, *, model_name: str | None = None, quant: str | None = None,
                group_size: int = DEFAULT_GROUP_SIZE, copy: bool = False,
                source_sha256: str | None = None) -> Manifest:
    """Cut a Hugging Face model directory into per-stage safetensors files under `out`.

    `quant`: None keeps the source's storage (a packed source stays packed); "int4" packs every
    decoder layer's Linear weights (W4A16); "none" needs an unpacked source. Files that hold the
    source's tensors unchanged are references into it unless `copy`. The manifest records the
    source's content key (`source_sha256`, hashed here unless the caller has it), which a reuse checks.
    Files are written into a temporary sibling directory that is renamed into place at the
    end, so `out` is either absent, the previous complete split, or the new complete split.
    """
    model_dir, out = Path(model_dir), Path(out)
    config = _read_config(model_dir)
    source_sha256 = source_sha256 or content_hash.model_sha256(model_dir)
    num_layers, hidden = int(config["num_hidden_layers"]), int(config["hidden_size"])
    ranges = _stage_ranges(num_layers, stages, layers)
    source = _TensorSource(model_dir)
    stored = packing.quant_of(source.files)
    quant = quant or stored
    group = _split_group_size(source, stored, quant, group_size)
    tied = bool(config.get("tie_word_embeddings", False))
    head_names, stage_names = _group_names(source.files, ranges, num_layers)
    head_names = _head_names(model_dir, head_names, tied)
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
        pack = group if quant == "int4" and stored == "none" else None
        specs = _write_stages(tmp, source, list(zip(ranges, stage_names)), pack, copy, bar, report)
        manifest = Manifest(
            model=model_name or str(model_dir), num_layers=num_layers, hidden_size=hidden,
            dtype=_dtype_name(source, head_names), tied=tied,
            head=FileSpec(HEAD_FILE, head_sha, head_bytes), stages=specs,
            quant=quant, group_size=group, source_sha256=source_sha256,
        )
        (tmp / MANIFEST).write_text(json.dumps(manifest.to_json(), indent=1) + "\n")
        _swap_into_place(tmp, out)
        bar.finish()
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return manifest


def _stage_ranges(num_layers: int, stages: int, layers: list[int] | None) -> list[tuple[int, int]]:
    counts = layer_counts(num_layers, stages, layers)
    bounds = [sum(counts[:i]) for i in range(stages + 1)]
    return list(zip(bounds[:-1], bounds[1:]))


def _head_names(model_dir: Path, names: list[str], tied: bool) -> list[str]:
    """The head file's tensors: a tied model stores no lm_head (the embedding serves as one)."""
    if tied:
        return [n for n in names if n != "lm_head.weight"]
    if "lm_head.weight" not in names:
        raise ModelError(f"{model_dir}: lm_head.weight missing and tie_word_embeddings is false")
    return names


def _write_stages(tmp: Path, source: _TensorSource, stages: list[tuple[tuple[int, int], list[str]]],
                  pack: int | None, copy: bool, bar: Bar, report: Progress) -> tuple[StageSpec, ...]:
    """One file per stage (its layers' tensors); `pack`: the int4 group size when a 16-bit source is
    packed on the way (the file then is a copy, never a reference)."""
    specs = []
    for i, ((start, end), names) in enumerate(stages):
        fname = f"stage-{i}.safetensors"
        entries = source.entries(names)
        read = sum(e.nbytes for e in entries)   # the bar counts bytes read, packed or not
        if pack is not None:
            entries = packing.pack_entries(entries, pack)
        ratio = read / max(sum(e.nbytes for e in entries), 1)
        refer = None if copy or pack is not None else source.files
        sha, size = _write_file(tmp / fname, entries, refer, _scaled(bar.advance, ratio))
        specs.append(StageSpec(i, start, end, fname, sha, size))
        report(f"wrote {fname}: layers [{start}, {end}) ({size / 1e6:.1f} MB)")
    return tuple(specs)


def _scaled(advance: Callable[[float], None], ratio: float) -> Callable[[float], None]:
    """`advance` by the bytes read for `n` bytes written (`ratio`: read per written)."""
    return lambda n: advance(n * ratio)


def _write_file(path: Path, entries: list[TensorEntry], refer: dict[str, Path | GgufTensor] | None,
                progress: Callable[[float], None]) -> tuple[str, int]:
    """Write `path`, or (`refer`: where each tensor is stored as is) its reference; (sha256, bytes)."""
    if refer is None:
        return write_safetensors(path, entries, progress=progress)
    return shard_refs.write_ref(path.with_name(path.name + shard_refs.REF_SUFFIX),
                                shard_refs.build_ref(entries, refer), progress)



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
