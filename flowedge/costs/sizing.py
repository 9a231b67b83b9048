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

from flowedge.core.config import SpecConfig
from flowedge.costs.model import draft_time_s, forward_time_s, lm_head_time_s, shape_of_layers
from flowedge.costs.profiles import DeviceProfile

MIN_DEPTH = 2
FLAT = 1.02         # a wider draft call, or a fuller segment, is "free" while it costs at most 2% more
MAX_WIDTH_FACTOR = 4


def flat_draft_width(call_s: Callable[[int], float], topk: int) -> int:
    """The most nodes one draft call can run for (about) the price of top-k of them."""
    limit = FLAT * call_s(topk)
    return max(n for n in range(topk, MAX_WIDTH_FACTOR * topk + 1) if call_s(n) <= limit)


def sized_spec(spec: SpecConfig, pipeline_latency_s: float, draft_call_s: float,
               draft_width: int = 0, stage_segment_ratio: float | None = None,
               flat_segment: int | None = None) -> SpecConfig:
    """`spec` with tree_depth and tree_nodes scaled to the costs (nodes per level kept as in `spec`),
    and the expansion's draft width where given (`flat_draft_width`) and not set in `spec`.
    `stage_segment_ratio`: a stage's l_max-token segment cost over a 2-token one (flat: d0 = 1).
    `flat_segment` (`flat_segment_for`): where it is below exp_nodes, expansions send that many nodes,
    the best ones not yet sent (`exp_fresh`), so no segment costs a stage more than node 0's step."""
    if draft_call_s <= 0:
        return spec
    if flat_segment is not None and flat_segment < spec.exp_nodes:
        spec = replace(spec, exp_nodes=flat_segment, exp_fresh=True)
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
    prefill_chunk: int | None = None   # prompt tokens per prefill segment (`prefill_chunk_for`); None: as set
    flat_segment: int | None = None    # most tokens a segment carries at about an l_max one's cost (flat only)
    segment_step_s: float = 0.0   # the slowest stage on an l_max segment (a pipedec level's step)
    n_stages: int = 0
    # under load (engine/auto_load.LoadModel), for 1, 2, ... MAX_LOAD requests at once:
    ar_batch_s: tuple[float, ...] = ()      # the slowest stage's ar-pp step (the last with its lm_head)
    draft_batch_s: tuple[float, ...] = ()   # one draft call (`draft_width` rows per request)
    flow_batch_s: tuple[float, ...] = ()    # the slowest stage on their mean flowspec segments
    ring_s: float = 0.0           # the links' share of one trip around the pipeline (in both latencies above)

    def over_links(self, ring_s: float) -> "TreeCosts":
        """These costs with one trip's link time `ring_s` added to each trip through the pipeline (ar-pp's
        token, flowspec's round restart, pipedec's miss), so slow links deepen the tree and move `auto`
        towards speculation (costs/link_costs.ring_s_from_rtts: from the round trips the head measures)."""
        extra = max(0.0, ring_s) - self.ring_s
        return replace(self, ring_s=self.ring_s + extra, token_latency_s=self.token_latency_s + extra,
                       pipeline_latency_s=self.pipeline_latency_s + extra)


FLOW_SEGMENT = 32   # mean tokens per flowspec segment: 16-node initial segments and 64-node expansions
MAX_LOAD = 16       # requests sharing a draft call that `draft_batch_s` covers (`max_concurrent` is 4 by default)


SIZING_CONTEXT = 256   # tokens of context the costs are taken at (a chat turn's order of magnitude)


def prefill_chunk_for(stage_s: Callable[[int], float], n_stages: int, l_max: int, max_chunk: int,
                      prompt_tokens: int = SIZING_CONTEXT) -> int:
    """Prompt tokens per prefill segment: the chunk that gets a `prompt_tokens` prompt through the
    pipeline soonest. Chunks flow through the stages one behind the other, so a prompt in c-token chunks
    takes about (chunks + stages - 1) steps of the slowest stage on c tokens. Where a stage's cost is flat
    up to l_max tokens (a bandwidth-bound GPU: torch int4 streams the weights once per 16-token tile) that
    is about l_max-token chunks: one 256-token chunk crosses 14 Orin Nano stages of a 70B in 14 x 1.3 s,
    sixteen 16-token chunks in (16 + 13) x 88 ms. Candidates: l_max, 2 l_max, ... up to `max_chunk`."""
    sizes = [max_chunk]
    c = l_max
    while c < max_chunk:
        sizes.append(c)
        c *= 2

    def prompt_s(c: int) -> float:
        return (math.ceil(prompt_tokens / c) + n_stages - 1) * stage_s(c)

    return min(sorted(sizes, reverse=True), key=prompt_s)


def flat_segment_for(stage_s: Callable[[int], float], l_max: int, most: int, draft_call_s: float) -> int:
    """The most tokens (up to `most`) a segment can carry while a stage's cost for it stays within node
    0's draft call (the step node 0 sets anyway) or about an l_max-token segment's. A 70B stage on an
    Orin Nano is flat up to its 16-token int4 tile and pays a tile per 16 tokens after: a 64-node
    expansion there costs a stage 324 ms where 16 nodes cost 88 (the draft call: 36), and with 14
    stages in flight that is the pipeline's step. The 1.5B's 7-layer stages run 64 nodes well within
    a draft call, so they keep the setting."""
    limit = max(FLAT * stage_s(l_max), draft_call_s)
    return max([n for n in range(l_max, most + 1) if stage_s(n) <= limit], default=l_max)


def tree_costs(base_config: Any, draft_config: Any, ranges: Sequence[tuple[int, int]],
               stage_devices: Sequence[DeviceProfile], head_device: DeviceProfile, *,
               stage_path: str | None = None, draft_path: str | None = None, draft_quantized: bool = False,
               l_max: int = SpecConfig().l_max, topk: int = SpecConfig().topk,
               stage_paths: Sequence[str | None] | None = None,
               prefill_chunk: int = SpecConfig().prefill_chunk, exp_nodes: int = SpecConfig().exp_nodes) -> TreeCosts:
    """Costs of stage k's layers `ranges[k]` on `stage_devices[k]` (each on `stage_paths[k]`, else
    `stage_path`, default its profile's own) and of the draft on node 0's `head_device`. Stages may
    differ (a mixed cluster): the steepest stage decides whether segments are flat."""
    ctx = SIZING_CONTEXT
    shapes = [shape_of_layers(base_config, a, b) for a, b in ranges]
    paths = list(stage_paths) if stage_paths is not None else [stage_path] * len(shapes)
    stages = list(zip(stage_devices, shapes, paths))

    def fwd(tokens: int, context: int = ctx) -> list[float]:
        return [forward_time_s(dev, shape, tokens, context, path) for dev, shape, path in stages]

    head_s = lm_head_time_s(stage_devices[-1], base_config, 1, paths[-1])
    latency = sum(fwd(l_max)) + head_s
    ratio = max(a / b for a, b in zip(fwd(l_max), fwd(2)))
    token_s = sum(fwd(1)) + head_s
    flow_s = max(fwd(FLOW_SEGMENT))

    def call_s(rows: int) -> float:
        return draft_time_s(head_device, draft_config, rows, ctx, draft_path, draft_quantized)

    def slowest_stage_s(tokens: int) -> float:   # at half the sizing context: a prompt's mean
        return max(fwd(tokens, ctx // 2))

    # Only where segments are flat: on compute-bound devices (CPUs) the profile's linear cost would also
    # favour small chunks, but a real process pays per message and per small GEMM what it does not model.
    flat = ratio <= FLAT
    chunk = prefill_chunk_for(slowest_stage_s, len(shapes), l_max, prefill_chunk) if flat else None
    segment = flat_segment_for(slowest_stage_s, l_max, exp_nodes, call_s(topk)) if flat else None
    if segment is not None and segment < FLOW_SEGMENT:   # expansions send no more than that
        flow_s = max(fwd(segment))
    width = flat_draft_width(call_s, topk)
    seg_tokens = min(FLOW_SEGMENT, segment) if segment is not None else FLOW_SEGMENT

    def batched(tokens_each: int, k: int) -> list[float]:   # k requests' rows, each attending its own context
        return [forward_time_s(dev, shape, tokens_each * k, ctx * k, path, attended=ctx) for dev, shape, path in stages]

    def ar_step(k: int) -> float:
        f = batched(1, k)
        return max([*f[:-1], f[-1] + lm_head_time_s(stage_devices[-1], base_config, k, paths[-1])])

    loads = range(1, MAX_LOAD + 1)
    return TreeCosts(latency, call_s(topk), width, ratio, token_s, flow_s, chunk, segment, max(fwd(l_max)),
                     len(shapes), tuple(ar_step(k) for k in loads), tuple(call_s(width * k) for k in loads),
                     tuple(max(batched(seg_tokens, k)) for k in loads))


def sized_spec_for(spec: SpecConfig, costs: TreeCosts) -> SpecConfig:
    return sized_spec(spec, costs.pipeline_latency_s, costs.draft_call_s, costs.draft_width,
                      costs.stage_segment_ratio, costs.flat_segment)
