"""W4A16 at rest: which tensors of a checkpoint are stored 4-bit packed, and the entries that write them.

A decoder layer's Linear weights (the 2-D `model.layers.N.*.weight` tensors) are stored as
`<prefix>.qweight`, `<prefix>.scales` and `<prefix>.zeros` (flowedge.models.quant.PackedInt4, a layout
every device repacks for its own kernel while loading); those a GGUF held at 6-8 bits are stored W8A16
instead, as `<prefix>.qweight8` and `<prefix>.scales8` (flowedge.models.quant8.PackedInt8); everything
else (embedding, norms, biases, lm_head) stays at 16 bits. A weight whose shape some kernel cannot take
stays at 16 bits too.
"""
from __future__ import annotations

import re
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass

import torch

from flowedge.errors import ConfigError
from flowedge.models.quant import DEFAULT_GROUP_SIZE, GROUP_SIZES, PackedInt4, pack_int4, packable
from flowedge.models.quant8 import GROUP_SIZE as GROUP_SIZE_8
from flowedge.models.quant8 import PackedInt8
from flowedge.models.safetensors_io import TensorEntry

QUANT_FORMATS = ("none", "int4")
PACKED_SUFFIXES = (".qweight", ".scales", ".zeros")
PACKED8_SUFFIXES = (".qweight8", ".scales8")
_LAYER_LINEAR_RE = re.compile(r"^model\.layers\.\d+\..+\.weight$")


def storage_quant(quant: str) -> str:
    """The format a run-time quantization is stored in: int4 (and auto) packed, anything else 16-bit."""
    return "int4" if quant in ("int4", "auto") else "none"


def check_group_size(group_size: int) -> None:
    if group_size not in GROUP_SIZES:
        raise ConfigError(f"int4 group size must be one of {GROUP_SIZES}, got {group_size}")


def is_layer_linear(name: str, shape: tuple[int, ...]) -> bool:
    return len(shape) == 2 and _LAYER_LINEAR_RE.match(name) is not None


def packs(name: str, shape: tuple[int, ...], group_size: int) -> bool:
    """Whether a W4A16 checkpoint stores this (floating-point) tensor packed."""
    return is_layer_linear(name, shape) and packable(shape[0], shape[1], group_size) is None


def quant_of(names: Iterable[str]) -> str:
    """The storage format of a checkpoint, read from its tensor names."""
    return "int4" if any(n.endswith((".qweight", ".qweight8")) for n in names) else "none"


def packed_prefixes(names: Iterable[str]) -> set[str]:
    """Prefixes of the W4A16 weights."""
    return {n[: -len(".qweight")] for n in names if n.endswith(".qweight")}


def packed8_prefixes(names: Iterable[str]) -> set[str]:
    """Prefixes of the W8A16 weights."""
    return {n[: -len(".qweight8")] for n in names if n.endswith(".qweight8")}


@dataclass(frozen=True, slots=True)
class Packer:
    """How one weight is packed otherwise than from its 16-bit value: `bits` 4 (W4A16) or 8 (W8A16), and
    the packed weight, computed when the writer reaches it."""

    bits: int
    pack: Callable[[], PackedInt4 | PackedInt8]


def pack_entries(entries: Iterable[TensorEntry], group_size: int = DEFAULT_GROUP_SIZE,
                 store_dtype: Callable[[TensorEntry], torch.dtype] | None = None,
                 packers: Mapping[str, Packer] | None = None) -> list[TensorEntry]:
    """Entries of a W4A16 checkpoint: layer Linear weights packed, the rest kept (cast to `store_dtype`
    when given). A packed weight is quantized from its 16-bit stored value, so packing a 16-bit
    checkpoint at load time gives the same codes; the weights named in `packers` are packed by it (the
    converter: a GGUF's own 4-bit grid, or W8A16 for what the GGUF keeps at 6-8 bits)."""
    check_group_size(group_size)
    packers = packers or {}
    out: list[TensorEntry] = []
    for entry in entries:
        dtype = store_dtype(entry) if store_dtype else entry.dtype
        load = _cast(entry.load, dtype) if dtype != entry.dtype else entry.load
        packer = packers.get(entry.name)
        if packer is None and entry.dtype.is_floating_point and packs(entry.name, entry.shape, group_size):
            packer = Packer(4, _int4_of(load, group_size))
        if packer is None:
            out.append(TensorEntry(entry.name, dtype, entry.shape, load))
        elif packer.bits == 8:
            out += _packed8(entry.name, entry.shape, packer.pack)
        else:
            out += _packed(entry.name, entry.shape, packer.pack, group_size)
    return out


def _cast(load: Callable[[], torch.Tensor], dtype: torch.dtype) -> Callable[[], torch.Tensor]:
    return lambda: load().to(dtype)


def _int4_of(load: Callable[[], torch.Tensor], group_size: int) -> Callable[[], PackedInt4]:
    return lambda: pack_int4(load().float(), group_size)


class _OnePack:
    """Packs one weight once for its entries (written in a row) and lets go after the last."""

    def __init__(self, pack: Callable[[], PackedInt4 | PackedInt8]) -> None:
        self.pack = pack
        self.value: PackedInt4 | PackedInt8 | None = None

    def part(self, field: str, last: bool = False) -> Callable[[], torch.Tensor]:
        def get() -> torch.Tensor:
            if self.value is None:
                self.value = self.pack()
            tensor = getattr(self.value, field)
            if last:
                self.value = None
            return tensor
        return get


def _packed(name: str, shape: tuple[int, ...], pack, group_size: int) -> list[TensorEntry]:
    n, k = shape
    prefix = name[: -len(".weight")]
    one = _OnePack(pack)
    groups = k // group_size
    return [TensorEntry(prefix + ".qweight", torch.uint8, (n, k // 2), one.part("qweight")),
            TensorEntry(prefix + ".scales", torch.bfloat16, (n, groups), one.part("scales")),
            TensorEntry(prefix + ".zeros", torch.bfloat16, (n, groups), one.part("zeros", last=True))]


def _packed8(name: str, shape: tuple[int, ...], pack) -> list[TensorEntry]:
    n, k = shape
    prefix = name[: -len(".weight")]
    one = _OnePack(pack)
    return [TensorEntry(prefix + ".qweight8", torch.int8, (n, k), one.part("qweight")),
            TensorEntry(prefix + ".scales8", torch.float32, (n, k // GROUP_SIZE_8), one.part("scales", last=True))]
