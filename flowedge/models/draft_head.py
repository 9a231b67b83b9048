"""FlowSpec's own drafter: an EAGLE-style head over the base model's features.

One decoder layer drafts the base model's next feature (its normalised final hidden state, what its
lm_head reads) from the current token's embedding and the feature one position before, fused by a Linear:

    out_p = norm(layer(fc([embed_norm(embed(t_p)); feat_norm(f_{p-1})])))   ~ f_p
    logits_p = lm_head_r(out_p)                                              ~ base logits after t_p

For committed context the input feature is the base model's own (it comes back to node 0 with every
verified token); deeper in a draft tree it is the head's output at the node's parent. The logits cover a
reduced vocabulary (the most frequent tokens, `vocab_ids`), computed with the base model's own lm_head rows
(`attach_lm_head`), so the head never holds a vocabulary-sized matrix of its own; proposals are mapped
back to base ids. Embedding, lm_head and the final norm's scale are the base model's: a head file holds
only the fusion Linear, the layer and its norms (models/draft_head_io.py).
"""
from __future__ import annotations

import logging
from dataclasses import asdict, dataclass

import torch
from torch import nn

from flowedge.errors import ModelError
from flowedge.models.config import ModelConfig
from flowedge.models.decoder import DecoderLayer, RequestRows, RMSNorm, Rotary
from flowedge.models.kv_cache import KVCache

log = logging.getLogger(__name__)

HEAD_LAYER = 0   # the head's one layer: its index in its own KV cache


@dataclass(frozen=True, slots=True)
class DraftHeadConfig:
    """A head's shape and the base model it drafts for (`vocab_size`: the base's; `draft_vocab`: the
    reduced vocabulary its logits cover)."""
    base_name: str
    model_type: str
    hidden_size: int
    intermediate_size: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    vocab_size: int
    draft_vocab: int
    rope_theta: float = 10000.0
    rms_norm_eps: float = 1e-6
    attention_bias: bool = False
    max_position_embeddings: int = 32768

    is_draft_head = True     # what the cost model and planner tell a head from a draft model by
    num_hidden_layers = 1

    def __post_init__(self) -> None:
        if not 1 <= self.draft_vocab <= self.vocab_size:
            raise ModelError(f"draft vocabulary {self.draft_vocab} outside 1..{self.vocab_size}")
        if self.intermediate_size < 1:
            raise ModelError(f"head intermediate size must be >= 1 (got {self.intermediate_size})")

    @classmethod
    def for_base(cls, base, intermediate_size: int, draft_vocab: int) -> "DraftHeadConfig":
        """For a base ModelConfig (or a planner's model shape: missing fields take Qwen2's defaults)."""
        head_dim = getattr(base, "head_dim", None) or base.hidden_size // base.num_attention_heads
        return cls(getattr(base, "name", "base"), getattr(base, "model_type", "qwen2"), base.hidden_size,
                   intermediate_size, base.num_attention_heads, base.num_key_value_heads, head_dim, base.vocab_size,
                   min(draft_vocab, base.vocab_size), getattr(base, "rope_theta", 10000.0),
                   getattr(base, "rms_norm_eps", 1e-6), getattr(base, "attention_bias", False),
                   getattr(base, "max_position_embeddings", 32768))

    def layer_config(self) -> ModelConfig:
        return ModelConfig(self.model_type, self.hidden_size, self.intermediate_size, 1, self.num_attention_heads,
                           self.num_key_value_heads, self.vocab_size, self.head_dim, self.max_position_embeddings,
                           self.rms_norm_eps, self.rope_theta, self.attention_bias, name=f"head:{self.base_name}")

    def check_base(self, base: ModelConfig) -> None:
        """ModelError unless `base` is a model this head can draft for (same width and vocabulary)."""
        if (base.hidden_size, base.vocab_size, base.head_dim) != (self.hidden_size, self.vocab_size, self.head_dim):
            raise ModelError(f"the draft head was trained for {self.base_name} (hidden {self.hidden_size}, vocab "
                             f"{self.vocab_size}); {base.name} has hidden {base.hidden_size}, vocab {base.vocab_size}")

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, raw: dict) -> "DraftHeadConfig":
        try:
            return cls(**raw)
        except TypeError as e:
            raise ModelError(f"not a draft head config: {e}") from e


class DraftHead(nn.Module):
    vocab_ids: torch.Tensor   # a buffer: the base ids of the reduced vocabulary, in logit order

    def __init__(self, config: DraftHeadConfig) -> None:
        super().__init__()
        h, eps = config.hidden_size, config.rms_norm_eps
        self.config = config
        self.embed_norm = RMSNorm(h, eps)
        self.feat_norm = RMSNorm(h, eps)
        self.fc = nn.Linear(2 * h, h, bias=True)
        self.layer = DecoderLayer(config.layer_config(), HEAD_LAYER)
        self.norm = RMSNorm(h, eps)
        self.register_buffer("vocab_ids", torch.arange(config.draft_vocab))
        self.lm_head: nn.Module | None = None   # the base model's rows for vocab_ids (`attach_lm_head`)

    # ---- the maths, shared by inference and training ------------------------------------------------
    def fuse_inputs(self, embedded: torch.Tensor, features: torch.Tensor) -> torch.Tensor:
        # embedded, features: [n, H] -> [n, H]
        return self.fc(torch.cat([self.embed_norm(embedded), self.feat_norm(features)], dim=-1))

    def logits(self, out: torch.Tensor) -> torch.Tensor:
        # out: [n, H] (the head's predicted features) -> [n, draft_vocab] float32
        if self.lm_head is None:
            raise ModelError("the draft head has no lm_head rows attached (attach_lm_head)")
        return self.lm_head(out).float()

    def to_base_ids(self, idx: torch.Tensor) -> torch.Tensor:
        """Indices into the reduced vocabulary -> base token ids (any shape)."""
        return self.vocab_ids[idx]

    # ---- inference ----------------------------------------------------------------------------------
    def new_cache(self, capacity: int = 256) -> KVCache:
        c = self.config
        return KVCache(range(HEAD_LAYER, HEAD_LAYER + 1), c.num_key_value_heads, c.head_dim, torch.float32, capacity)

    @torch.inference_mode()
    def forward_cached(self, embedded: torch.Tensor, features: torch.Tensor, positions: torch.Tensor,
                       mask: torch.Tensor, cache: KVCache) -> torch.Tensor:
        """Rows appended to `cache`: embedded, features [n, H]; positions [n] absolute; mask [n,
        cache.length + n] additive -> the predicted features [n, H]."""
        n = embedded.shape[0]
        x = self.fuse_inputs(embedded, features)
        rotary = Rotary.at(positions, self.config.head_dim, self.config.rope_theta, x.dtype)
        return self.norm(self.layer(x, rotary, [RequestRows(0, n, cache, mask)]))

    def linears(self) -> dict[str, nn.Module]:
        """The Linears a head file stores quantized, by name."""
        attn, mlp = self.layer.self_attn, self.layer.mlp
        return {"fc": self.fc, "layer.self_attn.q_proj": attn.q_proj, "layer.self_attn.k_proj": attn.k_proj,
                "layer.self_attn.v_proj": attn.v_proj, "layer.self_attn.o_proj": attn.o_proj,
                "layer.mlp.gate_proj": mlp.gate_proj, "layer.mlp.up_proj": mlp.up_proj,
                "layer.mlp.down_proj": mlp.down_proj}

    def init_from_base(self, final_norm_weight: torch.Tensor) -> None:
        """Start the output norm at the base's final norm, so the head's outputs live where features do."""
        with torch.no_grad():
            self.norm.weight.copy_(final_norm_weight.float())


def lm_head_rows(model_dir, vocab_ids: torch.Tensor) -> torch.Tensor:
    """[len(vocab_ids), H] rows of the base model's lm_head (its tied embedding where it has none), at the
    16 bits stored: read row by row from a GGUF, else from the safetensors file."""
    from flowedge.models.gguf_tensors import GgufTensor, read_tensor
    from flowedge.models.stage import _tensor_index

    index = _tensor_index(model_dir)
    name = "lm_head.weight" if "lm_head.weight" in index else "model.embed_tokens.weight"
    source = index[name]
    ids = vocab_ids.to(torch.long)
    if isinstance(source, GgufTensor):
        import numpy as np

        blocks = source.block_rows()
        return source.dequantize(np.ascontiguousarray(blocks[ids.numpy()])).reshape(ids.numel(), -1)
    return read_tensor(source, name)[ids]


def attach_lm_head(head: DraftHead, rows: torch.Tensor, quantize: bool = True) -> None:
    """Give the head the base model's lm_head rows for its vocabulary: W8A16 (flowedge's kernel, the
    codes the base's own W8A16 lm_head holds for those rows) or, `quantize` False, a float32 Linear
    (training: frozen)."""
    from flowedge.models.quant8 import Int8Linear, pack_int8, packable8

    if rows.shape != (head.config.draft_vocab, head.config.hidden_size):
        raise ModelError(f"lm_head rows {tuple(rows.shape)} do not fit the head's vocabulary")
    if quantize and packable8(*rows.shape) is None:
        head.lm_head = Int8Linear.from_packed(pack_int8(rows), None)
        return
    linear = nn.Linear(rows.shape[1], rows.shape[0], bias=False)
    linear.weight = nn.Parameter(rows.float().contiguous(), requires_grad=False)
    head.lm_head = linear
