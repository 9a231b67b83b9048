"""GGUF -> the checkpoint flowedge loads: config.json, tokenizer and one model.safetensors, streamed.

The first start of a board converts its GGUF once, so the conversion must fit the board: the GGUF is
read tensor by tensor (models/gguf_model.py) and each tensor is dequantised, cast to 16 bits, packed
(W4A16) and written before the next is read. No model is built: config.json comes from the GGUF's
metadata; only the tokenizer comes from transformers' GGUF tokenizer conversion, which reads the
metadata alone (about 0.5 GB at its peak for the real pair's 152k-token vocabulary, freed before
any tensor is read). Peak for the real 1.5B: see docs/bench/w4a16-memory.md.

The values are those transformers' GGUF loading gave, bit for bit: gguf.dequantize to float32, the
Llama q/k rows put back in Hugging Face order, then float16 (bfloat16 for a tensor beyond the float16
range). A packed layer Linear leaves its GGUF blocks as close to them as the stored formats allow:
- 6-8 bit codes (WIDE_TYPES: Q6_K, Q8_0, what llama.cpp's mixes keep wide because it matters): W8A16
  from the float32 values (a Q8_0 block keeps its own codes);
- 4-bit codes on a 16-level grid per 32 inputs (Q4_K, Q4_0, Q4_1): W4A16 on that very grid
  (models/gguf_grid.py: the codes are the GGUF's, only scale and zero are rounded to bfloat16);
- anything else (Q5_*, F16, F32): W4A16 re-quantized from the 16-bit values, as "4-bit weights at
  rest" promises (a float tensor says nothing of what matters).
"""
from __future__ import annotations

import json
import logging
import os
import shutil
import time
from functools import partial
from pathlib import Path

import torch

from flowedge.errors import ModelError
from flowedge.models import gguf_grid, gguf_tensors
from flowedge.models.gguf_model import GgufModel, GgufSource, read_gguf
from flowedge.models.packing import Packer, pack_entries, packs
from flowedge.models.quant import DEFAULT_GROUP_SIZE
from flowedge.models.quant8 import pack_int8, packable8
from flowedge.models.safetensors_io import TensorEntry, write_safetensors
from flowedge.progress import Progress, Ticker

log = logging.getLogger(__name__)

CONVERTED_MARKER = "flowedge.json"
CHECKPOINT_KEY = "checkpoint"   # the marker's record of model.safetensors (checkpoint_record)
CONVERT_FORMAT = 4   # 4: W8A16 for what the GGUF keeps at 6-8 bits, its 4-bit grids kept (3: all re-quantized)
WIDE_TYPES = frozenset({"Q6_K", "Q8_0", "Q8_1", "Q8_K"})   # GGUF block types with 6-8 bit codes: stored W8A16
STORE_DTYPE = torch.float16
_F16_MAX = torch.finfo(torch.float16).max
_GENERATION_IDS = ("bos_token_id", "eos_token_id", "pad_token_id")


def convert_gguf(
    gguf: Path, target: Path, *, source: str, sha256: str, quant: str = "int4",
    group_size: int = DEFAULT_GROUP_SIZE, reference_gguf: bool = False,
) -> Path:
    """Convert a GGUF into a checkpoint directory stored as `quant` (int4: W4A16, none: float16),
    written to a temp dir and renamed at the end. `reference_gguf` (int4, a GGUF the cache keeps):
    the embedding and lm_head are read from the GGUF at load instead of being stored."""
    start_s = time.monotonic()
    log.info("converting GGUF %s (%.1f MB)", gguf.name, gguf.stat().st_size / 1e6)
    with Ticker(f"converting {source}: reading the GGUF's metadata"):
        model = read_gguf(gguf)
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = target.parent / f".{target.name}.tmp-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    try:
        with Ticker(f"converting {source}: converting the tokenizer"):
            _write_tokenizer(gguf, tmp)
        _write_configs(model, tmp)
        with Ticker(f"converting {source}: checking the float16 range"):
            refs = _references(model) if reference_gguf and quant == "int4" else {}
            entries = _entries(model, quant, group_size, skip=set(refs))
        bar = Progress(f"converting {source}: writing {quant}", sum(e.nbytes for e in entries))
        digest, size = write_safetensors(tmp / "model.safetensors", entries, progress=bar.advance)
        bar.finish()
        log.info("wrote model.safetensors (%.1f MB, %d tensors)", size / 1e6, len(entries))
        marker = {"format": CONVERT_FORMAT, "source": source, "sha256": sha256, "dtype": "float16",
                  "quant": quant, "group_size": group_size if quant == "int4" else None,
                  CHECKPOINT_KEY: checkpoint_record(tmp / "model.safetensors", digest)}
        if refs:
            marker[gguf_tensors.MARKER_KEY] = {**gguf_tensors.file_record(gguf, sha256, target),
                                               "tensors": {n: t.to_json() for n, t in refs.items()}}
        (tmp / CONVERTED_MARKER).write_text(json.dumps(marker, indent=1) + "\n")
        if target.exists():
            shutil.rmtree(target)
        os.replace(tmp, target)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    log.info("converted %s -> %s in %.1f s", gguf.name, target, time.monotonic() - start_s)
    return target


def checkpoint_record(path: Path, sha256: str) -> dict:
    """What the marker keeps about the written checkpoint, so a start notices a damaged one cheaply:
    its size and mtime (checked every time) and its sha256 (hashed again only when those changed)."""
    st = path.stat()
    return {"sha256": sha256, "bytes": st.st_size, "mtime_ns": st.st_mtime_ns}


def _write_tokenizer(gguf: Path, out: Path) -> None:
    """transformers' GGUF tokenizer conversion: metadata only, no tensor is read."""
    from transformers import AutoTokenizer

    try:
        tokenizer = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    except (OSError, ValueError, KeyError, RuntimeError) as exc:
        raise ModelError(f"cannot read the tokenizer of GGUF {gguf}: {exc}") from exc
    tokenizer.save_pretrained(out)


def _write_configs(model: GgufModel, out: Path) -> None:
    (out / "config.json").write_text(json.dumps(model.config, indent=2, sort_keys=True) + "\n")
    generation = {k: model.config[k] for k in _GENERATION_IDS if k in model.config}
    (out / "generation_config.json").write_text(json.dumps(generation, indent=2, sort_keys=True) + "\n")


def _references(model: GgufModel) -> dict[str, gguf_tensors.GgufTensor]:
    """The embedding and lm_head as records of where the GGUF holds them (16-bit dtype settled by
    their range): a loader dequantises them from there, the same values a stored copy would hold."""
    return {s.name: s.matrix(store_dtype(s)) for s in model.tensors
            if gguf_tensors.HF_TO_GGUF.get(s.name) == s.tensor and len(s.shape) == 2 and not s.rope_heads}


def _entries(model: GgufModel, quant: str, group_size: int, skip: set[str]) -> list[TensorEntry]:
    """One entry per stored tensor, loaded only when the writer reaches it. A packed Linear's 16-bit
    dtype is settled when it is loaded (its packed entries' dtypes do not depend on it); any other
    tensor's goes into the header first, so its range is read beforehand (the norms and biases:
    small; a 16-bit embedding or lm_head copy: a chunked pass)."""
    sources = [s for s in model.tensors if s.name not in skip]
    packed = {s.name for s in sources if quant == "int4" and packs(s.name, s.shape, group_size)}
    dtypes = {s.name: store_dtype(s) for s in sources if s.name not in packed}
    entries = [TensorEntry(s.name, STORE_DTYPE, s.shape, partial(_load_16bit, s)) if s.name in packed else
               TensorEntry(s.name, dtypes[s.name], s.shape, partial(s.load, dtypes[s.name]))
               for s in sources]
    if quant != "int4":
        return entries
    return pack_entries(entries, group_size, packers={s.name: p for s in sources if s.name in packed
                                                      for p in [packer(s, group_size)] if p is not None})


def packer(source: GgufSource, group_size: int) -> Packer | None:
    """How a packed layer weight leaves its GGUF blocks, where not re-quantized from its 16-bit values:
    W8A16 from its float32 values if the GGUF keeps it at 6-8 bits, W4A16 on its own grid if it is 4-bit."""
    if source.qtype_name in WIDE_TYPES and packable8(*source.shape) is None:
        return Packer(8, lambda: pack_int8(source.load()))
    if gguf_grid.on_grid(source, group_size):
        return Packer(4, lambda: gguf_grid.pack_source(source))
    return None


def store_dtype(source: GgufSource) -> torch.dtype:
    """float16 (finer than bfloat16 for dequantised GGUF weights); bfloat16 for a tensor beyond its range."""
    return _dtype_for(source.name, source.max_abs())


def _load_16bit(source: GgufSource) -> torch.Tensor:
    values = source.load()
    return values.to(_dtype_for(source.name, values.abs().max().item() if values.numel() else 0.0))


def _dtype_for(name: str, max_abs: float) -> torch.dtype:
    if max_abs > _F16_MAX:
        log.warning("%s exceeds the float16 range; stored as bfloat16", name)
        return torch.bfloat16
    return STORE_DTYPE
