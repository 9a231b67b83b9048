"""Content keys for the caches: what a model directory is, as one sha256, cheap to ask again.

A cache entry made from a model (a split, the shards a stage is sent) is keyed by the model's content,
not by its directory's name: two checkpoints in directories both called `base` are different models,
and a checkpoint written again under the same path is a new one. The key of a model directory is a
manifest hash: the sha256 of each file that makes the model (weights, config, tokenizer, the marker a
converted checkpoint keeps) listed with its name and size, hashed once more.

Hashing a real checkpoint takes seconds (1.75 GB for the 1.5B), so every start must not pay it again:
`HashMemo` (`$FLOWEDGE_HOME/hashes.json`) keeps each file's sha256 with its stamp (size, mtime, ctime,
inode) and trusts it while the stamp is unchanged. The ctime and inode are there because a copy that
keeps times (`cp -p`, `rsync -t`, an archive) can bring back a size and mtime, never a ctime.
"""
from __future__ import annotations

import hashlib
import json
import logging
import os
from pathlib import Path

from flowedge.home import flowedge_home

log = logging.getLogger(__name__)

MEMO_FILE = "hashes.json"
MEMO_FORMAT = 1
SHORT = 12   # hex digits shown in `status` and used in cache directory names
# the files that make a model: weights (or references to them), config, tokenizer, the conversion marker
MODEL_SUFFIXES = (".safetensors", ".ref", ".json", ".txt", ".model", ".jinja")
_BLOCK = 8 << 20


def sha256_of(path: Path) -> str:
    """The sha256 of a file, read a few MB at a time."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(_BLOCK):
            digest.update(block)
    return digest.hexdigest()


def _stamp(path: Path) -> list[int]:
    st = path.stat()
    return [st.st_size, st.st_mtime_ns, st.st_ctime_ns, st.st_ino]


class HashMemo:
    """file -> sha256, trusted while the file's stamp is the one it was hashed with."""

    def __init__(self, path: Path) -> None:
        self.path = Path(path)
        self.files: dict[str, list] = self._read()
        self.changed = False

    def _read(self) -> dict[str, list]:
        try:
            data = json.loads(self.path.read_text())
            return dict(data["files"]) if data.get("format") == MEMO_FORMAT else {}
        except FileNotFoundError:
            return {}
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
            log.warning("ignoring the hash memo %s (%s): files are hashed again", self.path, exc)
            return {}

    def sha256(self, path: Path) -> str:
        """The file's sha256: from the memo if its stamp is unchanged, else hashed (and remembered)."""
        key, stamp = str(Path(path).resolve()), _stamp(path)
        kept = self.files.get(key)
        if isinstance(kept, list) and len(kept) == 5 and kept[:4] == stamp:
            return str(kept[4])
        if kept is not None:
            log.info("%s changed since it was hashed: hashing it again", path)
        digest = sha256_of(path)
        self.remember(path, digest, stamp)
        return digest

    def remember(self, path: Path, sha256: str, stamp: list[int] | None = None) -> None:
        """Record a sha256 known otherwise (a file just written and hashed on the way)."""
        self.files[str(Path(path).resolve())] = [*(stamp or _stamp(path)), sha256]
        self.changed = True

    def save(self) -> None:
        """Write the memo (atomically; entries of files that are gone are dropped)."""
        if not self.changed:
            return
        self.files = {k: v for k, v in self.files.items() if Path(k).is_file()}
        self.path.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.path.with_name(f".{self.path.name}.tmp-{os.getpid()}")
        tmp.write_text(json.dumps({"format": MEMO_FORMAT, "files": self.files}, indent=0) + "\n")
        os.replace(tmp, self.path)
        self.changed = False


def memo_at(home: Path | None = None) -> HashMemo:
    return HashMemo((Path(home) if home is not None else flowedge_home()) / MEMO_FILE)


def model_files(model_dir: Path) -> list[Path]:
    """The files that make the model in `model_dir` (top level, not hidden), by name."""
    return sorted(p for p in Path(model_dir).iterdir()
                  if p.is_file() and not p.name.startswith(".") and p.suffix in MODEL_SUFFIXES)


def model_sha256(model_dir: Path, memo: HashMemo | None = None) -> str:
    """The content key of a model directory: sha256 of its files' names, sizes and sha256s."""
    memo = memo or memo_at()
    digest = hashlib.sha256()
    for path in model_files(model_dir):
        digest.update(f"{path.name}\0{path.stat().st_size}\0{memo.sha256(path)}\n".encode())
    try:
        memo.save()
    except OSError as exc:   # a read-only home still serves; the next start hashes again
        log.warning("cannot save the hash memo %s: %s", memo.path, exc)
    return digest.hexdigest()


def short(sha256: str) -> str:
    """The prefix of a key that `status` and directory names show."""
    return sha256[:SHORT]
