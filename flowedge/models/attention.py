"""The attention a StageModel's layers run: Hugging Face's SDPA, split per request in a batched forward.

Why split: SDPA over several requests' packed columns with a block-diagonal mask is not bit-identical, per
request, to the same request's attention alone: the kernel's reductions run over more (masked) key
columns in a different blocking (measured ~1e-7 on fp32 outputs, enough for the bf16 cast in front of a
W4A16 o_proj to flip a rounding and a near-tie token later: the real pair's MT-bench/81 under ar-pp at 2
concurrent requests diverged from its answer alone at token 14). So in a batched forward every request's
queries attend over that request's own cache with that request's own mask, through the very call a
forward alone makes; the Linear layers, where batching pays, still run over all rows at once. As a bonus
no request's K/V is ever copied into a concatenated buffer.

The decoder layers reach this function through `config._attn_implementation` (set by
`models/stage.load_config`); a batched forward passes its `PackedKV` as the `packed` keyword, which the
layers hand through to here untouched.
"""
from __future__ import annotations

import torch
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from flowedge.models.kv_cache import PackedKV

ATTN_IMPLEMENTATION = "flowedge_sdpa"


def attention(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
              attention_mask: torch.Tensor | None, packed: PackedKV | None = None,
              **kwargs) -> tuple[torch.Tensor, None]:
    """query: [1, Hq, n, D]; key, value: [1, Hkv, m, D] (alone) -> ([1, n, Hq, D], None).

    With `packed`, `key`/`value`/`attention_mask` are unused: request i's rows of `query` attend over
    `packed.columns[i]` (its cache, just updated for this layer) with `packed.masks[i]`."""
    if packed is None:
        return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)
    if packed.layer != module.layer_idx:
        raise RuntimeError(f"layer {module.layer_idx} attends over the K/V of layer {packed.layer}")
    outs = []
    for q, (k, v), mask in zip(query.split(packed.sizes, dim=2), packed.columns, packed.masks):
        if q.shape[2] == 0:
            outs.append(q.transpose(1, 2))
            continue
        outs.append(sdpa_attention_forward(module, q, k, v, mask, **kwargs)[0])
    return torch.cat(outs, dim=1), None


AttentionInterface.register(ATTN_IMPLEMENTATION, attention)
