"""Size FlowSpec's initial draft tree from a device profile's costs instead of fixed paper numbers.

Node 0 builds the initial tree with one draft call per level before the first segment leaves, and
with pipeline fill (`FlowSpec._fill`) it keeps drafting while segments travel. So a level only pays
for itself if the draft could not have produced it while the first segment crossed the pipeline:
d0 = ceil(pipeline latency / draft call), within [MIN_DEPTH, paper d0]. With bitsandbytes stages on an
Orin Nano (68 ms a step) that gives the paper's 6; with int4 stages (15 ms) and a 40 ms draft call, 2.

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
FLAT = 1.02         # a wider draft call is "free" while it costs at most 2% more
MAX_WIDTH_FACTOR = 4


def flat_draft_width(call_s: Callable[[int], float], topk: int) -> int:
    """The most nodes one draft call can run for (about) the price of top-k of them."""
    limit = FLAT * call_s(topk)
    return max(n for n in range(topk, MAX_WIDTH_FACTOR * topk + 1) if call_s(n) <= limit)


def sized_spec(spec: SpecConfig, pipeline_latency_s: float, draft_call_s: float,
               draft_width: int = 0) -> SpecConfig:
    """`spec` with tree_depth and tree_nodes scaled to the costs (nodes per level kept as in `spec`),
    and the expansion's draft width where given (`flat_draft_width`) and not set in `spec`."""
    if draft_call_s <= 0:
        return spec
    depth = max(MIN_DEPTH, min(spec.tree_depth, math.ceil(pipeline_latency_s / draft_call_s)))
    nodes = max(depth + 1, round(spec.tree_nodes * depth / spec.tree_depth))
    return replace(spec, tree_depth=depth, tree_nodes=nodes, draft_width=spec.draft_width or draft_width)
