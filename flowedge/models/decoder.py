"""flowedge's own decoder block for the Qwen2 and Llama families, gpt-fast style.

Short tensor functions (RMSNorm, RoPE, SwiGLU) and one `DecoderLayer` whose submodule names are the
Hugging Face ones (`self_attn.q_proj`, `mlp.gate_proj`, `input_layernorm`...), so checkpoints, shards and
the W4A16 packed tensors load into it by name. Attention runs over each request's own KV cache with that
request's tree mask and absolute positions (kernels/attention.py: row-invariant), so a batched forward of
several requests gives every request the rows it would get alone.

Numerics follow transformers' eager Qwen2/Llama code (float32 RMSNorm, float32 rotary tables), which
stays the oracle in the tests.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from flowedge.kernels.attention import attend, fusable, fused_wanted, rope_attend
from flowedge.models.config import ModelConfig
from flowedge.models.kv_cache import KVCache
from flowedge.models.quant import fuse_native


# ---------------------------------------------------------------- tensor functions

def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    # x: [n, H] -> [n, H]; computed in float32, cast back, then scaled (as transformers does)
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(x.dtype)


@dataclass(frozen=True, slots=True)
class Rotary:
    """cos/sin tables for one forward's absolute positions: [n, D] each."""
    cos: torch.Tensor
    sin: torch.Tensor

    @classmethod
    def at(cls, positions: torch.Tensor, head_dim: int, theta: float, dtype: torch.dtype) -> "Rotary":
        # positions: [n] absolute -> tables [n, D]
        inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
        freqs = positions.float()[:, None] * inv_freq[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        return cls(emb.cos().to(dtype), emb.sin().to(dtype))

    def apply(self, x: torch.Tensor) -> torch.Tensor:
        # x: [n, heads, D] -> [n, heads, D]
        half = x.shape[-1] // 2
        rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
        return x * self.cos[:, None] + rotated * self.sin[:, None]


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.eps)


# ---------------------------------------------------------------- blocks

@dataclass(slots=True)
class RequestRows:
    """One request's share of a forward: its rows [start, start + n), its KV cache and its additive mask
    [n, cache.length + n] (0 where allowed)."""
    start: int
    n: int
    cache: KVCache
    mask: torch.Tensor


class Attention(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        h, d, bias = config.hidden_size, config.head_dim, config.attention_bias
        self.heads, self.kv_heads, self.head_dim = config.num_attention_heads, config.num_key_value_heads, d
        self.q_proj = nn.Linear(h, self.heads * d, bias=bias)
        self.k_proj = nn.Linear(h, self.kv_heads * d, bias=bias)
        self.v_proj = nn.Linear(h, self.kv_heads * d, bias=bias)
        self.o_proj = nn.Linear(self.heads * d, h, bias=False)
        self.qkv: nn.Module | None = None     # q, k and v in one call, once loaded (see `fuse`)
        self.fused_attention = fused_wanted()  # RoPE, cache write and attention in one native call

    def fuse(self) -> None:
        """Stack q/k/v into one native W4A16 call when all three are native (same bits, fewer calls)."""
        self.qkv = fuse_native([self.q_proj, self.k_proj, self.v_proj])
        if self.qkv is not None:
            del self.q_proj, self.k_proj, self.v_proj

    def _project(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        if self.qkv is None:
            return self.q_proj(x), self.k_proj(x), self.v_proj(x)
        kv = self.kv_heads * self.head_dim
        return self.qkv(x).split([self.heads * self.head_dim, kv, kv], dim=-1)

    def forward(self, x: torch.Tensor, rotary: Rotary, requests: list[RequestRows], layer: int) -> torch.Tensor:
        # x: [n, H] (normed) -> [n, H]
        n = x.shape[0]
        q, k, v = self._project(x)
        if self._can_fuse(q, k, v, rotary, requests):
            outs = []
            for r in requests:
                rows = slice(r.start, r.start + r.n)
                outs.append(rope_attend(q[rows], k[rows], v[rows], rotary.cos[rows], rotary.sin[rows], r.cache,
                                        layer, r.mask))
            out = outs[0] if len(outs) == 1 else torch.cat(outs)
            return self.o_proj(out.reshape(n, self.heads * self.head_dim))
        q = rotary.apply(q.reshape(n, self.heads, self.head_dim))
        k = rotary.apply(k.reshape(n, self.kv_heads, self.head_dim))
        v = v.reshape(n, self.kv_heads, self.head_dim)
        outs = []
        for r in requests:
            rows = slice(r.start, r.start + r.n)
            keys, values = r.cache.update(k[rows].transpose(0, 1)[None], v[rows].transpose(0, 1)[None], layer)
            outs.append(attend(q[rows], keys[0], values[0], r.mask))
        out = outs[0] if len(outs) == 1 else torch.cat(outs)
        return self.o_proj(out.reshape(n, self.heads * self.head_dim))

    def _can_fuse(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, rotary: Rotary,
                  requests: list[RequestRows]) -> bool:
        return (self.fused_attention and fusable(q, k, v, rotary.cos, rotary.sin)
                and all(isinstance(r.cache, KVCache) and r.cache.dtype == torch.float32 for r in requests))


class FeedForward(nn.Module):
    """SwiGLU: down(silu(gate(x)) * up(x))."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        h, i, bias = config.hidden_size, config.intermediate_size, config.mlp_bias
        self.gate_proj = nn.Linear(h, i, bias=bias)
        self.up_proj = nn.Linear(h, i, bias=bias)
        self.down_proj = nn.Linear(i, h, bias=bias)
        self.gate_up: nn.Module | None = None   # gate and up in one call, once loaded (see `fuse`)

    def fuse(self) -> None:
        self.gate_up = fuse_native([self.gate_proj, self.up_proj])
        if self.gate_up is not None:
            del self.gate_proj, self.up_proj

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.gate_up is None:
            return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))
        gate, up = self.gate_up(x).chunk(2, dim=-1)
        return self.down_proj(F.silu(gate) * up)


class DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, index: int) -> None:
        super().__init__()
        self.index = index
        self.self_attn = Attention(config)
        self.mlp = FeedForward(config)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def fuse(self) -> None:
        """After loading: one call for q/k/v and one for gate/up where the kernels allow it."""
        self.self_attn.fuse()
        self.mlp.fuse()

    def forward(self, h: torch.Tensor, rotary: Rotary, requests: list[RequestRows]) -> torch.Tensor:
        # h: [n, H] -> [n, H]
        h = h + self.self_attn(self.input_layernorm(h), rotary, requests, self.index)
        return h + self.mlp(self.post_attention_layernorm(h))


def run_layers(layers: nn.ModuleList, config: ModelConfig, hidden: torch.Tensor, positions: torch.Tensor,
               requests: list[RequestRows]) -> torch.Tensor:
    """hidden [n, H] through every layer; positions [n] absolute; requests partition the rows."""
    rotary = Rotary.at(positions, config.head_dim, config.rope_theta, hidden.dtype)
    h = hidden
    for layer in layers:
        h = layer(h, rotary, requests)
    return h
