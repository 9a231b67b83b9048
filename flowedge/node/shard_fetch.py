"""Stage shards over the wire: the head serves byte ranges, a joining stage fetches, checks and caches.

Cache layout on a stage: `$FLOWEDGE_HOME/stage-cache/<sha256 of the stage file>/` holding the side
files (config.json, manifest.json, tokenizer files) and the stage's safetensors file. It is written
under a temporary name and renamed into place only after the whole file hashed to the expected
sha256, so an interrupted fetch never leaves a half-written entry and a restart re-fetches nothing
that was complete. An entry damaged later (bit rot, a disk that filled up, a copy by hand) fails its
checksum when the stage loads it, at every assignment; `CacheRepair` then deletes the damaged file so
the next fetch replaces it, a bounded number of times (then the error stands, shown in `status`).

The stage file is keyed by its own content; its side files (config, manifest) came with the assignment
that fetched it and name the model it was cut from, so an entry reused for another model (identical
layer bytes) takes that model's side files and loses the other model's head file (`refresh_side_files`).
"""
from __future__ import annotations

import hashlib
import logging
import os
import shutil
from collections import Counter, deque
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Protocol

from flowedge.errors import ChecksumError, ModelError, ProtocolError
from flowedge.filenames import is_plain_file_name
from flowedge.models.shard_refs import RefFile, resolve_file
from flowedge.models.shards import MANIFEST, FileSpec, Manifest, StageSpec, verify_file
from flowedge.node import model_check
from flowedge.progress import Progress
from flowedge.transport import protocol as proto

log = logging.getLogger(__name__)

CHUNK_BYTES = proto.SHARD_CHUNK_BYTES
SIDE_FILES = ("config.json", "generation_config.json", MANIFEST)   # what a stage needs besides weights
IN_FLIGHT = 4            # chunk requests outstanding at once (keeps a high-latency link busy)
REPAIRS = 2              # times one damaged cached file is deleted and fetched again before its error stands


@dataclass(frozen=True)
class ShardFile:
    """What the head serves for one stage: the file, its digest and the small side files. `ref` is set
    when the split stores the file as a reference into the checkpoint (served from there, same bytes)."""
    path: Path
    sha256: str
    size: int
    side_files: dict[str, str]
    ref: RefFile | None = None


def _served(split_dir: Path, spec: FileSpec | StageSpec, side: dict[str, str]) -> ShardFile:
    stored = resolve_file(split_dir, spec.file)
    if stored is None:
        raise ModelError(f"shard {spec.file} missing from {split_dir}")
    ref = stored if isinstance(stored, RefFile) else None
    return ShardFile(split_dir / spec.file, spec.sha256, spec.bytes, side, ref)


def stage_files(split_dir: Path, stage: int) -> ShardFile:
    """The shard file of stage `stage` (1-based) in a split directory, with the config and manifest text."""
    manifest = Manifest.load(split_dir)
    spec = manifest.stages[stage - 1]
    side = {name: (split_dir / name).read_text() for name in SIDE_FILES if (split_dir / name).is_file()}
    return _served(split_dir, spec, side)


def head_file(split_dir: Path) -> ShardFile:
    """The split's head file (embedding, final norm, lm_head): what a token-choosing last stage adds."""
    manifest = Manifest.load(split_dir)
    return _served(split_dir, manifest.head, {})


def read_chunk(shard: ShardFile, req: proto.ShardRequest) -> proto.ShardChunk:
    """Head side: the requested byte range (clipped to the file) as a checksummed chunk."""
    if req.offset >= shard.size:
        raise ProtocolError(f"shard request at offset {req.offset} beyond the file's {shard.size} bytes")
    length = min(req.length, shard.size - req.offset)
    if shard.ref is not None:
        data = shard.ref.read(req.offset, length)
    else:
        with open(shard.path, "rb") as f:
            f.seek(req.offset)
            data = f.read(length)
    return proto.ShardChunk.of(req.offset, data, shard.size)


def cache_root(home: Path) -> Path:
    return home / "stage-cache"


def cached_dir(home: Path, sha256: str) -> Path | None:
    d = cache_root(home) / sha256
    return d if (d / MANIFEST).is_file() else None


def refresh_side_files(entry: Path, assign: proto.Assign) -> None:
    """Make a cache entry's side files the assignment's when its manifest names another model: the
    weights are the same bytes (same sha256), the config and the head file may not be."""
    why = model_check.manifest_mismatch(Manifest.load(entry), assign.model_sha256)
    if why is None:
        return
    log.warning("cache entry %s: %s; taking this assignment's config and manifest (the weights are the "
                "same bytes) and dropping its head file", entry, why)
    (entry / Manifest.load(entry).head.file).unlink(missing_ok=True)
    for name, text in assign.side_files.items():
        tmp = entry / f".{name}.part-{os.getpid()}"
        tmp.write_text(text)
        os.replace(tmp, entry / name)


def cached_shas(home: Path) -> list[str]:
    root = cache_root(home)
    return sorted(p.name for p in root.iterdir() if (p / MANIFEST).is_file()) if root.is_dir() else []


class ShardOrder(Protocol):
    """What a fetch reads of the message that ordered it: a stage's Assign or a drafter's DraftSetup."""

    @property
    def shard_sha256(self) -> str: ...
    @property
    def shard_bytes(self) -> int: ...
    @property
    def head_sha256(self) -> str: ...
    @property
    def head_bytes(self) -> int: ...
    @property
    def side_files(self) -> dict[str, str]: ...


def fetch(assign: ShardOrder, home: Path, request: Callable[[proto.ShardRequest], None],
          receive: Callable[[float], proto.ShardChunk | None], timeout_s: float = 60.0) -> Path:
    """Stage side: fetch the assigned shard through `request`/`receive`, verify, and cache it.

    `receive(timeout)` returns the next ShardChunk (None on timeout); chunks may come back in any
    order. Returns the cache directory holding a loadable split for this stage."""
    bad = [name for name in assign.side_files if not is_plain_file_name(name)]
    if bad:   # Assign refuses these on decode already; a stage never writes outside its cache entry
        raise ProtocolError(f"assignment names side file {proto.quote(bad[0])}: only plain file names")
    final = cache_root(home) / assign.shard_sha256
    tmp = final.parent / f".{assign.shard_sha256}.part-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    try:
        for name, text in assign.side_files.items():
            (tmp / name).write_text(text)
        stage_file = _stage_file_name(tmp, assign)
        _download(assign.shard_sha256, assign.shard_bytes, tmp / stage_file, request, receive, timeout_s)
        if final.exists():
            shutil.rmtree(final)
        os.replace(tmp, final)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return final


def _stage_file_name(split_dir: Path, assign: ShardOrder) -> str:
    if not (split_dir / MANIFEST).is_file():
        raise ProtocolError("assignment carries no manifest.json: cannot place the shard")
    try:
        manifest = Manifest.load(split_dir)   # refuses file names that would leave the cache entry
    except ModelError as err:
        raise ProtocolError(f"the head's manifest: {err}") from None
    for spec in manifest.stages:
        if spec.sha256 == assign.shard_sha256:
            return spec.file
    raise ProtocolError("assigned shard sha256 is not in the head's manifest")


def fetch_head_file(assign: ShardOrder, shard_dir: Path, request: Callable[[proto.ShardRequest], None],
                    receive: Callable[[float], proto.ShardChunk | None], timeout_s: float = 60.0) -> None:
    """Stage side, last stage only: add the split's head file to a cached shard directory (fetched
    under a temporary name, renamed into place once it hashed to `assign.head_sha256`)."""
    name = Manifest.load(shard_dir).head.file
    final = shard_dir / name
    if final.is_file() and final.stat().st_size == assign.head_bytes:
        return   # verified once on arrival; StageModel.load checks its sha256 again
    log.info("fetching the lm_head file %s… (%d MB) from the head", assign.head_sha256[:12],
             assign.head_bytes >> 20)
    tmp = shard_dir / f".{name}.part-{os.getpid()}"
    try:
        _download(assign.head_sha256, assign.head_bytes, tmp, request, receive, timeout_s)
        os.replace(tmp, final)
    finally:
        tmp.unlink(missing_ok=True)


def _download(sha256: str, total: int, path: Path, request, receive, timeout_s: float) -> None:
    """Fetch the file `sha256` (`total` bytes) into `path`; the requests name it, so the head can serve
    a stage more than its shard (a 1.1 head ignores the name and serves the shard)."""
    offsets = deque(range(0, total, CHUNK_BYTES))
    pending: set[int] = set()
    done_bytes = 0
    bar = Progress(f"fetching shard {sha256[:12]}", total)
    with open(path, "wb") as f:
        f.truncate(total)
        while offsets or pending:
            while offsets and len(pending) < IN_FLIGHT:
                off = offsets.popleft()
                request(proto.ShardRequest(offset=off, length=CHUNK_BYTES, sha256=sha256))
                pending.add(off)
            chunk = receive(timeout_s)
            if chunk is None:
                raise ProtocolError(f"shard fetch stalled: no chunk for {timeout_s:.0f} s "
                                    f"({done_bytes}/{total} bytes)")
            if chunk.offset not in pending or chunk.total != total:
                log.warning("ignoring unexpected shard chunk at offset %d", chunk.offset)
                continue
            chunk.verify()
            f.seek(chunk.offset)
            f.write(chunk.data)
            pending.discard(chunk.offset)
            done_bytes += len(chunk.data)
            bar.update(done_bytes)
    bar.finish()
    digest = hashlib.sha256()   # whole-file digest once every chunk has landed
    with open(path, "rb") as f:
        while block := f.read(8 << 20):
            digest.update(block)
    if digest.hexdigest() != sha256:
        raise ChecksumError(f"fetched shard hashes to {digest.hexdigest()[:16]}…, "
                            f"head announced {sha256[:16]}…")


def damaged_files(entry: Path, assign: proto.Assign) -> list[str]:
    """sha256s of the assigned files in a cache entry that are missing or fail their size or checksum."""
    manifest = Manifest.load(entry)
    specs: list[StageSpec | FileSpec] = [s for s in manifest.stages if s.sha256 == assign.shard_sha256]
    specs += [manifest.head] if assign.head_sha256 else []
    bad = []
    for spec in specs:
        try:
            verify_file(entry / spec.file, spec)
        except (ChecksumError, OSError):
            bad.append(spec.sha256)
    return bad


class CacheRepair:
    """Deletes a cached file that failed its checksum so the next fetch replaces it; `limit` times per
    file, after which the error stands: a device whose storage keeps corrupting what it writes stops
    fetching, and the head shows the error next to the stage in `status`."""

    def __init__(self, home: Path, limit: int = REPAIRS) -> None:
        self.home, self.limit = home, limit
        self.repaired: Counter[str] = Counter()   # sha256 -> times deleted for a fresh fetch

    def repair(self, entry: Path, assign: proto.Assign, err: ChecksumError) -> None:
        """`err` came from loading `entry`: delete what in it is damaged, or raise ChecksumError when
        there is nothing this stage may repair (the head's own files, or repaired `limit` times)."""
        if entry.parent != cache_root(self.home):
            raise ChecksumError(f"{err} (in the head's split {entry}: the head's copy is damaged)")
        bad = damaged_files(entry, assign)
        if not bad:
            raise err
        if any(self.repaired[sha] >= self.limit for sha in bad):
            raise ChecksumError(f"{err}; deleted and fetched again {self.limit} times and still damaged: "
                                f"check this device's storage")
        for sha in bad:
            self.repaired[sha] += 1
            log.warning("cached file %s… in %s failed its checksum (%s): deleted, fetching it again (%d of %d)",
                        sha[:12], entry, err, self.repaired[sha], self.limit)
        if assign.shard_sha256 in bad:
            shutil.rmtree(entry)   # the whole entry: shard, side files and head file come again
        else:
            (entry / Manifest.load(entry).head.file).unlink(missing_ok=True)
