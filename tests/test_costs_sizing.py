"""The initial-tree sizing rule and its wiring into the simulated cluster."""
from __future__ import annotations

import math

import pytest

from flowedge.core.config import SpecConfig
from flowedge.core.sampling import SamplingParams
from flowedge.costs.pipeline import draft_path_for
from flowedge.costs.profiles import load_device
from flowedge.costs.sizing import (FLAT, MIN_DEPTH, flat_draft_width, prefill_chunk_for, sized_spec, sized_spec_for,
                                   tree_costs)
from flowedge.sim.run import Cluster, balanced


@pytest.mark.parametrize(("latency_s", "draft_s", "depth", "nodes"), [
    (0.293, 0.0446, 6, 80),    # bnb stages on an Orin Nano: the paper's tree
    (0.073, 0.0397, 2, 27),    # int4 stages: the pipeline is quicker than two draft calls
    (0.001, 0.0400, MIN_DEPTH, 27),
    (0.100, 0.0400, 3, 40),
])
def test_depth_is_pipeline_latency_over_draft_call(latency_s, draft_s, depth, nodes):
    spec = sized_spec(SpecConfig(), latency_s, draft_s)
    assert (spec.tree_depth, spec.tree_nodes) == (depth, nodes)
    assert spec.l_max == SpecConfig().l_max and spec.exp_nodes == SpecConfig().exp_nodes


@pytest.mark.parametrize("latency_s", [0.293, 0.073, 0.001])
def test_flat_stage_cost_sends_the_root_and_its_topk_after_one_draft_call(latency_s):
    spec = sized_spec(SpecConfig(), latency_s, 0.0356, stage_segment_ratio=1.0)
    assert spec.tree_depth == 1 and spec.tree_nodes >= SpecConfig().topk + 1
    # a stage whose segment cost grows with its tokens keeps the latency rule
    assert sized_spec(SpecConfig(), 0.293, 0.0446, stage_segment_ratio=3.5).tree_depth == 6


def test_free_costs_leave_the_spec_alone():
    assert sized_spec(SpecConfig(), 1.0, 0.0) == SpecConfig()


def test_cluster_sizes_only_strategies_that_expand(tiny_pair):
    base, draft = tiny_pair
    spec = SpecConfig(tree_nodes=24, tree_depth=4, topk=4, l_max=6, exp_nodes=12, exp_depth=3)
    cluster = Cluster(base, draft, 3, spec, size_from_costs=True)
    costs = cluster.costs("orin-nano-8gb", None)
    tree = costs.tree
    assert tree.draft_call_s > 0 and tree.pipeline_latency_s > 0
    flow, _ = cluster.build("flowspec", costs)
    naive, _ = cluster.build("naive-pp", costs)
    chunked = spec.with_(prefill_chunk=tree.prefill_chunk)   # every strategy's prompt: chunks from the profile
    assert flow.config == sized_spec(chunked, tree.pipeline_latency_s, tree.draft_call_s, tree.draft_width,
                                     tree.stage_segment_ratio)
    assert tree.stage_segment_ratio == pytest.approx(1.0)   # torch int4: flat up to its 16-token tile
    assert flow.config.tree_depth == 1
    assert flow.config.expansion_width == 16 > spec.topk   # torch int4 on the Orin: a 16-token tile
    assert naive.config == chunked
    res, _, _ = cluster.generate("flowspec", [3, 4, 5, 6], 12, SamplingParams(), device="orin-nano-8gb")
    assert len(res.done.token_ids) == 12


def test_draft_width_fills_a_flat_cost_and_stays_at_topk_on_a_rising_one():
    tiled = lambda n: 0.035 * (-(-n // 16))        # noqa: E731 - weights streamed once per 16 tokens
    rising = lambda n: 0.010 + 0.002 * n            # noqa: E731 - compute-bound CPU
    assert flat_draft_width(tiled, 10) == 16
    assert flat_draft_width(rising, 10) == 10
    assert sized_spec(SpecConfig(), 0.07, 0.04, 16).expansion_width == 16
    assert sized_spec(SpecConfig(draft_width=12), 0.07, 0.04, 16).expansion_width == 12   # a set flag wins
    assert SpecConfig().expansion_width == SpecConfig().topk


def _qwen_configs():
    """The real pair's shapes (Qwen2.5-Coder 1.5B and 0.5B), no weights: costs read only the shapes."""
    from transformers import Qwen2Config

    base = Qwen2Config(hidden_size=1536, intermediate_size=8960, num_hidden_layers=28, num_attention_heads=12,
                       num_key_value_heads=2, vocab_size=151936)
    draft = Qwen2Config(hidden_size=896, intermediate_size=4864, num_hidden_layers=24, num_attention_heads=14,
                        num_key_value_heads=2, vocab_size=151936, tie_word_embeddings=True)
    return base, draft


@pytest.mark.parametrize(("stage_devices", "flat"), [
    (["orin-nano-8gb"] * 4, True),
    (["orin-nano-8gb", "orin-nano-8gb", "x86-cpu", "orin-nano-8gb"], False),   # one CPU stage: it decides
    (["rpi5-8gb"] * 4, False),
])
def test_tree_costs_of_a_mixed_cluster_follow_its_steepest_stage(stage_devices, flat):
    base, draft = _qwen_configs()
    head = load_device("orin-nano-8gb")
    costs = tree_costs(base, draft, balanced(28, 4), [load_device(d) for d in stage_devices], head,
                       draft_path=draft_path_for(head), draft_quantized=True)
    assert (costs.stage_segment_ratio <= FLAT) == flat
    assert costs.draft_call_s == pytest.approx(0.0356, rel=0.05)   # node 0 is the Orin in every case
    spec = sized_spec_for(SpecConfig(), costs)
    assert (spec.tree_depth == 1) == flat and spec.draft_width == 16
    # the prompt goes through in pipelined chunks only where segments are flat (CPUs keep the setting)
    assert (costs.prefill_chunk is not None) == flat


def test_prefill_chunks_follow_the_stage_cost():
    def tile_s(n: int) -> float:   # torch int4: one pass over the weights per 16-token tile
        return 0.088 * math.ceil(n / 16)

    assert prefill_chunk_for(tile_s, 14, 16, 256) == 16    # 14 stages: (16 + 13) steps, not 14 x 16
    assert prefill_chunk_for(tile_s, 1, 16, 256) == 256    # one stage: nothing to overlap, one chunk
    assert prefill_chunk_for(lambda n: 0.3, 4, 16, 256) == 256   # flat at any count (bitsandbytes)
    assert prefill_chunk_for(tile_s, 14, 16, 8) == 8       # never above the setting


def test_bitsandbytes_segments_are_flat_past_one_token():
    """bnb's >1-token path dequantizes whatever the count: a 16-token segment costs 3.5x a 1-token
    step but what a 2-token one does, so the expansions' extra nodes are free there too."""
    base, draft = _qwen_configs()
    orin = load_device("orin-nano-8gb")
    costs = tree_costs(base, draft, balanced(28, 4), [orin] * 4, orin, stage_path="hf-bnb4",
                       draft_path=draft_path_for(orin, "hf-bnb4"))
    assert costs.stage_segment_ratio <= FLAT and sized_spec_for(SpecConfig(), costs).tree_depth == 1


def test_a_deep_pipeline_of_wide_stages_caps_expansions_at_the_int4_tile():
    """70B over 14 Orin Nanos: a 64-node expansion would cost each stage four 16-token tiles (324 ms,
    the pipeline's step); expansions there send 16 fresh nodes. The 5-node 1.5B cluster keeps 64."""
    from flowedge.plan.planned_cluster import plan_cluster
    from flowedge.plan.predict import cost_model

    _, draft = _qwen_configs()
    deep = cost_model(plan_cluster("llama-2-70b", ["orin-nano-8gb"] * 14, quant="int4"), draft,
                      draft_quantized=True).tree
    assert deep.flat_segment == 16 and deep.prefill_chunk == 16
    spec = sized_spec_for(SpecConfig(), deep)
    assert spec.exp_nodes == 16 and spec.exp_fresh
    base, _ = _qwen_configs()
    orin = load_device("orin-nano-8gb")
    five = tree_costs(base, draft, balanced(28, 4), [orin] * 4, orin, draft_path=draft_path_for(orin),
                      draft_quantized=True)
    assert sized_spec_for(SpecConfig(), five).exp_nodes == SpecConfig().exp_nodes
    assert not sized_spec_for(SpecConfig(), five).exp_fresh
