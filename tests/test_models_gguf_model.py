"""read_gguf: a GGUF's metadata and tensor table as config.json fields and Hugging Face tensors,
nothing dequantised until asked; clear errors for files flowedge cannot convert."""
from __future__ import annotations

import logging
from pathlib import Path

import numpy as np
import pytest
import torch

from flowedge.errors import ModelError
from flowedge.models.gguf_model import read_gguf, unpermute_rope

HIDDEN, FF, HEADS, KV, VOCAB = 32, 64, 4, 2, 8
META = {"block_count": 1, "context_length": 128, "embedding_length": HIDDEN, "feed_forward_length": FF,
        "attention.head_count": HEADS, "attention.head_count_kv": KV, "attention.layer_norm_rms_epsilon": 1e-5,
        "rope.freq_base": 5e5}


def _tensors(head_dim: int = HIDDEN // HEADS) -> dict[str, tuple[int, ...]]:
    """GGUF name -> Hugging Face shape of a one-layer Qwen2."""
    q, kv = HEADS * head_dim, KV * head_dim
    return {"token_embd.weight": (VOCAB, HIDDEN), "output_norm.weight": (HIDDEN,),
            "blk.0.attn_norm.weight": (HIDDEN,), "blk.0.attn_q.weight": (q, HIDDEN), "blk.0.attn_q.bias": (q,),
            "blk.0.attn_k.weight": (kv, HIDDEN), "blk.0.attn_k.bias": (kv,), "blk.0.attn_v.weight": (kv, HIDDEN),
            "blk.0.attn_v.bias": (kv,), "blk.0.attn_output.weight": (HIDDEN, q), "blk.0.ffn_norm.weight": (HIDDEN,),
            "blk.0.ffn_gate.weight": (FF, HIDDEN), "blk.0.ffn_up.weight": (FF, HIDDEN),
            "blk.0.ffn_down.weight": (HIDDEN, FF)}


def _write(path: Path, arch: str = "qwen2", meta: dict | None = None,
           tensors: dict[str, tuple[int, ...]] | None = None, tokens: dict | None = None,
           dtypes: dict[str, type] | None = None) -> Path:
    """A GGUF of F32 tensors (or `dtypes`) numbered 0, 1, 2, ... in file order (tensor i is filled with i)."""
    from gguf import GGUFWriter

    writer = GGUFWriter(str(path), arch)
    for key, value in (META if meta is None else meta).items():
        (writer.add_float32 if isinstance(value, float) else writer.add_uint32)(f"{arch}.{key}", value)
    for key, value in (tokens or {}).items():
        writer.add_uint32(f"tokenizer.ggml.{key}", value)
    for i, (name, shape) in enumerate((_tensors() if tensors is None else tensors).items()):
        writer.add_tensor(name, np.full(shape, i, dtype=(dtypes or {}).get(name, np.float32)))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def test_config_and_tensor_names_come_from_the_metadata_and_table(tmp_path):
    model = read_gguf(_write(tmp_path / "m.gguf", tokens={"bos_token_id": 1, "eos_token_id": 2}))
    assert model.config == {
        "architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "hidden_size": HIDDEN, "num_hidden_layers": 1,
        "intermediate_size": FF, "num_attention_heads": HEADS, "num_key_value_heads": KV,
        "rms_norm_eps": float(np.float32(1e-5)), "max_position_embeddings": 128, "vocab_size": VOCAB,
        "tie_word_embeddings": True, "rope_parameters": {"rope_theta": 5e5, "rope_type": "default"},
        "bos_token_id": 1, "eos_token_id": 2, "hidden_act": "silu", "dtype": "float32", "use_cache": True}
    names = [s.name for s in model.tensors]
    assert names[:4] == ["model.embed_tokens.weight", "model.layers.0.self_attn.q_proj.weight",
                         "model.layers.0.self_attn.q_proj.bias", "model.layers.0.self_attn.k_proj.weight"]
    assert names[-3:] == ["model.layers.0.input_layernorm.weight", "model.layers.0.post_attention_layernorm.weight",
                          "model.norm.weight"]   # tied: no lm_head
    by_name = {s.name: s for s in model.tensors}
    down = by_name["model.layers.0.mlp.down_proj.weight"]
    assert down.shape == (HIDDEN, FF) and torch.equal(down.load(), torch.full((HIDDEN, FF), 13.0))
    assert down.load(torch.float16).dtype == torch.float16 and down.max_abs() == 13.0


def test_missing_kv_heads_mean_one_per_head_and_an_output_tensor_unties(tmp_path):
    meta = {k: v for k, v in META.items() if k != "attention.head_count_kv"}
    tensors = _tensors() | {"output.weight": (VOCAB, HIDDEN)}
    tensors["blk.0.attn_k.weight"], tensors["blk.0.attn_k.bias"] = (HIDDEN, HIDDEN), (HIDDEN,)
    tensors["blk.0.attn_v.weight"], tensors["blk.0.attn_v.bias"] = (HIDDEN, HIDDEN), (HIDDEN,)
    model = read_gguf(_write(tmp_path / "m.gguf", meta=meta, tensors=tensors))
    assert model.config["num_key_value_heads"] == HEADS and not model.tied
    assert model.tensors[-1].name == "lm_head.weight" and model.tensors[-1].tensor == "output.weight"


def test_a_missing_metadata_key_or_tensor_is_a_clear_error(tmp_path):
    meta = {k: v for k, v in META.items() if k != "attention.layer_norm_rms_epsilon"}
    with pytest.raises(ModelError, match="lacks qwen2.attention.layer_norm_rms_epsilon"):
        read_gguf(_write(tmp_path / "a.gguf", meta=meta))
    tensors = {k: v for k, v in _tensors().items() if k != "blk.0.attn_q.bias"}
    with pytest.raises(ModelError, match="lacks 1 tensors .*blk.0.attn_q.bias"):
        read_gguf(_write(tmp_path / "b.gguf", tensors=tensors))


def test_a_block_type_gguf_cannot_dequantise_is_a_clear_error(tmp_path):
    model = read_gguf(_write(tmp_path / "m.gguf", dtypes={"blk.0.ffn_norm.weight": np.int8}))
    norm = next(s for s in model.tensors if s.tensor == "blk.0.ffn_norm.weight")
    with pytest.raises(ModelError, match="blk.0.ffn_norm.weight is stored as I8, which gguf cannot dequantise"):
        norm.load()


def test_tensors_flowedge_does_not_use_are_ignored_with_a_log_line(tmp_path, caplog):
    caplog.set_level(logging.INFO, "flowedge.models.gguf_model")
    model = read_gguf(_write(tmp_path / "m.gguf", tensors=_tensors() | {"rope_freqs.weight": (4,)}))
    assert "rope_freqs.weight" not in {s.tensor for s in model.tensors}
    assert "ignoring 1 GGUF tensors" in caplog.text and "rope_freqs.weight" in caplog.text


def test_llama_q_and_k_are_unpermuted_with_their_own_head_counts(tmp_path):
    model = read_gguf(_write(tmp_path / "m.gguf", arch="llama", meta=META | {"rope.dimension_count": 8},
                             tensors={k: v for k, v in _tensors().items() if not k.endswith(".bias")}))
    heads = {s.name.split(".")[-2]: s.rope_heads for s in model.tensors}
    assert (heads["q_proj"], heads["k_proj"], heads["v_proj"], heads["embed_tokens"]) == (HEADS, KV, 0, 0)
    assert model.config["head_dim"] == 8 and model.arch.hf_class == "LlamaForCausalLM"


@pytest.mark.parametrize("heads", [1, 2, 4])
def test_unpermute_rope_undoes_llama_cpps_permutation(heads):
    w = torch.randn(heads * 8, 6)
    # llama.cpp's convert_hf_to_gguf: reshape(n_head, 2, dim // n_head // 2, ...).swapaxes(1, 2)
    permuted = w.reshape(heads, 2, 4, 6).transpose(1, 2).reshape(w.shape)
    assert not torch.equal(permuted, w)
    assert torch.equal(unpermute_rope(permuted, heads), w)
    assert torch.equal(unpermute_rope(permuted[:, 0].contiguous(), heads), w[:, 0])   # a bias: same rows
