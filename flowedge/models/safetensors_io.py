"""Streaming safetensors writing and file hashing: one tensor in memory at a time."""
from __future__ import annotations

import hashlib
import json
import struct
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from flowedge.errors import ModelError
from flowedge.models.content_hash import sha256_of as file_sha256  # noqa: F401 - this module's name for it


_DTYPE_CODES = {
    torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
    torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8",
    torch.uint8: "U8", torch.bool: "BOOL",
}
_CODE_DTYPES = {code: dtype for dtype, code in _DTYPE_CODES.items()}

@dataclass(frozen=True, slots=True)
class TensorEntry:
    """A tensor to write, described before it is loaded so the header can be written first."""

    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    load: Callable[[], torch.Tensor]

    @classmethod
    def held(cls, name: str, tensor: torch.Tensor) -> TensorEntry:
        """An entry for a tensor already in memory."""
        return cls(name, tensor.dtype, tuple(tensor.shape), lambda: tensor)

    @property
    def nbytes(self) -> int:
        count = 1
        for dim in self.shape:
            count *= dim
        return count * torch.empty((), dtype=self.dtype).element_size()


def write_safetensors(
    path: Path, entries: list[TensorEntry], metadata: dict[str, str] | None = None,
    progress: Callable[[int], None] | None = None,
) -> tuple[str, int]:
    """Stream tensors into a safetensors file one at a time; return (sha256, bytes).

    safetensors' own save_file serialises every tensor to bytes first, doubling peak memory on
    a 6 GB model; this writer holds one tensor at a time and hashes while it writes.
    """
    raw = safetensors_header(entries, metadata)
    digest = hashlib.sha256()
    with open(path, "wb") as f:
        for chunk in (struct.pack("<Q", len(raw)), raw):
            f.write(chunk)
            digest.update(chunk)
        for entry in entries:
            _write_tensor(f, digest, entry)
            if progress is not None:
                progress(entry.nbytes)
        size = f.tell()
    return digest.hexdigest(), size


def safetensors_header(entries: list[TensorEntry], metadata: dict[str, str] | None = None) -> bytes:
    """The JSON header (space-padded to 8 bytes) of a file holding `entries` in order."""
    header: dict[str, object] = {"__metadata__": metadata or {"format": "pt"}}
    offset = 0
    for entry in entries:
        if entry.dtype not in _DTYPE_CODES:
            raise ModelError(f"cannot store tensor {entry.name} of dtype {entry.dtype}")
        header[entry.name] = {"dtype": _DTYPE_CODES[entry.dtype], "shape": list(entry.shape),
                              "data_offsets": [offset, offset + entry.nbytes]}
        offset += entry.nbytes
    raw = json.dumps(header, separators=(",", ":")).encode()
    return raw + b" " * (-len(raw) % 8)


def _write_tensor(f, digest, entry: TensorEntry) -> None:
    tensor = entry.load().detach()
    if tensor.dtype != entry.dtype or tuple(tensor.shape) != entry.shape:
        raise ModelError(f"tensor {entry.name} changed while writing")
    data = tensor.contiguous().cpu().reshape(-1).view(torch.uint8).numpy()
    view = data.data   # the array's bytes, as a memoryview
    f.write(view)
    digest.update(view)


