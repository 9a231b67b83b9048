"""Roofline cost model: how long one forward or one transfer takes on a profiled device or link.

A forward either streams its weights (and the KV cache) through memory or is bound by arithmetic,
whichever is slower, plus fixed per-call and per-layer overheads that dominate small models on
Python runtimes. Calibration and sources: `device_profiles/README.md`.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from flowedge.costs.link_costs import expected_s
from flowedge.costs.profiles import ComputePath, DeviceProfile, LinkProfile
from flowedge.errors import ConfigError

SMALL_TOKENS = 128  # at or below: eta_flops_small (GEMV-like, tensor cores half idle)
LARGE_TOKENS = 512  # at or above: eta_flops_large
LOGIT_BYTES = 4  # logits come out of the lm_head as fp32


@dataclass(frozen=True, slots=True)
class ModelShape:
    """What the cost model needs to know about a model or a layer range of one."""

    params: int  # weights touched by one forward (layer range, or lm_head)
    layers: int
    hidden: int
    flops_per_token: float  # 2 * params; attention over the context is added per forward
    kv_bytes_per_token: float  # K+V bytes per context token over these layers, at 16-bit

    def __post_init__(self) -> None:
        if self.params < 0 or self.layers < 0 or self.hidden <= 0:
            raise ConfigError(f"invalid model shape {self}")


def _attr(config: Any, name: str) -> int:
    value = getattr(config, name, None)
    if value is None:
        raise ConfigError(f"model config has no {name}; cannot estimate its cost")
    return int(value)


def _head_dim(config: Any) -> int:
    head_dim = getattr(config, "head_dim", None)
    if head_dim:
        return int(head_dim)
    return _attr(config, "hidden_size") // _attr(config, "num_attention_heads")


def _layer_params(config: Any) -> int:
    """Parameters of one dense decoder layer (attention + gated MLP + 2 norms; biases ignored)."""
    hidden = _attr(config, "hidden_size")
    q_dim = _attr(config, "num_attention_heads") * _head_dim(config)
    kv_dim = _attr(config, "num_key_value_heads") * _head_dim(config)
    attention = hidden * q_dim * 2 + hidden * kv_dim * 2  # q, o, k, v projections
    mlp = 3 * hidden * _attr(config, "intermediate_size")  # gate, up, down
    return attention + mlp + 2 * hidden


def shape_of_layers(config: Any, start: int, end: int) -> ModelShape:
    """Decoder layers [start, end) of a Qwen2/Llama-style config."""
    total = _attr(config, "num_hidden_layers")
    if not 0 <= start <= end <= total:
        raise ConfigError(f"layer range [{start}, {end}) outside 0..{total}")
    layers = end - start
    params = layers * _layer_params(config)
    kv_dim = _attr(config, "num_key_value_heads") * _head_dim(config)
    return ModelShape(
        params=params,
        layers=layers,
        hidden=_attr(config, "hidden_size"),
        flops_per_token=2.0 * params,
        kv_bytes_per_token=float(layers * 2 * kv_dim * 2),
    )


def shape_of_head(config: Any) -> ModelShape:
    """lm_head plus final norm; the embedding lookup reads one row per token, so it is free."""
    hidden = _attr(config, "hidden_size")
    params = _attr(config, "vocab_size") * hidden + hidden
    return ModelShape(
        params=params, layers=0, hidden=hidden, flops_per_token=2.0 * params, kv_bytes_per_token=0.0
    )


def is_draft_head(config: Any) -> bool:
    """A draft head's config (models/draft_head.DraftHeadConfig) rather than a draft model's."""
    return bool(getattr(config, "is_draft_head", False))


def shape_of_draft_head(config: Any) -> tuple[ModelShape, ModelShape]:
    """A draft head's body (the Linear fusing embedding and feature, one decoder layer) and its lm_head
    over the reduced draft vocabulary."""
    hidden = _attr(config, "hidden_size")
    params = 2 * hidden * hidden + _layer_params(config)
    kv_dim = _attr(config, "num_key_value_heads") * _head_dim(config)
    body = ModelShape(params=params, layers=1, hidden=hidden, flops_per_token=2.0 * params,
                      kv_bytes_per_token=float(2 * kv_dim * 2))
    head_params = _attr(config, "draft_vocab") * hidden
    head = ModelShape(params=head_params, layers=0, hidden=hidden, flops_per_token=2.0 * head_params,
                      kv_bytes_per_token=0.0)
    return body, head


def shape_of_model(config: Any) -> ModelShape:
    """The whole model, as the draft model (or draft head) on node 0 runs it."""
    if is_draft_head(config):
        body, head = shape_of_draft_head(config)
    else:
        body = shape_of_layers(config, 0, _attr(config, "num_hidden_layers"))
        head = shape_of_head(config)
    return ModelShape(
        params=body.params + head.params,
        layers=body.layers,
        hidden=body.hidden,
        flops_per_token=body.flops_per_token + head.flops_per_token,
        kv_bytes_per_token=body.kv_bytes_per_token,
    )


def resolve_path(device: DeviceProfile, path: str | None, tokens: int) -> ComputePath:
    """Pick the concrete path; a family (`hf-bnb4`) picks its single-token kernel for 1 token."""
    name = path or device.default_path
    if name in device.paths:
        return device.paths[name]
    if device.has_path(name):
        return device.paths[f"{name}-single" if tokens == 1 else f"{name}-multi"]
    raise ConfigError(f"device {device.name} has no path {name!r}; known: {sorted(device.paths)}")


def _eta_flops(path: ComputePath, tokens: int) -> float:
    if tokens <= SMALL_TOKENS:
        return path.eta_flops_small
    if tokens >= LARGE_TOKENS:
        return path.eta_flops_large
    frac = (tokens - SMALL_TOKENS) / (LARGE_TOKENS - SMALL_TOKENS)
    return path.eta_flops_small + frac * (path.eta_flops_large - path.eta_flops_small)


def forward_time_s(
    device: DeviceProfile, shape: ModelShape, tokens: int, context: int, path: str | None = None,
    attended: float | None = None,
) -> float:
    """Seconds for one forward of `tokens` new tokens reading `context` cached ones; each row attends over
    `attended` of them (default all: one request; a batched forward's rows see only their own request's)."""
    if tokens < 0 or context < 0:
        raise ConfigError(f"tokens and context must be >= 0, got {tokens}, {context}")
    if tokens == 0:
        return 0.0
    p = resolve_path(device, path, tokens)
    overhead_s = p.overhead_fwd_s + p.overhead_layer_s * shape.layers
    return overhead_s + _roofline_s(device, p, shape, tokens, context, attended)


def _roofline_s(device: DeviceProfile, p: ComputePath, shape: ModelShape, tokens: int, context: int,
                attended: float | None = None) -> float:
    """max(memory time, compute time) of one forward, without the fixed overheads, plus the weights'
    unpacking where one CPU thread does it in the same instruction stream as the dot products (flowedge's
    W4A16/W8A16 kernels: it hides under neither the DRAM stream nor the arithmetic)."""
    bandwidth_Bps = p.eta_bw * device.bandwidth_Bps
    kv_bytes = context * shape.kv_bytes_per_token * (p.act_bytes / 2.0)
    # tiled kernels (tinygemm) stream the weights once per tile of tokens: flat up to the tile size
    passes = -(-tokens // p.token_tile) if p.token_tile else 1
    memory_s = (shape.params * p.bytes_per_param * passes + kv_bytes) / bandwidth_Bps
    # attention: QK^T and AV, 2 FLOPs per multiply-add, over the context plus half the new tokens
    attention_flops = 4.0 * shape.layers * shape.hidden * ((context if attended is None else attended) + tokens / 2.0)
    flops_s = _eta_flops(p, tokens) * device.flops
    compute_s = tokens * (shape.flops_per_token + attention_flops) / flops_s
    unpack_s = shape.params * p.bytes_per_param * p.unpack_s_per_gb / 1e9
    return max(memory_s, compute_s) + unpack_s


def lm_head_time_s(device: DeviceProfile, config: Any, tokens: int, path: str | None = None) -> float:
    """lm_head over `tokens` hidden states, writing fp32 logits, then sampling on the host.

    A 152K vocabulary makes the copy-out and sampling a visible cost on small ARM CPUs.
    """
    if tokens <= 0:
        return 0.0
    chosen = resolve_path(device, path, tokens)
    head_path = chosen.head_path or chosen.name
    p = device.paths[head_path]
    vocab = _attr(config, "vocab_size")
    logits_s = tokens * vocab * LOGIT_BYTES / (p.eta_bw * device.bandwidth_Bps)
    sample_s = p.sample_s_per_mvocab * vocab / 1e6
    # the lm_head is one matmul appended to the node's work: no per-call overhead of its own
    return _roofline_s(device, p, shape_of_head(config), tokens, 0) + logits_s + sample_s


def lm_head_segment_ratio(device: DeviceProfile, config: Any, tokens: int, path: str | None = None) -> float:
    """How much more an lm_head over a `tokens`-node segment costs than over one token: ~1 where it is
    bandwidth-bound (GPUs), growing with the tokens where compute-bound (CPUs). Decides `auto` placement."""
    return lm_head_time_s(device, config, tokens, path) / lm_head_time_s(device, config, 1, path)


def draft_time_s(device: DeviceProfile, config: Any, tokens: int, context: int,
                 path: str | None = None, head_quantized: bool = False) -> float:
    """One draft-model call on node 0: its decoder layers on `path`, then its lm_head, on that path too
    when node 0 quantized it (`head_quantized`, flowedge's default for a draft), else on the path's
    head path. Top-k stays on the device."""
    if tokens <= 0:
        return 0.0
    if is_draft_head(config):
        return draft_head_time_s(device, config, tokens, context)
    body = shape_of_layers(config, 0, _attr(config, "num_hidden_layers"))
    chosen = resolve_path(device, path, tokens)
    head = chosen if head_quantized else device.paths[chosen.head_path or chosen.name]
    return forward_time_s(device, body, tokens, context, path) + _roofline_s(
        device, head, shape_of_head(config), tokens, 0)


def draft_head_time_s(device: DeviceProfile, config: Any, tokens: int, context: int) -> float:
    """One draft-head call on node 0: its layer and its lm_head over the draft vocabulary, both on the
    profile's `draft_head_path` (its weights' kernels: W8A16 on a CPU), one call's overheads."""
    body, head = shape_of_draft_head(config)
    path = device.draft_head_path or device.draft_path or device.default_path
    return forward_time_s(device, body, tokens, context, path) + _roofline_s(
        device, resolve_path(device, path, tokens), head, tokens, 0)


def decode_time_s(device: DeviceProfile, config: Any, context: int, path: str | None = None) -> float:
    """One plain autoregressive step of the whole model on one device (what benchmarks report)."""
    body = shape_of_layers(config, 0, _attr(config, "num_hidden_layers"))
    return forward_time_s(device, body, 1, context, path) + lm_head_time_s(device, config, 1, path)


def transfer_time_s(link: LinkProfile, nbytes: int) -> float:
    """One message over the link, on average: latency, serialisation at the link's goodput, its share of
    stalls and the per-message cost (costs/link_costs.py)."""
    return expected_s(link, nbytes)
