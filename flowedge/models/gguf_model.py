"""A GGUF file read as the Hugging Face checkpoint it stands for, one tensor at a time.

The `gguf` package's reader lists the file's metadata and tensors (memory-mapped, nothing
dequantised); this module turns them into the config.json fields and the Hugging Face tensor names
the rest of flowedge uses, and hands out each tensor as a `GgufSource` that dequantises it when asked
(`load`), so a conversion holds one tensor in float32 at a time, never the whole model.

Facts about llama.cpp's writer (convert_hf_to_gguf.py) undone here, as transformers' own GGUF loader
does: the tensor names are gguf's standard ones (gguf.TENSOR_NAMES), the dimensions are listed
fastest-moving first (reversed against torch), and for Llama, q_proj and k_proj rows are permuted
for llama.cpp's rope layout (each head's two rotary halves interleaved); Qwen2's are written as they
are. No output.weight means the lm_head is tied to the embedding.
"""
from __future__ import annotations

import logging
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from flowedge.errors import ModelError
from flowedge.models.gguf_tensors import GgufTensor

log = logging.getLogger(__name__)

@dataclass(frozen=True, slots=True)
class Arch:
    """What flowedge knows of one GGUF architecture: the Hugging Face class it becomes."""
    name: str                 # general.architecture
    hf_class: str             # config.json "architectures"
    qkv_bias: bool            # q/k/v projections carry biases (required tensors)
    rope_permuted: bool       # llama.cpp permuted the q/k rows for its rope layout
    head_dim_from_rope: bool  # rope.dimension_count is the head dim (config "head_dim")


ARCHS = {a.name: a for a in (
    Arch("qwen2", "Qwen2ForCausalLM", qkv_bias=True, rope_permuted=False, head_dim_from_rope=False),
    Arch("llama", "LlamaForCausalLM", qkv_bias=False, rope_permuted=True, head_dim_from_rope=True),
)}

# Hugging Face module -> gguf MODEL_TENSOR name, in the order a transformers model lists its state
# (the order the checkpoint is written in).
LAYER_MODULES = (
    ("self_attn.q_proj", "ATTN_Q"), ("self_attn.k_proj", "ATTN_K"), ("self_attn.v_proj", "ATTN_V"),
    ("self_attn.o_proj", "ATTN_OUT"), ("mlp.gate_proj", "FFN_GATE"), ("mlp.up_proj", "FFN_UP"),
    ("mlp.down_proj", "FFN_DOWN"), ("input_layernorm", "ATTN_NORM"), ("post_attention_layernorm", "FFN_NORM"),
)
_REQUIRED_KEYS = {   # {arch}.<key> -> config.json field
    "embedding_length": "hidden_size", "block_count": "num_hidden_layers",
    "feed_forward_length": "intermediate_size", "attention.head_count": "num_attention_heads",
    "attention.layer_norm_rms_epsilon": "rms_norm_eps", "context_length": "max_position_embeddings",
}
_TOKEN_IDS = ("bos_token_id", "eos_token_id", "pad_token_id", "unk_token_id")
_TOKEN_KEYS = {"bos_token_id": "BOS_ID", "eos_token_id": "EOS_ID", "pad_token_id": "PAD_ID", "unk_token_id": "UNK_ID"}


@dataclass(frozen=True, slots=True)
class GgufSource:
    """One tensor of the GGUF under its Hugging Face name and shape, dequantised on demand."""
    name: str                  # Hugging Face name
    tensor: str                # GGUF name
    path: Path
    qtype: int                 # gguf.GGMLQuantizationType value
    offset: int                # absolute byte offset of its data
    shape: tuple[int, ...]     # Hugging Face (torch) order
    rope_heads: int = 0        # > 0: rows in llama.cpp's rope-permuted order over this many heads

    def matrix(self, dtype: torch.dtype) -> GgufTensor:
        """The tensor as GGUF rows (its fastest dimension as columns), read as `dtype`: the record a
        checkpoint keeps for a tensor it reads from the GGUF, and the chunked reader of big ones."""
        cols = self.shape[-1]
        return GgufTensor(self.name, self.path, self.tensor, self.qtype, self.offset,
                          math.prod(self.shape) // cols, cols, dtype)

    def load(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """Dequantised (gguf.dequantize, float32) then cast to `dtype`, a few thousand rows at a
        time, in Hugging Face layout."""
        values = self.matrix(dtype).load().reshape(self.shape)
        return unpermute_rope(values, self.rope_heads) if self.rope_heads else values

    def max_abs(self) -> float:
        """max |value| of the float32 dequantised tensor (NaN if it holds one), chunk by chunk."""
        return self.matrix(torch.float32).max_abs()

    @property
    def qtype_name(self) -> str:
        """The GGML block type's name: Q4_K, Q6_K, Q8_0, F16, ..."""
        from gguf import GGMLQuantizationType

        return GGMLQuantizationType(self.qtype).name


@dataclass(frozen=True, slots=True)
class GgufModel:
    """What a conversion needs from a GGUF: its config.json and its tensors, checkpoint order."""
    path: Path
    arch: Arch
    config: dict[str, Any]
    tensors: tuple[GgufSource, ...]

    @property
    def tied(self) -> bool:
        return bool(self.config["tie_word_embeddings"])


def unpermute_rope(w: torch.Tensor, heads: int) -> torch.Tensor:
    """Undo llama.cpp's q/k row order: its rows [head, pair, half] are Hugging Face's [head, half, pair]."""
    # w: [heads * 2 * half, ...]
    half = w.shape[0] // heads // 2
    return w.reshape(heads, half, 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)


def read_gguf(path: Path) -> GgufModel:
    """Index a GGUF (its metadata and tensor table; no tensor data is read); a clear
    ModelError for a file that is not a readable GGUF, is cut short, or holds an architecture or a
    tensor set flowedge cannot run."""
    from gguf import GGUFReader

    path = Path(path)
    try:
        reader = GGUFReader(path)
        meta = _scalars(reader)
        table = {t.name: (int(t.tensor_type), int(t.data_offset), int(t.n_bytes),
                          tuple(int(d) for d in reversed(t.shape.tolist()))) for t in reader.tensors}
    except (OSError, ValueError, IndexError, KeyError, TypeError) as exc:
        raise ModelError(f"cannot read GGUF {path}: not a GGUF file or cut short ({exc})") from None
    del reader   # its parsed vocabulary is ~0.5 GB of small arrays for the real 1.5B
    _check_complete(path, table)
    arch_name = meta.get("general.architecture")
    arch = ARCHS.get(arch_name) if isinstance(arch_name, str) else None
    if arch is None:
        raise ModelError(f"GGUF {path.name} holds a {arch_name!r} model; flowedge converts "
                         f"{', '.join(sorted(ARCHS))} models")
    config = _config(arch, meta, table, path)
    return GgufModel(path, arch, config, _sources(arch, config, table, path))


def _scalars(reader) -> dict[str, Any]:
    """Every scalar metadata field (strings and numbers); arrays such as the vocabulary are skipped."""
    from gguf import GGUFValueType

    return {name: f.contents() for name, f in reader.fields.items()
            if f.types and f.types[0] != GGUFValueType.ARRAY}


def _check_complete(path: Path, table: dict[str, tuple]) -> None:
    size = path.stat().st_size
    for name, (_, offset, nbytes, _) in table.items():
        if offset + nbytes > size:
            raise ModelError(f"GGUF {path} is cut short: tensor {name} ends at byte {offset + nbytes:,}, "
                             f"the file has {size:,}; fetch it again")


def _config(arch: Arch, meta: dict[str, Any], table: dict[str, tuple], path: Path) -> dict[str, Any]:
    """config.json from the metadata, with the fields transformers' GGUF loader gave it."""
    from gguf import Keys

    def key(name: str) -> str:
        return f"{arch.name}.{name}"

    missing = [key(k) for k in _REQUIRED_KEYS if key(k) not in meta]
    if missing or "token_embd.weight" not in table:
        raise ModelError(f"GGUF {path.name} lacks {', '.join(missing) or 'token_embd.weight'}: not a complete "
                         f"{arch.name} model")
    config: dict[str, Any] = {"architectures": [arch.hf_class], "model_type": arch.name}
    config |= {field: meta[key(k)] for k, field in _REQUIRED_KEYS.items()}
    config["num_key_value_heads"] = meta.get(key("attention.head_count_kv"), config["num_attention_heads"])
    config["vocab_size"] = table["token_embd.weight"][3][0]
    config["tie_word_embeddings"] = "output.weight" not in table
    if key("rope.freq_base") in meta:
        config["rope_parameters"] = {"rope_theta": meta[key("rope.freq_base")], "rope_type": "default"}
    if arch.head_dim_from_rope and key("rope.dimension_count") in meta:
        config["head_dim"] = meta[key("rope.dimension_count")]
    for field in _TOKEN_IDS:
        gguf_key = getattr(Keys.Tokenizer, _TOKEN_KEYS[field])
        if gguf_key in meta:
            config[field] = meta[gguf_key]
    return config | {"hidden_act": "silu", "dtype": "float32", "use_cache": True}


def _hf_names(arch: Arch, layers: int, tied: bool) -> list[tuple[str, str]]:
    """(Hugging Face name, GGUF name) of every tensor of the model, in checkpoint order."""
    from gguf import MODEL_TENSOR, TENSOR_NAMES

    def gguf(kind: str, bid: int | None = None) -> str:
        return TENSOR_NAMES[MODEL_TENSOR[kind]].format(bid=bid)

    out = [("model.embed_tokens.weight", gguf("TOKEN_EMBD") + ".weight")]
    for i in range(layers):
        for module, kind in LAYER_MODULES:
            out.append((f"model.layers.{i}.{module}.weight", f"{gguf(kind, i)}.weight"))
            if arch.qkv_bias and kind in ("ATTN_Q", "ATTN_K", "ATTN_V"):
                out.append((f"model.layers.{i}.{module}.bias", f"{gguf(kind, i)}.bias"))
    out.append(("model.norm.weight", gguf("OUTPUT_NORM") + ".weight"))
    if not tied:
        out.append(("lm_head.weight", gguf("OUTPUT") + ".weight"))
    return out


def _sources(arch: Arch, config: dict[str, Any], table: dict[str, tuple], path: Path) -> tuple[GgufSource, ...]:
    names = _hf_names(arch, config["num_hidden_layers"], config["tie_word_embeddings"])
    missing = [g for _, g in names if g not in table]
    if missing:
        raise ModelError(f"GGUF {path.name} lacks {len(missing)} tensors of its {arch.name} model "
                         f"(first: {', '.join(missing[:3])})")
    ignored = sorted(set(table) - {g for _, g in names})
    if ignored:
        log.info("%s: ignoring %d GGUF tensors flowedge does not use (%s)", path.name, len(ignored),
                 ", ".join(ignored[:4]))
    permuted = {"q_proj.weight": config["num_attention_heads"], "k_proj.weight": config["num_key_value_heads"]}
    out = []
    for hf, gg in names:
        qtype, offset, _, shape = table[gg]
        heads = permuted.get(".".join(hf.split(".")[-2:]), 0) if arch.rope_permuted else 0
        out.append(GgufSource(hf, gg, path.resolve(), qtype, offset, shape, heads))
    return tuple(out)
