"""Size FlowSpec's initial draft tree from a device profile's costs instead of fixed paper numbers.

Node 0 builds the initial tree with one draft call per level before the first segment leaves, and
with pipeline fill (`FlowSpec._fill`) it keeps drafting while segments travel. Every level in the
initial tree therefore delays the round's first verification by one draft call, and a round starts
after every restart. Two regimes:

- Stages whose segment cost is flat in its token count (bandwidth-bound GPUs; torch int4 streams the
  weights once per 16-token tile: every Jetson profile's default path): the root and its top-k leave
  after one draft call (d0 = 1) and the fill's best-first expansions add the depth. Extra nodes the
  expansions send cost the stages nothing. Measured on 5 x Orin Nano, MT-bench (flowspec, T=0):
  +5 to +13% per prompt over d0 = 2, most where rounds restart often.
- Stages whose cost grows with the tokens (CPUs, bitsandbytes' dequantizing path): a level only pays
  for itself if the draft could not have produced it while the first segment crossed the pipeline:
  d0 = ceil(pipeline latency / draft call), within [MIN_DEPTH, paper d0]. d0 = 1 there sends ~30%
  more nodes through the first stage (the expansions fill in what the small tree lacked), which
  becomes the busy device on CPUs (x86 and RPi 5 profiles, MT-bench/81: 2.44 -> 2.14 and
  1.43 -> 1.22 tok/s). On the bitsandbytes path d0 = 1 still won (10.47 -> 11.92 tok/s): sizing the
  expansions to what the first stage absorbs per draft call would let one rule cover both; open.

The width of an expansion's best-first draft call follows the same logic: where a call's cost is flat
in its token count (a bandwidth-bound GPU; torch int4 streams the weights once per 16-token tile),
running 16 open nodes instead of top-k's 10 costs nothing and deepens more of the likely paths.
"""
from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import replace

from flowedge.engine.config import SpecConfig

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
    `stage_segment_ratio`: a stage's l_max-token segment cost over a 1-token one (flat: d0 = 1)."""
    if draft_call_s <= 0:
        return spec
    if stage_segment_ratio is not None and stage_segment_ratio <= FLAT:
        depth = 1
    else:
        depth = max(MIN_DEPTH, min(spec.tree_depth, math.ceil(pipeline_latency_s / draft_call_s)))
    nodes = max(depth + 1, round(spec.tree_nodes * depth / spec.tree_depth))
    return replace(spec, tree_depth=depth, tree_nodes=nodes, draft_width=spec.draft_width or draft_width)
