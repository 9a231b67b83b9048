"""What a stage (or node 0) needs in memory: weights at the configured quantization, the KV cache for
the configured context, and the runtime's own footprint. The planner's feasibility test."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from flowedge.costs.model import is_draft_head, resolve_path, shape_of_head, shape_of_layers, shape_of_model
from flowedge.costs.profiles import DeviceProfile
from flowedge.errors import ConfigError

GiB = 1 << 30
# Weight bytes per parameter at rest and in memory. int4 (W4A16): 4-bit codes + a 16-bit scale and zero
# per group of 32 (models/quant.py, 0.625), with the tensors a Q4_K_M GGUF keeps at 6-8 bits at W8A16
# (models/quant8.py, 1.125): 0.701 measured on the real pair's loaded layers (device_profiles/README.md),
# so 0.70 plans what a stage really holds; nf4 (bitsandbytes): 4-bit codes + absmax per 64; none: 16-bit.
QUANT_BYTES_PER_PARAM = {"none": 2.0, "int4": 0.70, "auto": 0.70, "nf4": 0.5625}
HEAD_BYTES_PER_PARAM = 2.0          # embedding, norms and lm_head stay 16-bit (W4A16)
DRAFT_HEAD_BYTES_PER_PARAM = 1.125  # a draft head (engine/head_drafter.py): W8A16, its lm_head rows too
# Python + torch + allocator slack per process: measured stage RSS minus shard bytes on x86 is ~0.3 GB;
# a CUDA context on a Jetson adds a few hundred MB more (est), so plan with 0.75 GiB.
RUNTIME_OVERHEAD_BYTES = int(0.75 * GiB)
# When a device reports no free memory, the OS, its services and the display keep this much of the total.
OS_RESERVE_BYTES = 1 * GiB


def weight_bytes_per_param(device: DeviceProfile, quant: str, path: str | None) -> float:
    """Resident bytes per weight: the quantized layout, or for `none` the path's compute dtype."""
    if quant == "none":
        return resolve_path(device, path, 1).act_bytes
    return quant_bytes(quant)


def quant_bytes(quant: str) -> float:
    try:
        return QUANT_BYTES_PER_PARAM[quant]
    except KeyError:
        raise ConfigError(f"unknown quant {quant!r}; choose from {', '.join(QUANT_BYTES_PER_PARAM)}") from None


@dataclass(frozen=True, slots=True)
class MemoryNeed:
    """One node's memory need, in bytes, by part."""

    weights_bytes: int
    kv_bytes: int
    overhead_bytes: int

    @property
    def total_bytes(self) -> int:
        return self.weights_bytes + self.kv_bytes + self.overhead_bytes


def kv_bytes_per_token(config: Any, layers: int, dtype_bytes: float) -> float:
    """K and V of one context token over `layers` decoder layers, at `dtype_bytes` per element (the
    shape's figure counts 2-byte elements); the planner and the head's KV admission both use it."""
    return shape_of_layers(config, 0, layers).kv_bytes_per_token * dtype_bytes / 2.0


def kv_bytes(config: Any, layers: int, context: int, device: DeviceProfile, path: str | None = None) -> int:
    """K and V for `context` tokens over `layers` layers, in the activation dtype of the device's path."""
    return int(context * kv_bytes_per_token(config, layers, resolve_path(device, path, 1).act_bytes))


def stage_need(config: Any, layers: int, quant: str, context: int, device: DeviceProfile,
               path: str | None = None, holds_head: bool = False) -> MemoryNeed:
    """A stage serving `layers` decoder layers; `holds_head`: the last stage also holds the final norm and
    lm_head (16-bit) to choose tokens itself."""
    weights = shape_of_layers(config, 0, layers).params * weight_bytes_per_param(device, quant, path)
    if holds_head:
        weights += shape_of_head(config).params * HEAD_BYTES_PER_PARAM
    return MemoryNeed(int(weights), kv_bytes(config, layers, context, device, path), RUNTIME_OVERHEAD_BYTES)


def head_need(config: Any, draft_config: Any | None, draft_quant: str, context: int,
              device: DeviceProfile) -> MemoryNeed:
    """Node 0: the base model's embedding and lm_head (16-bit), the whole draft model and its KV cache."""
    vocab, hidden = int(config.vocab_size), int(config.hidden_size)
    weights = 2 * vocab * hidden * HEAD_BYTES_PER_PARAM
    kv = 0
    if draft_config is not None:   # a draft head is stored and run W8A16 whatever the draft quant
        per_param = DRAFT_HEAD_BYTES_PER_PARAM if is_draft_head(draft_config) else quant_bytes(draft_quant)
        weights += shape_of_model(draft_config).params * per_param
        kv = kv_bytes(draft_config, int(draft_config.num_hidden_layers), context, device)
    return MemoryNeed(int(weights), kv, RUNTIME_OVERHEAD_BYTES)


def drafter_need(draft_config: Any, draft_quant: str, context: int, device: DeviceProfile) -> MemoryNeed:
    """A drafter node: the whole draft model and the KV of node 0's draft context it replicates."""
    weights = shape_of_model(draft_config).params * quant_bytes(draft_quant)
    kv = kv_bytes(draft_config, int(draft_config.num_hidden_layers), context, device)
    return MemoryNeed(int(weights), kv, RUNTIME_OVERHEAD_BYTES)


def usable_bytes(device: DeviceProfile, free_memory_bytes: int | None) -> int:
    """What a node may use: the free memory it reported when it joined, else the profile's total less the
    OS reserve."""
    if free_memory_bytes is not None:
        return int(free_memory_bytes)
    return device.memory_bytes - OS_RESERVE_BYTES
