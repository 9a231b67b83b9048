"""Referenced shard files: a stage or head file described as byte ranges of the model's checkpoint.

A split that stores its tensors exactly as the checkpoint does (a W4A16 split of a W4A16 checkpoint,
a 16-bit split of a 16-bit one, every head file) would otherwise copy 1.75 GB of the real 1.5B model
into the shard directory. Instead it writes `<file>.ref` beside the manifest: the safetensors header
the copied file would have had, and for each tensor (in file order) the checkpoint file and byte
range holding its data. The file a stage fetches, checksums and loads is unchanged - the head streams
header + ranges (same bytes, same sha256 as a copy), a stage on the head's host reads the tensors from
the checkpoint through safetensors' mmap, and a stage elsewhere receives an ordinary file.
A tensor the checkpoint itself reads from its GGUF (flowedge.models.gguf_tensors: the embedding and
lm_head of a registry model) is a GGUF segment: its 16-bit bytes are dequantised from the GGUF's
blocks on read, rows at a time, and are the bytes a copy would hold.
"""
from __future__ import annotations

import bisect
import hashlib
import json
import os
import struct
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

from flowedge.errors import ModelError
from flowedge.models.gguf_tensors import GgufTensor
from flowedge.models.safetensors_io import _DTYPE_CODES, TensorEntry, safetensors_header

REF_SUFFIX = ".ref"
REF_FORMAT = 1
_BLOCK = 8 << 20


@dataclass(frozen=True, slots=True)
class Segment:
    """One tensor's data: `length` bytes at absolute `offset` in the checkpoint file `source`, or (a
    GgufTensor source, offset 0) the tensor's 16-bit bytes dequantised from its GGUF."""
    name: str
    source: Path | GgufTensor
    offset: int
    length: int

    @property
    def file(self) -> Path:
        """The file on disk this segment's bytes come from."""
        return self.source.path if isinstance(self.source, GgufTensor) else self.source

    def read(self, start: int, length: int) -> bytes:
        """`length` bytes from `start` within this tensor's data."""
        if isinstance(self.source, GgufTensor):
            return self.source.read(start, length)
        with open(self.source, "rb") as f:
            f.seek(self.offset + start)
            return f.read(length)

    def blocks(self) -> Iterator[bytes]:
        if isinstance(self.source, GgufTensor):
            yield from self.source.blocks()
            return
        with open(self.source, "rb") as f:
            f.seek(self.offset)
            left = self.length
            while left > 0:
                block = f.read(min(_BLOCK, left))
                if not block:
                    raise ModelError(f"{self.source} ended inside tensor {self.name}")
                left -= len(block)
                yield block


@dataclass(frozen=True, slots=True)
class RefFile:
    """A safetensors file that exists only as its header plus ranges of other files."""
    prefix: bytes                        # the 8-byte header length and the header itself
    segments: tuple[Segment, ...]

    @property
    def size(self) -> int:
        return len(self.prefix) + sum(s.length for s in self.segments)

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(s.name for s in self.segments)

    def read(self, offset: int, length: int) -> bytes:
        """Bytes [offset, offset + length) of the file (clipped to its end), as a copy would hold them."""
        out = bytearray()
        end = min(offset + length, self.size)
        if offset < len(self.prefix):
            out += self.prefix[offset:min(end, len(self.prefix))]
        starts = self._starts()
        i = max(bisect.bisect_right(starts, max(offset, len(self.prefix))) - 1, 0)
        while i < len(self.segments) and starts[i] < end:
            seg, lo = self.segments[i], max(offset, starts[i])
            hi = min(end, starts[i] + seg.length)
            if hi > lo:
                out += seg.read(lo - starts[i], hi - lo)
            i += 1
        return bytes(out)

    def _starts(self) -> list[int]:
        starts, pos = [], len(self.prefix)
        for seg in self.segments:
            starts.append(pos)
            pos += seg.length
        return starts

    def blocks(self) -> Iterator[bytes]:
        """The whole file, front to back, a few MB at a time."""
        yield self.prefix
        for seg in self.segments:
            yield from seg.blocks()

    def sha256(self) -> str:
        digest = hashlib.sha256()
        for block in self.blocks():
            digest.update(block)
        return digest.hexdigest()


def tensor_locations(path: Path) -> dict[str, tuple[str, tuple[int, ...], int, int]]:
    """name -> (dtype code, shape, absolute data offset, bytes) from a safetensors file's header."""
    try:
        with open(path, "rb") as f:
            (n,) = struct.unpack("<Q", f.read(8))
            header = json.loads(f.read(n))
    except (OSError, struct.error, ValueError) as exc:
        raise ModelError(f"cannot read the safetensors header of {path}: {exc}") from None
    base = 8 + n
    return {name: (info["dtype"], tuple(info["shape"]), base + info["data_offsets"][0],
                   info["data_offsets"][1] - info["data_offsets"][0])
            for name, info in header.items() if name != "__metadata__"}


def build_ref(entries: Iterable[TensorEntry], files: dict[str, Path | GgufTensor]) -> RefFile:
    """The RefFile whose bytes equal `write_safetensors(entries)`: each entry's data read in place from
    `files[name]` (a safetensors file or a GGUF tensor), where it must be stored with the same dtype
    and shape."""
    entries = list(entries)
    headers: dict[Path, dict] = {}
    segments = []
    for entry in entries:
        held = files[entry.name]
        if isinstance(held, GgufTensor):
            if (held.dtype, held.shape) != (entry.dtype, entry.shape):
                raise ModelError(f"{entry.name} in {held.path} is not read as {entry.dtype} {entry.shape}")
            segments.append(Segment(entry.name, held, 0, held.nbytes))
            continue
        source = Path(held).resolve()
        located = headers.setdefault(source, tensor_locations(source))[entry.name]
        if located[:2] != (_DTYPE_CODES.get(entry.dtype), entry.shape) or located[3] != entry.nbytes:
            raise ModelError(f"{entry.name} in {source} is not stored as {entry.dtype} {entry.shape}")
        segments.append(Segment(entry.name, source, located[2], located[3]))
    header = safetensors_header(entries)
    return RefFile(struct.pack("<Q", len(header)) + header, tuple(segments))


def write_ref(path: Path, ref: RefFile, progress: Callable[[int], None] | None = None) -> tuple[str, int]:
    """Store `ref` as JSON at `path` and return (sha256, bytes) of the file it stands for. Checkpoint
    paths are kept relative to the ref's directory (the shard and model directories move together
    inside $FLOWEDGE_HOME), absolute as the fallback."""
    digest = hashlib.sha256()
    for block in ref.blocks():
        digest.update(block)
        if progress is not None:
            progress(len(block))
    base = path.parent.resolve()
    data = {
        "ref_format": REF_FORMAT, "bytes": ref.size, "header": ref.prefix[8:].decode("ascii"),
        "tensors": [_segment_row(s, base) for s in ref.segments],
        "sources": {str(src): _identity(src) for src in {s.file for s in ref.segments}},
    }
    path.write_text(json.dumps(data, separators=(",", ":")) + "\n")
    return digest.hexdigest(), ref.size


def _segment_row(seg: Segment, base: Path) -> list | dict:
    """A file segment as [name, relative path, absolute path, offset, length]; a GGUF one as a dict."""
    if isinstance(seg.source, GgufTensor):
        return {"name": seg.name, "gguf": os.path.relpath(seg.file, base), "path": str(seg.file),
                **seg.source.to_json()}
    return [seg.name, os.path.relpath(seg.source, base), str(seg.source), seg.offset, seg.length]


def _gguf_segment(row: dict, ref_path: Path) -> Segment:
    source = _existing(Path(ref_path).parent / row["gguf"], Path(row["path"]), ref_path, row["name"])
    tensor = GgufTensor.from_json(str(row["name"]), source, row)
    return Segment(tensor.name, tensor, 0, tensor.nbytes)


def read_ref(path: Path) -> RefFile:
    """Load a `.ref`, checking that each checkpoint still holds each tensor at the recorded range (a
    re-converted checkpoint fails here or, if only its bytes changed, at the sha256 check)."""
    try:
        data = json.loads(Path(path).read_text())
        if data["ref_format"] != REF_FORMAT:
            raise ValueError(f"ref_format {data['ref_format']} unsupported")
        header = data["header"].encode("ascii")
        rows = [row if isinstance(row, dict) else tuple(row) for row in data["tensors"]]
        ggufs = {i: _gguf_segment(row, path) for i, row in enumerate(rows) if isinstance(row, dict)}
        files = [(i, str(n), str(rel), str(absolute), int(off), int(length))
                 for i, row in enumerate(rows) if not isinstance(row, dict)
                 for n, rel, absolute, off, length in [row]]
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise ModelError(f"invalid shard reference {path}: {exc!r}") from None
    segments = dict(ggufs)
    headers: dict[Path, dict[str, tuple[str, tuple[int, ...], int, int]]] = {}
    for i, name, rel, absolute, offset, length in files:
        source = _existing(Path(path).parent / rel, Path(absolute), path, name)
        located = headers.setdefault(source, tensor_locations(source)).get(name)
        if located is None or located[2:] != (offset, length):
            raise ModelError(f"{path.name} refers to {name} in {source}, which no longer holds it there "
                             "(the checkpoint was converted again): split again")
        segments[i] = Segment(name, source, offset, length)
    ref = RefFile(struct.pack("<Q", len(header)) + header, tuple(segments[i] for i in range(len(rows))))
    if ref.size != data.get("bytes", ref.size):
        raise ModelError(f"invalid shard reference {path}: sizes disagree")
    return ref


def _existing(relative: Path, absolute: Path, ref_path: Path, name: str) -> Path:
    for candidate in (relative, absolute):
        if candidate.is_file():
            return candidate.resolve()
    raise ModelError(f"{ref_path.name} refers to {name} in {absolute}, which is missing: split again "
                     "(`flowedge split --copy` writes a self-contained directory)")


def resolve_file(shard_dir: Path, name: str) -> Path | RefFile | None:
    """A shard file as stored in `shard_dir`: the file itself, its reference, or None."""
    path = Path(shard_dir) / name
    if path.is_file():
        return path
    ref = path.with_name(name + REF_SUFFIX)
    return read_ref(ref) if ref.is_file() else None


def _identity(path: Path) -> list[int]:
    """Which file this is (inode, size, mtime): a checkpoint converted again is a new file, even where
    its layout, and so every recorded offset, is unchanged."""
    st = Path(path).stat()
    return [st.st_ino, st.st_size, st.st_mtime_ns]


def all_resolve(shard_dir: Path, names: list[str]) -> bool:
    """True when some of `names` are stored as references and every such reference still points into
    the very checkpoint files it was made from (so reusing the split cannot fail its sha256 check)."""
    refs = [Path(shard_dir) / (n + REF_SUFFIX) for n in names]
    try:
        for r in (r for r in refs if r.is_file()):
            sources = json.loads(r.read_text()).get("sources", {})
            if any(sources.get(str(s)) != _identity(s) for s in {seg.file for seg in read_ref(r).segments}):
                return False
        return any(r.is_file() for r in refs)
    except (ModelError, OSError, ValueError):
        return False


def ref_tensor_files(shard_dir: Path, skip: set[str]) -> dict[str, Path | GgufTensor]:
    """name -> checkpoint file (or GGUF tensor) for the tensors of every `.ref` in `shard_dir` whose
    file is not itself present (a present file, e.g. fetched, wins)."""
    out: dict[str, Path | GgufTensor] = {}
    for ref_path in sorted(Path(shard_dir).glob("*.safetensors" + REF_SUFFIX)):
        if ref_path.name.removesuffix(REF_SUFFIX) in skip:
            continue
        out.update({s.name: s.source for s in read_ref(ref_path).segments})
    return out
