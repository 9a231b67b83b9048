"""A contiguous layer range of a decoder-only LM, run with a tree mask, absolute positions and a KV cache.

One class serves every role: a pipeline stage (layers only), node 0's base-model parts (embedding,
final norm, lm_head), the draft model and the single-process model (everything). Layers are the real
Hugging Face decoder blocks built on the meta device and filled from safetensors by name, so a stage
process only ever reads and holds its own tensors.
"""
from __future__ import annotations

import json
import logging
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open
from torch import nn

from flowedge.errors import ModelError
from flowedge.models.kv_cache import KVCache

log = logging.getLogger(__name__)

_LAYER_PREFIX = "model.layers."


def load_config(model_dir: Path):
    from transformers import AutoConfig

    if not (Path(model_dir) / "config.json").is_file():
        raise ModelError(f"{model_dir} has no config.json (not a model or shard directory)")
    config = AutoConfig.from_pretrained(model_dir)
    config._attn_implementation = "sdpa"
    return config


def _tensor_index(model_dir: Path) -> dict[str, Path]:
    """Map tensor name -> safetensors file for every *.safetensors file in the directory."""
    index: dict[str, Path] = {}
    files = sorted(Path(model_dir).glob("*.safetensors"))
    if not files:
        raise ModelError(f"{model_dir} holds no .safetensors files")
    for f in files:
        with safe_open(str(f), framework="pt") as st:
            for name in st.keys():
                index[name] = f
    return index


def verify_shard_files(model_dir: Path, parts: "StageParts") -> None:
    """In a flowedge shard directory, check the sha256 of every file these parts will read."""
    from flowedge.errors import ChecksumError
    from flowedge.models.shards import MANIFEST, Manifest, file_sha256

    if not (Path(model_dir) / MANIFEST).is_file():
        return
    manifest = Manifest.load(model_dir)
    files = [manifest.head] if parts.embed or parts.head else []
    files += [s for s in manifest.stages if s.start < parts.end and parts.start < s.end]
    for spec in files:
        path = Path(model_dir) / spec.file
        if not path.is_file():
            raise ModelError(f"shard {spec.file} is missing from {model_dir}")
        actual = file_sha256(path)
        if actual != spec.sha256:
            raise ChecksumError(f"shard {spec.file} is corrupt: sha256 {actual[:16]}… != manifest "
                                f"{spec.sha256[:16]}…")


def _read(index: dict[str, Path], names: list[str], dtype: torch.dtype) -> dict[str, torch.Tensor]:
    by_file: dict[Path, list[str]] = {}
    for n in names:
        by_file.setdefault(index[n], []).append(n)
    out: dict[str, torch.Tensor] = {}
    for f, ns in by_file.items():
        with safe_open(str(f), framework="pt") as st:
            for n in ns:
                out[n] = st.get_tensor(n).to(dtype)
    return out


@dataclass(frozen=True, slots=True)
class StageParts:
    """Which parts of the model a StageModel holds; layers are the half-open range [start, end)."""
    start: int
    end: int
    embed: bool = False
    head: bool = False


class StageModel(nn.Module):
    def __init__(self, config, parts: StageParts, layers: nn.ModuleList, embed: nn.Module | None,
                 norm: nn.Module | None, lm_head: nn.Module | None, rotary: nn.Module) -> None:
        super().__init__()
        self.config = config
        self.parts = parts
        self.layers = layers
        self.embed_tokens = embed
        self.norm = norm
        self.lm_head = lm_head
        self.rotary = rotary

    # ---- construction -------------------------------------------------------------------------
    @classmethod
    def load(cls, model_dir: Path | str, parts: StageParts | None = None,
             dtype: torch.dtype = torch.float32, quant: str = "none",
             quant_lm_head: bool = False) -> "StageModel":
        """Build the requested parts from an HF model dir or a flowedge shard dir (same tensor names).
        `quant` (none | nf4 | int4 | auto) quantizes the decoder layers' Linears (W4A16); the embedding
        stays in `dtype`, and so does the lm_head unless `quant_lm_head` (a draft model: its logits only
        steer proposals, so 4-bit costs no correctness). A tied embedding keeps its own copy."""
        from transformers import AutoModelForCausalLM

        t0 = time.monotonic()
        model_dir = Path(model_dir)
        config = load_config(model_dir)
        n_layers = config.num_hidden_layers
        parts = parts or StageParts(0, n_layers, embed=True, head=True)
        if not 0 <= parts.start <= parts.end <= n_layers:
            raise ModelError(f"layer range [{parts.start}, {parts.end}) outside the model's {n_layers} layers")
        verify_shard_files(model_dir, parts)
        index = _tensor_index(model_dir)
        with torch.device("meta"):
            skeleton = AutoModelForCausalLM.from_config(config, dtype=dtype)
        inner = skeleton.model
        layers = nn.ModuleList(inner.layers[parts.start:parts.end])
        names = [n for n in index if n.startswith(_LAYER_PREFIX)
                 and parts.start <= int(n[len(_LAYER_PREFIX):].split(".", 1)[0]) < parts.end]
        state = {n[len(_LAYER_PREFIX):]: t for n, t in _read(index, names, dtype).items()}
        # ModuleList keys are 0-based; the checkpoint's are absolute layer numbers.
        state = {f"{int(k.split('.', 1)[0]) - parts.start}.{k.split('.', 1)[1]}": v for k, v in state.items()}
        _load_into(layers, state, "layers")
        embed = norm = lm_head = None
        if parts.embed or parts.head:
            embed = inner.embed_tokens
            _load_into(embed, {"weight": _read(index, ["model.embed_tokens.weight"], dtype)["model.embed_tokens.weight"]}, "embedding")
        if parts.head:
            norm = inner.norm
            _load_into(norm, {"weight": _read(index, ["model.norm.weight"], dtype)["model.norm.weight"]}, "final norm")
            lm_head = skeleton.lm_head
            if "lm_head.weight" in index:
                _load_into(lm_head, _strip(_read(index, ["lm_head.weight"], dtype), "lm_head."), "lm_head")
            else:  # tied embeddings: share the embedding matrix, no second copy
                lm_head.weight = embed.weight
            if not parts.embed:
                pass  # embedding kept anyway for a tied lm_head; costs no extra memory
        rotary = type(inner.rotary_emb)(config=config)
        if quant != "none" and (len(layers) or (quant_lm_head and lm_head is not None)):
            from flowedge.models.quant import default_backend, quantize_module

            backend = default_backend("cpu") if quant == "auto" else quant
            targets = nn.ModuleDict({"layers": layers})
            if quant_lm_head and lm_head is not None:
                targets["head"] = nn.ModuleDict({"lm_head": lm_head})
            report = quantize_module(targets, backend, compute_dtype=dtype, skip_names=())
            if quant_lm_head and lm_head is not None:
                lm_head = targets["head"]["lm_head"]
            log.info("quantized layers [%d, %d)%s with %s: %d Linears, %.0f -> %.0f MB%s", parts.start,
                     parts.end, " + lm_head" if "head" in targets else "", backend, report.quantized,
                     report.bytes_before / 1e6, report.bytes_after / 1e6,
                     f", {len(report.skipped)} skipped" if report.skipped else "")
        model = cls(config, parts, layers, embed, norm, lm_head, rotary).eval()
        log.info("loaded %s layers [%d, %d)%s%s in %.1f s", model_dir.name, parts.start, parts.end,
                 " +embed" if parts.embed else "", " +head" if parts.head else "", time.monotonic() - t0)
        return model

    # ---- state --------------------------------------------------------------------------------
    def new_cache(self, capacity: int = 256) -> KVCache:
        c = self.config
        head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
        dtype = self.rotary.inv_freq.dtype if not self.layers else next(self.layers.parameters()).dtype
        return KVCache(range(self.parts.start, self.parts.end), c.num_key_value_heads, head_dim,
                       dtype, capacity)

    @property
    def dtype(self) -> torch.dtype:
        for p in self.parameters():
            return p.dtype
        return torch.float32

    # ---- compute ------------------------------------------------------------------------------
    @torch.inference_mode()
    def embed(self, token_ids: torch.Tensor) -> torch.Tensor:
        # token_ids: [n] -> [n, H]
        if self.embed_tokens is None:
            raise ModelError("this stage holds no embedding")
        return self.embed_tokens(token_ids)

    @torch.inference_mode()
    def forward_layers(self, hidden: torch.Tensor, positions: torch.Tensor, mask: torch.Tensor,
                       cache: KVCache) -> torch.Tensor:
        # hidden: [n, H]; positions: [n] absolute; mask: [n, cache.length + n] float (0 / -inf) -> [n, H]
        if hidden.shape[0] == 0 or not len(self.layers):
            return hidden
        h = hidden.unsqueeze(0)
        pos = positions.unsqueeze(0)
        pe = self.rotary(h, position_ids=pos)
        m = mask.to(h.dtype).unsqueeze(0).unsqueeze(0)
        for layer in self.layers:
            h = layer(h, attention_mask=m, position_ids=pos, past_key_values=cache, use_cache=True,
                      position_embeddings=pe)
        return h.squeeze(0)

    @torch.inference_mode()
    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        # hidden: [n, H] (output of the last layer) -> [n, V] float32
        if self.lm_head is None:
            raise ModelError("this stage holds no lm_head")
        return self.lm_head(self.norm(hidden)).float()


def _strip(state: dict[str, torch.Tensor], prefix: str) -> dict[str, torch.Tensor]:
    return {k[len(prefix):]: v for k, v in state.items()}


def _load_into(module: nn.Module, state: dict[str, torch.Tensor], what: str) -> None:
    try:
        module.load_state_dict(state, strict=True, assign=True)
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


def block_diagonal(blocks: list[torch.Tensor]) -> torch.Tensor:
    """[sum n_i, sum m_i] bool: each request's rows see only its own columns (its cache, then its rows)."""
    rows = sum(b.shape[0] for b in blocks)
    cols = sum(b.shape[1] for b in blocks)
    out = torch.zeros(rows, cols, dtype=torch.bool)
    r = c = 0
    for b in blocks:
        out[r:r + b.shape[0], c:c + b.shape[1]] = b
        r, c = r + b.shape[0], c + b.shape[1]
    return out


def read_json(path: Path) -> dict:
    try:
        return json.loads(Path(path).read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise ModelError(f"cannot read {path}: {e}") from e
