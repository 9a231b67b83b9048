"""A contiguous layer range of a decoder-only LM, run with a tree mask, absolute positions and a KV cache.

One class serves every role: a pipeline stage (layers only), node 0's base-model parts (embedding,
final norm, lm_head), the draft model and the single-process model (everything). Layers are flowedge's own
decoder blocks (models/decoder.py) built on the meta device and filled from safetensors by name, so a
stage process only ever reads and holds its own tensors, and never imports transformers.
"""
from __future__ import annotations

import json
import logging
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from flowedge.allocator import trim_heap
from flowedge.errors import ModelError
from flowedge.models import packing
from flowedge.models.config import ModelConfig
from flowedge.models.decoder import DecoderLayer, RequestRows, RMSNorm, run_layers
from flowedge.models.gguf_tensors import GgufEmbedding, GgufTensor, read_tensor
from flowedge.models.kv_cache import KVCache

log = logging.getLogger(__name__)

_LAYER_PREFIX = "model.layers."

# tensor name -> where it is stored: a safetensors file, or a tensor of a GGUF (models/gguf_tensors.py)
TensorIndex = dict[str, Path | GgufTensor]


def load_config(model_dir: Path) -> ModelConfig:
    return ModelConfig.load(model_dir)


def _tensor_index(model_dir: Path) -> TensorIndex:
    """Map tensor name -> safetensors file for every *.safetensors file in the directory, and for a
    split's references the checkpoint file holding each tensor (read in place, through mmap)."""
    from flowedge.models.shards import shard_tensor_files

    index = shard_tensor_files(model_dir)
    if not index:
        raise ModelError(f"{model_dir} holds no .safetensors files")
    return index


def is_packed(model_dir: Path) -> bool:
    """True for a W4A16 checkpoint (packed decoder Linears)."""
    return packing.quant_of(_tensor_index(model_dir)) == "int4"


def verify_shard_files(model_dir: Path, parts: "StageParts") -> None:
    """In a flowedge shard directory, check the sha256 of every file these parts will read."""
    from flowedge.models.shard_refs import resolve_file
    from flowedge.models.shards import MANIFEST, FileSpec, Manifest, StageSpec, verify_file

    if not (Path(model_dir) / MANIFEST).is_file():
        return
    manifest = Manifest.load(model_dir)
    files: list[FileSpec | StageSpec] = [manifest.head] if parts.embed or parts.head else []
    files += [s for s in manifest.stages if s.start < parts.end and parts.start < s.end]
    for spec in files:
        stored = resolve_file(model_dir, spec.file)
        if stored is None:
            raise ModelError(f"shard {spec.file} is missing from {model_dir}")
        verify_file(stored, spec)


@dataclass(frozen=True, slots=True)
class StageParts:
    """Which parts of the model a StageModel holds; layers are the half-open range [start, end)."""
    start: int
    end: int
    embed: bool = False
    head: bool = False


class StageModel(nn.Module):
    def __init__(self, config: ModelConfig, parts: StageParts, layers: nn.ModuleList, embed: nn.Module | None,
                 norm: RMSNorm | None, lm_head: nn.Module | None) -> None:
        super().__init__()
        self.config = config
        self.parts = parts
        self.layers = layers
        self.embed_tokens = embed
        self.norm = norm
        self.lm_head = lm_head
        self.compute_dtype = torch.float32

    # ---- construction -------------------------------------------------------------------------
    @classmethod
    def load(cls, model_dir: Path | str, parts: StageParts | None = None,
             dtype: torch.dtype = torch.float32, quant: str | None = None,
             quant_lm_head: bool = False, wide_lm_head: bool = True) -> "StageModel":
        """Build the requested parts from an HF model dir or a flowedge shard dir (same tensor names).

        `quant` None loads the weights as stored: a W4A16 checkpoint (packed layers, see
        models/packing.py) as int4, anything else as `dtype`. none | int4 | nf4 | auto quantize the
        decoder layers' Linears of a 16-bit checkpoint while loading, one layer at a time, so no
        full-precision copy of the stage is ever held; a packed checkpoint loads only as int4/auto.
        Norms, biases and activations are `dtype`. With int4 layers the lm_head is W8A16 where
        flowedge's kernel runs (`wide_lm_head`; else, and for a draft, W4A16), packed a few thousand
        rows at a time, never held in float32; the embedding stays at its stored 16 bits (a lookup);
        `quant_lm_head` also quantizes the lm_head for nf4 (a draft model)."""
        t0 = time.monotonic()
        model_dir = Path(model_dir)
        config = load_config(model_dir)
        n_layers = config.num_hidden_layers
        parts = parts or StageParts(0, n_layers, embed=True, head=True)
        if not 0 <= parts.start <= parts.end <= n_layers:
            raise ModelError(f"layer range [{parts.start}, {parts.end}) outside the model's {n_layers} layers")
        verify_shard_files(model_dir, parts)
        index = _tensor_index(model_dir)
        backend = _backend(quant, packing.quant_of(index), model_dir)
        with torch.device("meta"):
            layers = [DecoderLayer(config, i) for i in range(parts.start, parts.end)]
        by_layer: dict[int, list[str]] = {}
        for n in index:
            if n.startswith(_LAYER_PREFIX):
                by_layer.setdefault(int(n[len(_LAYER_PREFIX):].split(".", 1)[0]), []).append(n)
        for layer in layers:
            _load_layer(layer, layer.index, index, by_layer.get(layer.index, []), dtype, backend)
            layer.fuse()
        head_backend = backend if backend == "int4" or quant_lm_head else "none"
        embed = norm = lm_head = None
        if parts.embed or parts.head:
            embed = _load_embedding(config, index, dtype, keep_16="lm_head.weight" in index or head_backend != "none")
        if parts.head and embed is not None:   # (always: the head's parts come with the embedding)
            with torch.device("meta"):
                norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
            _load_into(norm, {"weight": _read_one(index, "model.norm.weight", dtype)}, "final norm")
            lm_head = _load_lm_head(config, embed, index, dtype, head_backend, wide_lm_head)
        model = cls(config, parts, nn.ModuleList(layers), embed, norm, lm_head).eval()
        model.compute_dtype = dtype
        trim_heap()   # the transient buffers of loading: ~230 MB on a 14-layer 1.5B stage
        log.info("loaded %s layers [%d, %d)%s%s (%s) in %.1f s", model_dir.name, parts.start, parts.end,
                 " +embed" if parts.embed else "", " +head" if parts.head else "", backend,
                 time.monotonic() - t0)
        return model

    # ---- state --------------------------------------------------------------------------------
    def new_cache(self, capacity: int = 256) -> KVCache:
        c = self.config
        return KVCache(range(self.parts.start, self.parts.end), c.num_key_value_heads, c.head_dim,
                       self.dtype, capacity)

    @property
    def dtype(self) -> torch.dtype:
        """The activations' dtype (hidden states, KV cache); weights may be stored narrower."""
        return self.compute_dtype

    # ---- compute ------------------------------------------------------------------------------
    @torch.inference_mode()
    def embed(self, token_ids: torch.Tensor) -> torch.Tensor:
        # token_ids: [n] -> [n, H]
        if self.embed_tokens is None:
            raise ModelError("this stage holds no embedding")
        return self.embed_tokens(token_ids).to(self.dtype)

    @torch.inference_mode()
    def forward_layers(self, hidden: torch.Tensor, positions: torch.Tensor, mask: torch.Tensor,
                       cache: KVCache) -> torch.Tensor:
        # hidden: [n, H]; positions: [n] absolute; mask: [n, cache.length + n] float (0 / -inf) -> [n, H]
        return self.forward_packed(hidden, positions, [mask], [cache])

    @torch.inference_mode()
    def forward_packed(self, hidden: torch.Tensor, positions: torch.Tensor, masks: list[torch.Tensor],
                       caches: list) -> torch.Tensor:
        """Several requests' rows as one forward: hidden [sum n_i, H] packed in request order, positions
        [sum n_i], masks[i] request i's [n_i, caches[i].length + n_i] float mask -> [sum n_i, H].

        The Linear layers run over all rows at once; each request attends over its own cache with its
        own mask, and every kernel is row-invariant, so each request's rows are bit-identical to its
        forward alone."""
        requests, start = [], 0
        for mask, cache in zip(masks, caches, strict=True):
            n = int(mask.shape[0])
            if mask.dim() != 2 or mask.shape[1] != cache.length + n:
                raise ModelError(f"mask {tuple(mask.shape)} does not match {n} rows after {cache.length} cached")
            requests.append(RequestRows(start, n, cache, mask))
            start += n
        if start != hidden.shape[0]:
            raise ModelError(f"{hidden.shape[0]} rows for masks of {start}")
        if hidden.shape[0] == 0 or not len(self.layers):
            return hidden
        return run_layers(self.layers, self.config, hidden, positions, [r for r in requests if r.n])

    @torch.inference_mode()
    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        # hidden: [n, H] (output of the last layer) -> [n, V] float32
        norm, lm_head = self.final_parts()
        return lm_head(norm(hidden)).float()

    def final_parts(self) -> tuple[RMSNorm, nn.Module]:
        """(final norm, lm_head): what turns the last layer's output into features and logits."""
        if self.lm_head is None or self.norm is None:
            raise ModelError("this stage holds no lm_head")
        return self.norm, self.lm_head


def _backend(quant: str | None, stored: str, model_dir: Path) -> str:
    """The quantization a load applies: the stored one, or the one asked for where it can be had."""
    from flowedge.models.quant import BACKENDS, default_backend

    if quant is not None and quant not in (*BACKENDS, "auto"):
        raise ModelError(f"unknown quantization {quant!r}; choose from {', '.join((*BACKENDS, 'auto'))}")
    if stored == "int4":
        if quant not in (None, "int4", "auto"):
            raise ModelError(f"{model_dir} is stored W4A16 (int4 packed); it cannot be loaded with quant "
                             f"{quant!r} (use its 16-bit conversion for that)")
        return "int4"
    if quant == "auto":
        return default_backend("cpu")
    return quant or "none"


def _read_one(index: TensorIndex, name: str, dtype: torch.dtype | None) -> torch.Tensor:
    return read_tensor(index[name], name, dtype)   # from a safetensors file, or dequantised from the GGUF


def _load_layer(layer: nn.Module, absolute: int, index: TensorIndex, names: list[str],
                dtype: torch.dtype, backend: str) -> None:
    """Fill one decoder layer: packed Linears are built straight from their codes, then the 16-bit
    tensors are read, then (quantizing at load) this layer's Linears are quantized before the next
    layer is read, so at most one layer is ever held in full precision."""
    from flowedge.models.quant import quantize_module

    prefix = f"{_LAYER_PREFIX}{absolute}."
    packed, packed8 = packing.packed_prefixes(names), packing.packed8_prefixes(names)
    for full, int8 in [(p, False) for p in sorted(packed)] + [(p, True) for p in sorted(packed8)]:
        layer.set_submodule(full[len(prefix):], _packed_linear(index, full, dtype, int8))
    skip = {p + s for p in packed for s in (*packing.PACKED_SUFFIXES, ".bias")}
    skip |= {p + s for p in packed8 for s in (*packing.PACKED8_SUFFIXES, ".bias")}
    packed = packed | packed8
    state = {n[len(prefix):]: _read_one(index, n, dtype) for n in names if n not in skip}
    _load_into(layer, state, f"layer {absolute}", strict=not packed)
    if backend in ("int4", "nf4") and any(isinstance(m, nn.Linear) for m in layer.modules()):
        quantize_module(layer, backend, compute_dtype=dtype, skip_names=())
    meta = [n for n, t in (*layer.named_parameters(), *layer.named_buffers()) if t.is_meta]
    if meta:
        raise ModelError(f"layer {absolute}: no tensors stored for {', '.join(meta[:4])}")


def _packed_linear(index: TensorIndex, full: str, dtype: torch.dtype, int8: bool) -> nn.Module:
    """A Linear built straight from its stored codes (W8A16 where `int8`, else W4A16), its bias at `dtype`."""
    from flowedge.models.quant import Int4Linear, PackedInt4
    from flowedge.models.quant8 import Int8Linear, PackedInt8

    if int8:
        w8 = PackedInt8(*(_read_one(index, full + s, None) for s in packing.PACKED8_SUFFIXES))
        w8.check(full)
        return Int8Linear.from_packed(w8, _read_bias(index, full, dtype))
    w4 = PackedInt4(*(_read_one(index, full + s, None) for s in packing.PACKED_SUFFIXES))
    w4.check(full)
    return Int4Linear.from_packed(w4, _read_bias(index, full, dtype))


def _read_bias(index: TensorIndex, full: str, dtype: torch.dtype) -> torch.Tensor | None:
    return _read_one(index, full + ".bias", dtype) if full + ".bias" in index else None


def _load_embedding(config: ModelConfig, index: TensorIndex, dtype: torch.dtype, keep_16: bool) -> nn.Module:
    """The token embedding: a lookup into the GGUF where the checkpoint leaves it there, else the stored
    matrix (16-bit when `keep_16`, the lm_head not sharing it at `dtype`)."""
    source = index["model.embed_tokens.weight"]
    if keep_16 and isinstance(source, GgufTensor):
        return GgufEmbedding(source)   # a lookup, rows from the GGUF
    with torch.device("meta"):
        embed = nn.Embedding(config.vocab_size, config.hidden_size)
    _load_into(embed, {"weight": _read_one(index, "model.embed_tokens.weight", None if keep_16 else dtype)},
               "embedding")
    return embed


def _load_lm_head(config: ModelConfig, embed: nn.Module, index: TensorIndex, dtype: torch.dtype,
                  backend: str, wide: bool) -> nn.Module:
    """The lm_head: its own tensor, or the tied embedding's (shared, or quantized from it). int4 packs
    a few thousand rows at a time from the stored 16-bit rows (never a float32 copy of the matrix):
    W8A16 where `wide` and flowedge's kernel runs (every GGUF flowedge ships keeps its output matrix
    at 6-8 bits; a 4-bit head cost the most agreement with the float model), else W4A16. Packed from the
    16-bit rows every loader has (a remote stage's streamed head file too), so all agree bit for bit."""
    from flowedge.models.quant import DEFAULT_GROUP_SIZE, INT4_CPU_N_MULTIPLE, Int4Linear, packable, quantize_module
    from flowedge.models.quant8 import Int8Linear, pack_int8

    name = "lm_head.weight" if "lm_head.weight" in index else "model.embed_tokens.weight"
    padded = -(-config.vocab_size // INT4_CPU_N_MULTIPLE) * INT4_CPU_N_MULTIPLE
    if backend == "int4" and wide and _wide_head(padded, config.hidden_size):
        head: nn.Module = Int8Linear.from_packed(_pack_rows(index[name], name, padded, pack_int8), None)
        return head if padded == config.vocab_size else VocabSlice(head, config.vocab_size)
    if backend == "int4" and packable(padded, config.hidden_size, DEFAULT_GROUP_SIZE) is None:
        head = Int4Linear.from_packed(_pack_rows(index[name], name, padded), None)
        return head if padded == config.vocab_size else VocabSlice(head, config.vocab_size)
    with torch.device("meta"):
        lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
    if name == "lm_head.weight":
        _load_into(lm_head, {"weight": _read_one(index, name, dtype)}, "lm_head")
    elif backend == "nf4" or _weight(embed).dtype != dtype:
        lm_head.weight = nn.Parameter(_weight(embed).detach().to(dtype), requires_grad=False)
    else:   # tied embeddings: share the embedding matrix, no second copy
        lm_head.weight = _weight(embed)
    if backend == "nf4":
        holder = nn.ModuleDict({"lm_head": lm_head})
        quantize_module(holder, backend, compute_dtype=dtype, skip_names=())
        return holder["lm_head"]
    return lm_head


def _weight(module: nn.Module) -> nn.Parameter:
    """A module's `weight` parameter (an nn.Linear's or nn.Embedding's)."""
    weight = module.weight
    if not isinstance(weight, nn.Parameter):
        raise ModelError(f"{type(module).__name__} holds no weight matrix")
    return weight


def _wide_head(rows: int, cols: int) -> bool:
    from flowedge.kernels import w8a16
    from flowedge.models.quant8 import GROUP_SIZE, packable8

    return packable8(rows, cols) is None and w8a16.supports(rows, cols, GROUP_SIZE) and w8a16.available()


def _pack_rows(source: Path | GgufTensor, name: str, rows: int, pack=None):
    """Codes of a [V, H] matrix (`pack`: pack_int4 at the default group size, or pack_int8), packed
    ROW_CHUNK rows at a time (rows quantize independently), zero rows appended up to `rows` (the
    kernels take whole tiles of outputs)."""
    import dataclasses

    from flowedge.models.quant import DEFAULT_GROUP_SIZE, ROW_CHUNK, pack_int4

    pack = pack or (lambda w: pack_int4(w, DEFAULT_GROUP_SIZE))
    if isinstance(source, GgufTensor):
        chunks = (source.rows_tensor(a, min(a + ROW_CHUNK, source.rows)) for a in range(0, source.rows, ROW_CHUNK))
    else:
        chunks = iter(read_tensor(source, name, None).split(ROW_CHUNK))
    parts = [pack(chunk) for chunk in chunks]
    held = sum(p.qweight.shape[0] for p in parts)
    if rows > held:
        parts.append(pack(torch.zeros(rows - held, parts[0].in_features)))
    fields = [f.name for f in dataclasses.fields(parts[0])]
    return type(parts[0])(*(torch.cat([getattr(p, f) for p in parts]) for f in fields))


class VocabSlice(nn.Module):
    """An lm_head computed over a vocabulary padded to whole kernel tiles, cut back to the real one."""

    def __init__(self, inner: nn.Module, vocab: int) -> None:
        super().__init__()
        self.inner, self.vocab = inner, vocab

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.inner(x)[..., : self.vocab]


def _load_into(module: nn.Module, state: dict[str, torch.Tensor], what: str, strict: bool = True) -> None:
    try:
        result = module.load_state_dict(state, strict=strict, assign=True)
        if not strict and result.unexpected_keys:
            raise RuntimeError(f"unexpected tensors {result.unexpected_keys[:4]}")
    except RuntimeError as e:
        raise ModelError(f"cannot load {what}: {str(e).splitlines()[0]}") from e


def bool_to_float_mask(allowed: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Hugging Face eager/sdpa attention add the mask to scores: 0 where allowed, the dtype's min elsewhere."""
    out = torch.zeros(allowed.shape, dtype=dtype)
    return out.masked_fill_(~allowed, torch.finfo(dtype).min)


def causal_mask(n: int, past: int) -> torch.Tensor:
    # [n, past + n] bool: token i sees the whole past and new tokens 0..i
    allowed = torch.ones(n, past + n, dtype=torch.bool)
    allowed[:, past:] = torch.ones(n, n, dtype=torch.bool).tril()
    return allowed


def read_json(path: Path) -> dict:
    try:
        return json.loads(Path(path).read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise ModelError(f"cannot read {path}: {e}") from e
