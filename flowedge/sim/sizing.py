"""Size FlowSpec's initial draft tree from a device profile's costs instead of fixed paper numbers.

Node 0 builds the initial tree with one draft call per level before the first segment leaves, and
with pipeline fill (`FlowSpec._fill`) it keeps drafting while segments travel. Every level in the
initial tree therefore delays the round's first verification by one draft call, and a round starts
after every restart. Two regimes, told apart by what more nodes in a multi-token segment cost a
stage (its l_max-token segment over a 2-token one: FlowSpec's segments are never single tokens):

- Flat (bandwidth-bound GPUs; torch int4 streams the weights once per 16-token tile, every Jetson
  profile's default path; bitsandbytes, whose >1-token path dequantizes the weights whatever the
  count): the root and its top-k leave after one draft call (d0 = 1) and the fill's best-first
  expansions add the depth. The extra nodes the expansions send cost the stages nothing. Measured on
  5 x Orin Nano, MT-bench (flowspec, T=0): +5 to +13% per prompt over d0 = 2 on torch int4, most
  where rounds restart often; MT-bench/81 on bitsandbytes 10.47 -> 11.92 tok/s over d0 = 6.
- Growing with the tokens (CPUs: compute-bound): a level only pays for itself if the draft could not
  have produced it while the first segment crossed the pipeline: d0 = ceil(pipeline latency / draft
  call), within [MIN_DEPTH, paper d0]. d0 = 1 there sends ~30% more nodes through the first stage
  (the expansions fill in what the small tree lacked), which becomes the busy device (x86 and RPi 5
  profiles, MT-bench/81: 2.44 -> 2.14 and 1.43 -> 1.22 tok/s).

The width of an expansion's best-first draft call follows the same logic: where a call's cost is flat
in its token count (a bandwidth-bound GPU; torch int4 streams the weights once per 16-token tile),
running 16 open nodes instead of top-k's 10 costs nothing and deepens more of the likely paths.
"""
from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import Any

from flowedge.engine.auto_policy import Prediction
from flowedge.engine.config import SpecConfig
from flowedge.sim.costs import DeviceProfile, draft_time_s, forward_time_s, lm_head_time_s, shape_of_layers

MIN_DEPTH = 2
FLAT = 1.02         # a wider draft call, or a fuller segment, is "free" while it costs at most 2% more
MAX_WIDTH_FACTOR = 4


def flat_draft_width(call_s: Callable[[int], float], topk: int) -> int:
    """The most nodes one draft call can run for (about) the price of top-k of them."""
    limit = FLAT * call_s(topk)
    return max(n for n in range(topk, MAX_WIDTH_FACTOR * topk + 1) if call_s(n) <= limit)


def sized_spec(spec: SpecConfig, pipeline_latency_s: float, draft_call_s: float,
               draft_width: int = 0, stage_segment_ratio: float | None = None) -> SpecConfig:
    """`spec` with tree_depth and tree_nodes scaled to the costs (nodes per level kept as in `spec`),
    and the expansion's draft width where given (`flat_draft_width`) and not set in `spec`.
    `stage_segment_ratio`: a stage's l_max-token segment cost over a 2-token one (flat: d0 = 1)."""
    if draft_call_s <= 0:
        return spec
    if stage_segment_ratio is not None and stage_segment_ratio <= FLAT:
        depth = 1
    else:
        depth = max(MIN_DEPTH, min(spec.tree_depth, math.ceil(pipeline_latency_s / draft_call_s)))
    nodes = max(depth + 1, round(spec.tree_nodes * depth / spec.tree_depth))
    return replace(spec, tree_depth=depth, tree_nodes=nodes, draft_width=spec.draft_width or draft_width)


@dataclass(frozen=True)
class TreeCosts:
    """What sizing reads from the device profiles (simulator and daemon alike)."""
    pipeline_latency_s: float     # one l_max segment through every stage, then a 1-token lm_head
    draft_call_s: float           # one top-k-row draft call on node 0
    draft_width: int              # rows a draft call runs for the price of top-k (`flat_draft_width`)
    stage_segment_ratio: float    # the steepest stage's l_max-token / 2-token segment cost
    token_latency_s: float = 0.0  # one token through every stage, then a 1-token lm_head (ar-pp's step)
    flow_step_s: float = 0.0      # the slowest stage on a mean flowspec segment (`FLOW_SEGMENT` tokens)


FLOW_SEGMENT = 32   # mean tokens per flowspec segment: 16-node initial segments and 64-node expansions


SIZING_CONTEXT = 256   # tokens of context the costs are taken at (a chat turn's order of magnitude)


def tree_costs(base_config: Any, draft_config: Any, ranges: Sequence[tuple[int, int]],
               stage_devices: Sequence[DeviceProfile], head_device: DeviceProfile, *,
               stage_path: str | None = None, draft_path: str | None = None, draft_quantized: bool = False,
               l_max: int = SpecConfig().l_max, topk: int = SpecConfig().topk,
               stage_paths: Sequence[str | None] | None = None) -> TreeCosts:
    """Costs of stage k's layers `ranges[k]` on `stage_devices[k]` (each on `stage_paths[k]`, else
    `stage_path`, default its profile's own) and of the draft on node 0's `head_device`. Stages may
    differ (a mixed cluster): the steepest stage decides whether segments are flat."""
    ctx = SIZING_CONTEXT
    shapes = [shape_of_layers(base_config, a, b) for a, b in ranges]
    paths = list(stage_paths) if stage_paths is not None else [stage_path] * len(shapes)
    stages = list(zip(stage_devices, shapes, paths))

    def fwd(tokens: int) -> list[float]:
        return [forward_time_s(dev, shape, tokens, ctx, path) for dev, shape, path in stages]

    head_s = lm_head_time_s(stage_devices[-1], base_config, 1, paths[-1])
    latency = sum(fwd(l_max)) + head_s
    ratio = max(a / b for a, b in zip(fwd(l_max), fwd(2)))
    token_s = sum(fwd(1)) + head_s
    flow_s = max(fwd(FLOW_SEGMENT))

    def call_s(rows: int) -> float:
        return draft_time_s(head_device, draft_config, rows, ctx, draft_path, draft_quantized)

    return TreeCosts(latency, call_s(topk), flat_draft_width(call_s, topk), ratio, token_s, flow_s)


def sized_spec_for(spec: SpecConfig, costs: TreeCosts) -> SpecConfig:
    return sized_spec(spec, costs.pipeline_latency_s, costs.draft_call_s, costs.draft_width,
                      costs.stage_segment_ratio)


def predict_from_costs(costs: TreeCosts) -> Prediction | None:
    """What strategy `auto` starts from: each strategy's tok/s on these costs (engine/auto_policy.py)."""
    return Prediction.from_costs(costs.token_latency_s, costs.flow_step_s, costs.draft_call_s)
