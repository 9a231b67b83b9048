"""16-bit tensors read from a GGUF the cache keeps, instead of a second copy on disk.

A W4A16 checkpoint converted from a registry GGUF stores no 16-bit embedding or lm_head: those are
~0.5 GB each for the real 1.5B, and the GGUF beside it already holds them as Q4_K..Q8_0 blocks. The
checkpoint's flowedge.json records where they are (GGUF file + sha256, tensor name, byte offset, block
type, shape, the 16-bit dtype) and every loader dequantises them on read with the `gguf` package's
`dequantize` - the function transformers itself calls - then casts to the recorded dtype, which gives
the very tensor a copy would hold: the converter itself reads every tensor through this class
(models/convert.py), and a format-2 migration checks its copies with torch.equal. GGUF rows are
whole quantization blocks, so any row range can be dequantised alone: loads and byte-range reads go
a few thousand rows at a time, never a float32 copy of the whole matrix. An embedding held this way
stays in the GGUF even in memory (`GgufEmbedding`: a lookup dequantises only the rows it is asked
for, through mmap).
"""
from __future__ import annotations

import json
import logging
import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from flowedge.errors import ModelError
from flowedge.models.safetensors_io import file_sha256

log = logging.getLogger(__name__)

MARKER_KEY = "gguf_tensors"
# Hugging Face name -> GGUF name for the tensors worth referencing (the standard llama.cpp names).
HF_TO_GGUF = {"model.embed_tokens.weight": "token_embd.weight", "lm_head.weight": "output.weight"}
_CHUNK_ROWS = 4096   # 25 MB of float32 per dequantised chunk for the real 1.5B
_DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16}
_verified: dict[tuple[str, int, int], str] = {}   # (path, size, mtime_ns) -> sha256, per process


@dataclass(frozen=True, slots=True)
class GgufTensor:
    """One GGUF tensor as the 16-bit [rows, cols] matrix the converter would have stored."""
    name: str            # Hugging Face name
    path: Path           # the GGUF file
    tensor: str          # its name in the GGUF
    qtype: int           # gguf.GGMLQuantizationType value
    offset: int          # absolute byte offset of its blocks in the file
    rows: int
    cols: int
    dtype: torch.dtype   # float16, or bfloat16 where float16 overflowed (float32 while converting)

    @property
    def shape(self) -> tuple[int, int]:
        return (self.rows, self.cols)

    @property
    def row_nbytes(self) -> int:
        """Bytes per row as stored (16-bit)."""
        return self.cols * torch.empty((), dtype=self.dtype).element_size()

    @property
    def nbytes(self) -> int:
        return self.rows * self.row_nbytes

    def _quant_row_bytes(self) -> int:
        from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

        block, size = GGML_QUANT_SIZES[GGMLQuantizationType(self.qtype)]
        return self.cols // block * size

    def block_rows(self, start: int = 0, end: int | None = None) -> np.ndarray:
        """The quantized blocks of rows [start, end), mapped from the file: [rows, bytes per row] uint8."""
        width = self._quant_row_bytes()
        end = self.rows if end is None else end
        try:
            return np.memmap(self.path, np.uint8, "r", offset=self.offset + start * width, shape=(end - start, width))
        except (OSError, ValueError) as exc:
            raise ModelError(f"cannot read {self.tensor} from {self.path}: {exc}") from None

    def dequantize(self, blocks: np.ndarray) -> torch.Tensor:
        """Rows of blocks -> float32 (gguf.dequantize, as transformers) -> self.dtype, [rows, cols]."""
        return torch.from_numpy(self._float32(blocks)).to(self.dtype)

    def _float32(self, blocks: np.ndarray) -> np.ndarray:
        from gguf import GGMLQuantizationType, dequantize

        try:
            values = dequantize(blocks, GGMLQuantizationType(self.qtype)).reshape(blocks.shape[0], self.cols)
        except NotImplementedError:
            raise ModelError(f"{self.path.name}: {self.tensor} is stored as "
                             f"{GGMLQuantizationType(self.qtype).name}, which gguf cannot dequantise") from None
        return values if values.flags.writeable else values.copy()   # F32 blocks: a view of the mapped file

    def max_abs(self) -> float:
        """max |value| of the float32 dequantised matrix (NaN if it holds one), a chunk at a time: what
        decides whether it fits float16."""
        peaks = [np.abs(self._float32(self.block_rows(start, min(start + _CHUNK_ROWS, self.rows)))).max()
                 for start in range(0, self.rows, _CHUNK_ROWS)]
        return float(np.max(peaks)) if peaks else 0.0

    def rows_tensor(self, start: int, end: int) -> torch.Tensor:
        """Rows [start, end) dequantised."""
        return self.dequantize(self.block_rows(start, end))

    def load(self, as_dtype: torch.dtype | None = None) -> torch.Tensor:
        """The whole matrix; `as_dtype` casts the 16-bit values chunk by chunk (an lm_head loaded as
        float32 never has its 16-bit copy and its float32 copy in memory at once)."""
        out = torch.empty(self.shape, dtype=as_dtype or self.dtype)
        for start in range(0, self.rows, _CHUNK_ROWS):
            end = min(start + _CHUNK_ROWS, self.rows)
            out[start:end] = self.rows_tensor(start, end)
        return out

    def read(self, offset: int, length: int) -> bytes:
        """Bytes [offset, offset + length) of the tensor's 16-bit little-endian data."""
        first, last = offset // self.row_nbytes, -(-(offset + length) // self.row_nbytes)
        data = self.rows_tensor(first, min(last, self.rows)).reshape(-1).view(torch.uint8).numpy()
        lo = offset - first * self.row_nbytes
        return data[lo:lo + length].tobytes()

    def blocks(self) -> Iterator[bytes]:
        """The whole 16-bit data, front to back, a few MB at a time."""
        for start in range(0, self.rows, _CHUNK_ROWS):
            rows = self.rows_tensor(start, min(start + _CHUNK_ROWS, self.rows))
            yield rows.reshape(-1).view(torch.uint8).numpy().tobytes()

    def to_json(self) -> dict:
        return {"tensor": self.tensor, "qtype": self.qtype, "offset": self.offset,
                "shape": [self.rows, self.cols], "dtype": str(self.dtype).removeprefix("torch.")}

    @classmethod
    def from_json(cls, name: str, path: Path, data: dict) -> GgufTensor:
        try:
            rows, cols = (int(d) for d in data["shape"])
            return cls(name, Path(path), str(data["tensor"]), int(data["qtype"]), int(data["offset"]),
                       rows, cols, _DTYPES[data["dtype"]])
        except (KeyError, TypeError, ValueError) as exc:
            raise ModelError(f"invalid GGUF tensor record for {name}: {exc!r}") from None


class GgufEmbedding(torch.nn.Module):
    """An embedding lookup straight from the GGUF's blocks: only the looked-up rows are dequantised (the
    same values as GgufTensor.load()[ids]), so the 16-bit matrix (0.47 GB for the real 1.5B) is never
    held in memory; the file's pages come and go through the page cache."""

    def __init__(self, tensor: GgufTensor) -> None:
        super().__init__()
        self.tensor = tensor
        self._blocks = tensor.block_rows()
        self.num_embeddings, self.embedding_dim = tensor.shape

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        flat = ids.detach().reshape(-1).cpu().numpy()
        if flat.size and (flat.min() < 0 or flat.max() >= self.num_embeddings):
            raise IndexError(f"token id out of range [0, {self.num_embeddings})")
        rows = self.tensor.dequantize(np.ascontiguousarray(self._blocks[flat]))
        return rows.reshape(*ids.shape, self.embedding_dim).to(ids.device)


def read_tensor(source: Path | GgufTensor, name: str, dtype: torch.dtype | None = None) -> torch.Tensor:
    """Tensor `name` from a safetensors file or, dequantised, from its GGUF; cast to `dtype` if given
    (the same values either way: the stored 16-bit ones, cast)."""
    if isinstance(source, GgufTensor):
        return source.load(dtype)
    from safetensors import safe_open

    with safe_open(str(source), framework="pt") as f:
        t = f.get_tensor(name)
    return t if dtype is None else t.to(dtype)


def locate(gguf: Path, wanted: dict[str, torch.dtype]) -> dict[str, GgufTensor]:
    """GgufTensors for the HF names in `wanted` (name -> 16-bit dtype) that the GGUF holds as a 2-D matrix."""
    from gguf import GGUFReader

    try:
        by_name = {t.name: t for t in GGUFReader(gguf).tensors}
    except (OSError, ValueError, IndexError, KeyError) as exc:   # unreadable here: the caller keeps copies
        log.warning("cannot index the tensors of %s (%s); storing 16-bit copies instead", gguf, exc)
        return {}
    out = {}
    for name, dtype in wanted.items():
        t = by_name.get(HF_TO_GGUF.get(name, ""))
        if t is None or len(t.shape) != 2:
            continue
        cols, rows = (int(d) for d in t.shape)   # GGUF lists the fastest-moving dimension first
        out[name] = GgufTensor(name, Path(gguf).resolve(), t.name, int(t.tensor_type), int(t.data_offset),
                               rows, cols, dtype)
    return out


def file_record(gguf: Path, sha256: str, base: Path) -> dict:
    """What a checkpoint records about the GGUF it reads from: where (relative to `base`, and absolute),
    which (sha256) and the size/mtime that let a load skip re-hashing an untouched file."""
    st = Path(gguf).stat()
    _verified[(str(Path(gguf).resolve()), st.st_size, st.st_mtime_ns)] = sha256
    return {"file": os.path.relpath(Path(gguf).resolve(), Path(base).resolve()), "path": str(Path(gguf).resolve()),
            "sha256": sha256, "bytes": st.st_size, "mtime_ns": st.st_mtime_ns}


def checkpoint_tensors(model_dir: Path) -> dict[str, GgufTensor]:
    """The GGUF-held tensors of a converted checkpoint (none for any other directory), after checking
    that the GGUF is still there and unchanged; a clear ModelError otherwise."""
    marker_path = Path(model_dir) / "flowedge.json"
    try:
        marker = json.loads(marker_path.read_text())
    except (FileNotFoundError, ValueError):
        return {}
    records = marker.get(MARKER_KEY) if isinstance(marker, dict) else None
    if not records:
        return {}
    gguf = check_gguf(model_dir, marker)
    return {name: GgufTensor.from_json(name, gguf, rec) for name, rec in records["tensors"].items()}


def check_gguf(model_dir: Path, marker: dict) -> Path:
    """The GGUF a checkpoint reads from, if present with its recorded sha256 (hashed again only when its
    size or mtime changed); else a ModelError saying what to do."""
    rec = marker[MARKER_KEY]
    source = marker.get("source", "the model")
    redo = (f"run `flowedge models pull {source}` (or any command using the model) to fetch it "
            f"and convert again" if not str(source).endswith(".gguf") else f"delete {model_dir} to convert again")
    gguf = next((p for p in (Path(model_dir) / rec["file"], Path(rec["path"])) if p.is_file()), None)
    if gguf is None:
        raise ModelError(f"{model_dir} reads its embedding/lm_head from {rec['path']}, which is missing: {redo}")
    gguf = gguf.resolve()
    st = gguf.stat()
    key = (str(gguf), st.st_size, st.st_mtime_ns)
    if _verified.get(key) == rec["sha256"] or (st.st_size, st.st_mtime_ns) == (rec["bytes"], rec["mtime_ns"]):
        return gguf
    log.info("%s changed on disk since conversion; checking its sha256", gguf)
    actual = file_sha256(gguf)
    if actual != rec["sha256"]:
        _forget_verified(gguf)
        raise ModelError(f"{gguf} was altered (sha256 {actual[:16]}…, converted from {rec['sha256'][:16]}…): "
                         f"{model_dir} cannot read its embedding/lm_head from it; {redo}")
    _verified[key] = actual
    return gguf


def _forget_verified(gguf: Path) -> None:
    """Drop the registry's 'verified' sidecar of an altered GGUF, so the next pull hashes and fetches it."""
    Path(str(gguf) + ".sha256").unlink(missing_ok=True)

