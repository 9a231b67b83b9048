"""A tiny model directory (models/tiny.py) written as llama.cpp would write its GGUF: the converter's
input in tests, with no download.

What llama.cpp's convert_hf_to_gguf.py does and this repeats: gguf's standard tensor names and
metadata keys, dimensions fastest-moving first, Llama's q_proj/k_proj rows permuted into its rope
layout, no output.weight for a tied lm_head, the byte-level vocabulary as `gpt2` tokens. Tensors are
stored as the `qtypes` policy says (gguf's own quantizers: F32, F16, Q8_0, Q4_0, ...).
"""
from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch

from flowedge.errors import ConfigError
from flowedge.models.gguf_model import LAYER_MODULES

# Which GGML type a tensor is stored as: a function of its GGUF name.
QtypePolicy = Callable[[str], str]


def mixed_qtypes(gguf_name: str) -> str:
    """A mix like a real Q4_K_M file's (norms and biases F32, weights block-quantized), with the block
    types gguf can write: every dequantisation path the converter takes, in one small file."""
    if not gguf_name.endswith(".weight") or "norm" in gguf_name:
        return "F32"
    for part, qtype in ((".attn_q.", "Q8_0"), (".attn_k.", "Q4_0"), (".attn_v.", "F16"), (".ffn_down.", "Q5_1"),
                        ("token_embd.", "Q8_0"), ("output.", "Q4_0")):
        if part in gguf_name:
            return qtype
    return "Q4_1"


def exact_qtypes(gguf_name: str) -> str:
    """Everything F32: the converted values are the original ones, rounded to 16 bits once."""
    return "F32"


def write_tiny_gguf(model_dir: Path, out: Path, qtypes: QtypePolicy = mixed_qtypes,
                    architecture: str | None = None) -> Path:
    """Write `model_dir` (a tiny model: config.json, model.safetensors, tokenizer.json) as a GGUF
    file `out`; `architecture` overrides general.architecture (a file flowedge cannot convert)."""
    from gguf import GGUFWriter
    from safetensors.torch import load_file

    config = json.loads((Path(model_dir) / "config.json").read_text())
    arch = architecture or config["model_type"]
    state = load_file(str(Path(model_dir) / "model.safetensors"))
    out.parent.mkdir(parents=True, exist_ok=True)
    writer = GGUFWriter(str(out), arch)
    _add_metadata(writer, arch, config)
    _add_vocabulary(writer, Path(model_dir), config)
    for hf_name, tensor in state.items():
        gguf_name = _gguf_name(hf_name)
        _add_tensor(writer, gguf_name, _llama_cpp_layout(hf_name, tensor.float(), config), qtypes(gguf_name))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return out


def _add_metadata(writer, arch: str, config: dict) -> None:
    writer.add_name("tiny")
    writer.add_block_count(config["num_hidden_layers"])
    writer.add_context_length(config["max_position_embeddings"])
    writer.add_embedding_length(config["hidden_size"])
    writer.add_feed_forward_length(config["intermediate_size"])
    writer.add_head_count(config["num_attention_heads"])
    writer.add_head_count_kv(config["num_key_value_heads"])
    writer.add_layer_norm_rms_eps(config["rms_norm_eps"])
    writer.add_vocab_size(config["vocab_size"])
    theta = (config.get("rope_parameters") or {}).get("rope_theta", config.get("rope_theta"))
    if theta is not None:
        writer.add_rope_freq_base(theta)
    if arch == "llama":
        head_dim = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
        writer.add_rope_dimension_count(head_dim)
    writer.add_bos_token_id(config["bos_token_id"])
    writer.add_eos_token_id(config["eos_token_id"])
    writer.add_pad_token_id(config["pad_token_id"])


def _add_vocabulary(writer, model_dir: Path, config: dict) -> None:
    """The tokenizer.json vocabulary as llama.cpp's byte-level (gpt2) tokens; ids past it up to the
    model's vocabulary size are unused padding tokens, as in real files."""
    from gguf import TokenType

    tokenizer = json.loads((model_dir / "tokenizer.json").read_text())
    vocab = tokenizer["model"]["vocab"]
    special = {t["content"] for t in tokenizer.get("added_tokens", []) if t.get("special")}
    tokens = sorted(vocab, key=vocab.__getitem__)
    types = [TokenType.CONTROL if t in special else TokenType.NORMAL for t in tokens]
    for i in range(len(tokens), config["vocab_size"]):
        tokens.append(f"[PAD{i}]")
        types.append(TokenType.UNUSED)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    writer.add_token_scores([0.0] * len(tokens))
    writer.add_token_merges(tokenizer["model"].get("merges") or [])   # none: transformers derives none
    config_path = model_dir / "tokenizer_config.json"
    template = json.loads(config_path.read_text()).get("chat_template") if config_path.is_file() else None
    if template is None and (model_dir / "chat_template.jinja").is_file():
        template = (model_dir / "chat_template.jinja").read_text()
    if template:
        writer.add_chat_template(template)


def _gguf_name(hf_name: str) -> str:
    from gguf import MODEL_TENSOR, TENSOR_NAMES

    stem, kind = hf_name.rsplit(".", 1)
    top = {"model.embed_tokens": "TOKEN_EMBD", "model.norm": "OUTPUT_NORM", "lm_head": "OUTPUT"}
    if stem in top:
        return f"{TENSOR_NAMES[MODEL_TENSOR[top[stem]]]}.{kind}"
    _, _, layer, module = stem.split(".", 3)
    tensor = dict(LAYER_MODULES).get(module)
    if tensor is None:
        raise ConfigError(f"no GGUF name for {hf_name}")
    return f"{TENSOR_NAMES[MODEL_TENSOR[tensor]].format(bid=int(layer))}.{kind}"


def _llama_cpp_layout(hf_name: str, w: torch.Tensor, config: dict) -> torch.Tensor:
    """llama.cpp's rope permutation of Llama's q/k rows: [head, pair, half] -> [head, half, pair]."""
    if config["model_type"] != "llama" or not hf_name.endswith(("q_proj.weight", "k_proj.weight")):
        return w
    heads = config["num_attention_heads"] if "q_proj" in hf_name else config["num_key_value_heads"]
    return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)


def _add_tensor(writer, name: str, w: torch.Tensor, qtype_name: str) -> None:
    from gguf import GGMLQuantizationType, quants

    qtype = GGMLQuantizationType[qtype_name]
    data = quants.quantize(np.ascontiguousarray(w.numpy()), qtype)
    writer.add_tensor(name, data, raw_dtype=qtype)   # gguf derives the logical shape from the block bytes
