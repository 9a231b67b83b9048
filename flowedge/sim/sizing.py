"""Size FlowSpec's initial draft tree from a device profile's costs instead of fixed paper numbers.

Node 0 builds the initial tree with one draft call per level before the first segment leaves, and
with pipeline fill (`FlowSpec._fill`) it keeps drafting while segments travel. So a level only pays
for itself if the draft could not have produced it while the first segment crossed the pipeline:
d0 = ceil(pipeline latency / draft call), within [MIN_DEPTH, paper d0]. With bitsandbytes stages on an
Orin Nano (68 ms a step) that gives the paper's 6; with int4 stages (15 ms) and a 40 ms draft call, 2.
"""
from __future__ import annotations

import math
from dataclasses import replace

from flowedge.engine.config import SpecConfig

MIN_DEPTH = 2


def sized_spec(spec: SpecConfig, pipeline_latency_s: float, draft_call_s: float) -> SpecConfig:
    """`spec` with tree_depth and tree_nodes scaled to the costs (nodes per level kept as in `spec`)."""
    if draft_call_s <= 0:
        return spec
    depth = max(MIN_DEPTH, min(spec.tree_depth, math.ceil(pipeline_latency_s / draft_call_s)))
    nodes = max(depth + 1, round(spec.tree_nodes * depth / spec.tree_depth))
    return replace(spec, tree_depth=depth, tree_nodes=nodes)
