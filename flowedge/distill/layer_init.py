"""Start a draft head from the base model's last decoder layer instead of random weights.

A head trained from scratch on a 2-core CPU learns slowly: tens of thousands of tokens give it a
held-out agreement with the base of ~0.15. The base's last layer already maps a hidden state to what
the final norm and lm_head read, so its attention and MLP weights are a far better start (the head has
the same attention shape; its MLP is narrower, so it keeps the base's strongest channels). The fusion
Linear starts as the sum of the normalised embedding and feature, so the layer first sees a vector of
the kind a residual stream holds.

Weights are read through the loaded (quantized) modules themselves: an identity batch through a Linear
gives its dequantized matrix exactly, whatever kernel or packing it uses.
"""
from __future__ import annotations

import logging

import torch
from torch import nn

from flowedge.models.decoder import DecoderLayer, FeedForward
from flowedge.models.draft_head import DraftHead

log = logging.getLogger(__name__)


@torch.no_grad()
def dense_weight(module: nn.Module, in_features: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(weight [out, in], bias [out]) of any Linear-like module, float32: rows of the identity through it."""
    zero = module(torch.zeros(1, in_features)).float()[0]
    eye_out = module(torch.eye(in_features)).float()
    return (eye_out - zero).t().contiguous(), zero


def strongest_channels(gate: torch.Tensor, up: torch.Tensor, down: torch.Tensor, keep: int) -> torch.Tensor:
    """Indices of the `keep` MLP channels with the largest weight norms through gate, up and down."""
    score = gate.norm(dim=1) * up.norm(dim=1) * down.norm(dim=0)
    return score.topk(keep).indices.sort().values


@torch.no_grad()
def init_from_last_layer(head: DraftHead, base_layer: DecoderLayer, hidden: int) -> None:
    """Copy `base_layer` (a loaded DecoderLayer of the base) into the head's layer; see the module doc."""
    attn, mine = base_layer.self_attn, head.layer.self_attn
    for name in ("q_proj", "k_proj", "v_proj", "o_proj"):
        weight, bias = dense_weight(getattr(attn, name), hidden)
        target = getattr(mine, name)
        target.weight.copy_(weight)
        if target.bias is not None:
            target.bias.copy_(bias)
    gate, up = _gate_up(base_layer.mlp, hidden)
    down, _ = dense_weight(base_layer.mlp.down_proj, gate.shape[0])
    keep = strongest_channels(gate, up, down, head.config.intermediate_size)
    head.layer.mlp.gate_proj.weight.copy_(gate[keep])
    head.layer.mlp.up_proj.weight.copy_(up[keep])
    head.layer.mlp.down_proj.weight.copy_(down[:, keep])
    for name in ("input_layernorm", "post_attention_layernorm"):
        getattr(head.layer, name).weight.copy_(getattr(base_layer, name).weight.float())
    head.fc.weight.copy_(torch.cat([torch.eye(hidden), torch.eye(hidden)], dim=1))
    head.fc.bias.zero_()
    log.info("draft head starts from the base's last layer (%d of %d MLP channels)", keep.numel(), gate.shape[0])


def _gate_up(mlp: FeedForward, hidden: int) -> tuple[torch.Tensor, torch.Tensor]:
    if mlp.gate_up is not None:
        both, _ = dense_weight(mlp.gate_up, hidden)
        gate, up = both.chunk(2, dim=0)
        return gate, up
    return dense_weight(mlp.gate_proj, hidden)[0], dense_weight(mlp.up_proj, hidden)[0]
