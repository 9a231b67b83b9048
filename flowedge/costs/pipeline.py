"""A whole pipeline's costs on profiled devices: each node's work and each link's transfer in seconds.

The simulator charges them on its virtual clock; the planner predicts a cluster's speed from them.
Both price node 0's draft on the kernels it really runs (`draft_path_for`, `draft_quant_for`).
"""
from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from flowedge.core.config import SpecConfig
from flowedge.costs.link_costs import ring_s_for_link
from flowedge.costs.model import (draft_time_s, forward_time_s, lm_head_segment_ratio, lm_head_time_s,
                                  resolve_path, shape_of_layers, transfer_time_s)
from flowedge.costs.profiles import DeviceProfile, LinkProfile, load_device, load_link
from flowedge.costs.sizing import TreeCosts, tree_costs


class Work(Protocol):
    """What a node just computed (the engine's `Compute` action has these fields), read only."""

    @property
    def what(self) -> str: ...   # "stage" | "draft" | "lm_head" | "embed"

    @property
    def tokens(self) -> int: ...

    @property
    def context(self) -> int: ...

    @property
    def attended(self) -> float | None: ...


@dataclass
class CostModel:
    """Turns Compute actions and message sizes into seconds; None profile = free (tests)."""
    compute_s: Callable[[int, Work], float]
    transfer_s: Callable[[int, int, int], float]
    lm_head_segment_ratio: float | None = None   # last stage's l_max-token / 1-token lm_head (placement)
    tree: TreeCosts | None = None                # what flowspec's tree is sized from (None: no draft)
    link: LinkProfile | None = None              # every link's profile: the simulator's link clocks (None: transfer_s)
    link_seed: int = 0                           # the links' jitter and stalls, per directed link

    @staticmethod
    def free() -> "CostModel":
        return CostModel(lambda node, c: 0.0, lambda a, b, n: 0.0)


def draft_path_for(dev: DeviceProfile, stage_path: str | None = None) -> str | None:
    """Node 0 runs its draft on the stages' kernels, except a dequantizing family (bitsandbytes
    `-single`/`-multi`): drafting runs k tokens a call, where bnb is slower than plain fp16."""
    path = stage_path or dev.draft_path or dev.default_path
    if path not in dev.paths and dev.has_path("hf-fp16"):
        return "hf-fp16"
    return path


# Profile paths whose kernels node 0 also runs its draft on, and the quantization that gives the draft
# those kernels' numerics (flowedge quantizes all of a draft, lm_head included: engine/drafter.py).
DRAFT_QUANT_OF_PATH = {"torch-int4": "int4", "cpu-native": "int4"}


def draft_quant_for(device: str | None, stage_path: str | None = None) -> str:
    """How the simulated draft is quantized, so its proposals are the ones the charged kernels would
    make: a real int4 draft on int4 paths (torch's on CUDA, flowedge's W4A16 kernels on CPU); fp32 elsewhere
    (fp32 stands in for fp16, as for the stages)."""
    if device is None:
        return "none"
    return DRAFT_QUANT_OF_PATH.get(draft_path_for(load_device(device), stage_path) or "", "none")


def profile_costs(base_config: Any, draft_config: Any, ranges: Sequence[tuple[int, int]], device: str,
                  link: str | None, stage_path: str | None = None, draft_quantized: bool = False,
                  l_max: int = SpecConfig().l_max, topk: int = SpecConfig().topk) -> CostModel:
    """Costs on `device`; `stage_path` picks the stages' kernel family from the profile (default: its
    default_path: torch int4 on the Jetsons, what flowedge runs there; `hf-bnb4` is FlowSpec's testbed).
    `draft_quantized`: the draft's lm_head is 4-bit too (see `draft_quant_for`)."""
    dev = load_device(device)
    lnk = load_link(link or dev.default_link)
    stage_shapes = [shape_of_layers(base_config, a, b) for a, b in ranges]
    draft_path = draft_path_for(dev, stage_path)

    def compute_s(node: int, c: Work) -> float:
        if c.what == "lm_head":   # on node 0, or on the last stage when it chooses tokens
            return lm_head_time_s(dev, base_config, c.tokens, stage_path)
        if node == 0:
            if c.what == "draft":
                return draft_time_s(dev, draft_config, c.tokens, c.context, draft_path, draft_quantized)
            return 0.0
        return forward_time_s(dev, stage_shapes[node - 1], c.tokens, c.context, stage_path, c.attended)

    costs = CostModel(compute_s, lambda a, b, n: transfer_time_s(lnk, n), link=lnk)
    costs.lm_head_segment_ratio = lm_head_segment_ratio(dev, base_config, l_max, stage_path)
    if draft_config is not None:   # for sized_spec
        costs.tree = tree_costs(base_config, draft_config, ranges, [dev] * len(ranges), dev, stage_path=stage_path,
                                draft_path=draft_path, draft_quantized=draft_quantized, l_max=l_max,
                                topk=topk).over_links(ring_s_for_link(lnk, len(ranges)))
    return costs


# The profile path a stage's kernels take for a quantization, first one the device has (else its default):
# int4 runs flowedge's own W4A16 kernels on a CPU that has a profile for them (`cpu-native`), torch's on CUDA.
QUANT_PATHS = {"int4": ("cpu-native", "torch-int4"), "auto": ("cpu-native", "torch-int4"), "nf4": ("hf-bnb4",),
               "none": ("torch-fp16", "hf-fp16", "cpu-fp32")}


def path_for_quant(device: DeviceProfile, quant: str) -> str:
    """The kernel path that runs `quant` weights on `device` (a CPU runs unquantized weights in fp32)."""
    default = resolve_path(device, None, 1)
    if quant == "none" and default.bytes_per_param >= 2.0:
        return device.default_path
    return next((p for p in QUANT_PATHS.get(quant, ()) if device.has_path(p)), device.default_path)
