"""Tiny random models in the same directory format as converted real models, for fast tests.

Random weights are drawn with a larger scale than a trained model's init (0.3 vs 0.02) so greedy
decoding does not collapse into repeating the input token: tests then exercise real branching.
"""
from __future__ import annotations

import json
import logging
import os
import shutil
from pathlib import Path

import torch

from flowedge.errors import ConfigError
from flowedge.models.shards import TensorEntry, write_safetensors

log = logging.getLogger(__name__)

EOS_TOKEN = "<|endoftext|>"
BOS_TOKEN = "<|bos|>"
SPECIAL_TOKENS = (EOS_TOKEN, BOS_TOKEN)
TOKENIZER_SIZE = 256 + len(SPECIAL_TOKENS)
DEFAULT_VOCAB = 260
INIT_STD = 0.3
CHAT_TEMPLATE = (
    "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}assistant: {% endif %}"
)
_MARKER = "flowedge.json"


def _archs():
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

    return {"qwen2": (Qwen2Config, Qwen2ForCausalLM), "llama": (LlamaConfig, LlamaForCausalLM)}


def make_tiny_model(
    out_dir: Path,
    *,
    seed: int = 0,
    num_layers: int = 4,
    hidden: int = 64,
    heads: int = 4,
    kv_heads: int = 2,
    vocab: int = DEFAULT_VOCAB,
    intermediate: int = 128,
    tie: bool = True,
    arch: str = "qwen2",
) -> Path:
    """Write a seeded random causal LM (config.json, model.safetensors, tokenizer) to out_dir.

    `vocab` is the model's vocabulary (>= 258: 256 byte tokens plus eos and bos; extra ids are
    never produced by the tokenizer, as with real models). Returns immediately when out_dir
    already holds a model made with the same parameters.
    """
    params = dict(seed=seed, num_layers=num_layers, hidden=hidden, heads=heads, kv_heads=kv_heads,
                  vocab=vocab, intermediate=intermediate, tie=tie, arch=arch)
    if _cached(Path(out_dir), params):
        return Path(out_dir)
    config, state = _random_state(params)
    return _write_model_dir(Path(out_dir), config, state, params)


def make_tiny_pair(
    root: Path, *, seed: int = 0, base_layers: int = 4, draft_layers: int = 2, perturb: float = 0.1
) -> tuple[Path, Path]:
    """A base and a draft model sharing the tokenizer, built so the draft agrees with the base.

    The draft is the base's first `draft_layers` layers with the same embeddings, norm and head;
    the base's remaining layers have their residual outputs (o_proj, down_proj) scaled by
    `perturb`, so base = draft + a small perturbation. perturb=0.1 gives ~83% greedy top-1
    agreement on random contexts (the real Qwen pair measures 89%); 0 gives 100%.
    """
    if not 1 <= draft_layers <= base_layers:
        raise ConfigError(f"draft_layers must be in 1..{base_layers}, got {draft_layers}")
    root = Path(root)
    pair = dict(seed=seed, base_layers=base_layers, draft_layers=draft_layers, perturb=perturb)
    base_params = dict(_defaults(seed, base_layers), pair=pair)
    draft_params = dict(_defaults(seed, draft_layers), pair=pair)
    base_dir, draft_dir = root / "base", root / "draft"
    if _cached(base_dir, base_params) and _cached(draft_dir, draft_params):
        return base_dir, draft_dir
    config, state = _random_state(_defaults(seed, base_layers))
    for layer in range(draft_layers, base_layers):
        for proj in ("self_attn.o_proj.weight", "mlp.down_proj.weight"):
            state[f"model.layers.{layer}.{proj}"].mul_(perturb)
    draft_state = {k: v for k, v in state.items() if (at := _layer_of(k)) is None or at < draft_layers}
    draft_config = config.__class__(**{**config.to_dict(), "num_hidden_layers": draft_layers,
                                       "layer_types": None})
    _write_model_dir(base_dir, config, state, base_params)
    _write_model_dir(draft_dir, draft_config, draft_state, draft_params)
    return base_dir, draft_dir


def _defaults(seed: int, num_layers: int) -> dict:
    return dict(seed=seed, num_layers=num_layers, hidden=64, heads=4, kv_heads=2,
                vocab=DEFAULT_VOCAB, intermediate=128, tie=True, arch="qwen2")


def _layer_of(name: str) -> int | None:
    parts = name.split(".")
    if len(parts) > 2 and parts[:2] == ["model", "layers"]:
        return int(parts[2])
    return None


def _random_state(p: dict):
    """Build the model from a seeded generator; return (config, {name: tensor})."""
    archs = _archs()
    if p["arch"] not in archs:
        raise ConfigError(f"unknown tiny arch {p['arch']!r}; known: {', '.join(archs)}")
    if p["vocab"] < TOKENIZER_SIZE:
        raise ConfigError(f"tiny vocab must be >= {TOKENIZER_SIZE}, got {p['vocab']}")
    config_cls, model_cls = archs[p["arch"]]
    config = config_cls(
        vocab_size=p["vocab"], hidden_size=p["hidden"], intermediate_size=p["intermediate"],
        num_hidden_layers=p["num_layers"], num_attention_heads=p["heads"],
        num_key_value_heads=p["kv_heads"], tie_word_embeddings=p["tie"],
        initializer_range=INIT_STD, max_position_embeddings=2048,
        eos_token_id=256, bos_token_id=257, pad_token_id=256,
    )
    model = model_cls(config)
    gen = torch.Generator().manual_seed(p["seed"])
    state = {}
    for name, tensor in model.state_dict().items():
        if p["tie"] and name == "lm_head.weight":
            continue
        if name.endswith("norm.weight"):
            state[name] = torch.ones_like(tensor)
        elif name.endswith(".bias"):
            state[name] = torch.randn(tensor.shape, generator=gen) * 0.02
        else:
            state[name] = torch.randn(tensor.shape, generator=gen) * INIT_STD
    return config, state


def _cached(out_dir: Path, params: dict) -> bool:
    try:
        marker = json.loads((out_dir / _MARKER).read_text())
    except (FileNotFoundError, ValueError):
        return False
    return marker.get("params") == params and (out_dir / "model.safetensors").is_file()


def _write_model_dir(out_dir: Path, config, state: dict[str, torch.Tensor], params: dict) -> Path:
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = out_dir.parent / f".{out_dir.name}.tmp-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    try:
        config.save_pretrained(tmp)
        build_byte_tokenizer().save_pretrained(tmp)
        entries = [TensorEntry.held(k, v) for k, v in state.items()]
        sha, _ = write_safetensors(tmp / "model.safetensors", entries)
        (tmp / _MARKER).write_text(json.dumps({"source": "tiny", "sha256": sha, "params": params}))
        if out_dir.exists():
            shutil.rmtree(out_dir)
        os.replace(tmp, out_dir)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    log.debug("wrote tiny model %s", out_dir)
    return out_dir


def _byte_to_char() -> dict[int, str]:
    """Printable stand-in character for each byte (bytes that print as themselves keep their
    character; the rest map to code points from 256 up), so byte-level tokens are readable."""
    keep = [b for b in range(256) if 33 <= b <= 126 or 161 <= b <= 172 or 174 <= b <= 255]
    mapping = {b: chr(b) for b in keep}
    extra = 256
    for b in range(256):
        if b not in mapping:
            mapping[b] = chr(extra)
            extra += 1
    return mapping


def build_byte_tokenizer():
    """A byte-level tokenizer: id b is byte b, then eos (256) and bos (257); no merges."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    chars = _byte_to_char()
    vocab = {chars[b]: b for b in range(256)}
    for i, token in enumerate(SPECIAL_TOKENS):
        vocab[token] = 256 + i
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, eos_token=EOS_TOKEN, bos_token=BOS_TOKEN, pad_token=EOS_TOKEN
    )
    fast.chat_template = CHAT_TEMPLATE
    return fast
