"""The draft head as node 0's drafter: lossless under every strategy (token-identical to greedy `ar` at
temperature 0, the base distribution when sampling), on the simulated cluster and in one process; its rows
read the right features; its calls are priced as a head's."""
from __future__ import annotations

import collections

import pytest
import torch
from scipy.stats import chisquare

from flowedge.core.config import SpecConfig
from flowedge.core.sampling import SamplingParams, warp_probs
from flowedge.engine.drafter import TreeShape
from flowedge.engine.head_drafter import HeadDrafter, load_draft
from flowedge.engine.local import generate_ar, generate_tree, stop_ids
from flowedge.engine.strategies import STRATEGIES
from flowedge.errors import ConfigError
from flowedge.models.stage import StageModel, bool_to_float_mask, causal_mask
from flowedge.sim.run import Cluster

SMALL = SpecConfig(tree_nodes=24, tree_depth=4, topk=4, l_max=6, exp_nodes=12, exp_depth=3,
                   se_nodes=4, pipedec_width=4, prefill_chunk=5)
PROMPTS = [list(range(3, 20)), [72, 101, 108, 108, 111, 32, 119], [5] * 9 + [200, 201, 202]]


@pytest.fixture(scope="module")
def references(tiny_pair):
    return [generate_ar(tiny_pair[0], p, 30, SamplingParams()).token_ids for p in PROMPTS]


@pytest.mark.parametrize("nodes,verify", [(2, "stages"), (3, "stages"), (5, "stages"), (3, "oracle")])
def test_every_strategy_with_a_draft_head_matches_greedy_ar(tiny_pair, tiny_head, references, nodes, verify):
    base = tiny_pair[0]
    cluster = Cluster(base, tiny_head, nodes, SMALL, verify=verify)
    accepted = 0
    for name in STRATEGIES:
        for prompt, ref in zip(PROMPTS, references):
            res, head, stages = cluster.generate(name, prompt, 30, SamplingParams())
            assert res.done.token_ids == ref, f"{name} with a draft head on {nodes} nodes ({verify}) diverged"
            if head.drafter is not None:
                assert isinstance(head.drafter, HeadDrafter) and head.lm_head_at == "head"
            accepted = max(accepted, max(res.done.stats.accept_lens, default=0))
            for st in stages:
                for version, prefix_len in st.history:
                    assert prefix_len == head.prefix_at_version[version], (name, st.index, version)
    assert accepted > 1, "the head never had a draft token accepted: the test proves little"


def test_one_process_tree_with_a_draft_head_matches_ar(tiny_pair, tiny_head, references):
    base_dir = tiny_pair[0]
    base = StageModel.load(base_dir)
    drafter = HeadDrafter(load_draft(str(tiny_head), base_dir), base)
    for prompt, ref in zip(PROMPTS, references):
        res = generate_tree(base, drafter, prompt, 30, SamplingParams(), TreeShape(4, 4), 16)
        assert res.token_ids == ref


def test_sampling_with_a_draft_head_keeps_the_base_distribution(tiny_pair, tiny_head):
    """Second generated token (the first one a tree verification chooses) against its exact marginal."""
    base = tiny_pair[0]
    params = SamplingParams(temperature=1.0)
    model = StageModel.load(base)
    prompt = PROMPTS[1]
    cluster = Cluster(base, tiny_head, 3, SMALL)
    seconds = collections.Counter()
    for seed in range(400):
        res, _, _ = cluster.generate("flowspec", prompt, 2, SamplingParams(temperature=1.0, seed=seed))
        if len(res.done.token_ids) == 2:
            seconds[res.done.token_ids[1]] += 1
    draws = sum(seconds.values())
    with torch.inference_mode():
        p1 = warp_probs(_logits(model, prompt), params)
        p1[list(stop_ids(model.config))] = 0.0
        p1 /= p1.sum()
        firsts = p1.nonzero().flatten()
        second = torch.stack([warp_probs(_logits(model, prompt + [int(t)]), params) for t in firsts])
        marginal = (p1[firsts, None] * second).sum(0)
    top = marginal.argsort(descending=True)[:6].tolist()
    observed = [seconds[t] for t in top] + [draws - sum(seconds[t] for t in top)]
    expected = [float(marginal[t]) * draws for t in top]
    expected.append(draws - sum(expected))
    assert chisquare(observed, expected).pvalue > 1e-3


def _logits(model: StageModel, ids: list[int]) -> torch.Tensor:
    t = torch.tensor(ids)
    h = model.forward_layers(model.embed(t), torch.arange(t.numel()), bool_to_float_mask(causal_mask(t.numel(), 0)),
                             model.new_cache())
    return model.logits(h[-1:])[0]


def test_context_rows_read_base_features_and_tree_rows_their_parents(tiny_pair, tiny_head):
    base_dir = tiny_pair[0]
    base = StageModel.load(base_dir)
    drafter = HeadDrafter(load_draft(str(tiny_head), base_dir), base)
    context = [72, 101, 108, 108, 111]
    with pytest.raises(RuntimeError, match="features up to position"):
        drafter.build(context, TreeShape(3, 2))
    drafter.reset()
    hidden = torch.randn(len(context) - 1, 64)
    drafter.observe(0, hidden)
    tree = drafter.build(context, TreeShape(3, 2))
    assert set(tree.tokens[1:].tolist()) <= set(drafter.head.vocab_ids.tolist())
    past = drafter.cache.length                                    # committed 0..4, level-1 nodes from 5
    allowed = torch.zeros(2, past + 2, dtype=torch.bool)
    allowed[0, :3] = True                                          # a context row at position 2
    allowed[1, :6] = allowed[1, past + 1] = True                   # a tree row under the node in entry 5
    feats = drafter._row_features(torch.tensor([2, 6]), allowed, past)
    assert torch.equal(feats[0], base.norm(hidden[1:2])[0])       # context row at 2: the base's feature at 1
    assert torch.equal(feats[1], drafter.outs[5])                  # tree row: its parent's (entry 5) output
    assert drafter.advance(context + [7], 1, 3) is None           # new tokens: drafted afresh, never re-rooted


def test_a_draft_head_needs_the_hidden_states_on_node_0(tiny_pair, tiny_head):
    cluster = Cluster(tiny_pair[0], tiny_head, 3, SMALL.with_(lm_head_at="last-stage"))
    with pytest.raises(ConfigError, match="last-stage"):
        cluster.generate("flowspec", PROMPTS[0], 4, SamplingParams())
    cluster = Cluster(tiny_pair[0], tiny_head, 3, SMALL.with_(predraft="idle"))
    _, head, _ = cluster.generate("flowspec", PROMPTS[0], 4, SamplingParams())
    assert head.predraft is None and head.lm_head_at == "head"


def test_a_head_call_is_priced_as_one_layer_and_a_reduced_lm_head(tiny_pair, tiny_head):
    from flowedge.costs.model import draft_head_time_s, draft_time_s
    from flowedge.costs.profiles import load_device

    cluster = Cluster(tiny_pair[0], tiny_head, 3, SMALL)
    res, _, _ = cluster.generate("flowspec", PROMPTS[0], 12, SamplingParams(), device="x86-cpu")
    draft = [e for e in res.trace.events if e.lane.startswith("node0") and e.label == "draft"]
    assert draft, "the head's calls are charged on node 0"
    dev, cfg = load_device("x86-cpu"), cluster.draft_model.config
    assert draft_time_s(dev, cfg, 10, 200) == draft_head_time_s(dev, cfg, 10, 200)
    big = cfg.__class__(**{**cfg.to_dict(), "draft_vocab": cfg.vocab_size})
    assert draft_head_time_s(dev, big, 10, 200) > draft_head_time_s(dev, cfg, 10, 200)


def test_plan_and_auto_price_a_head_below_the_draft_model(tiny_head):
    from flowedge.costs.profiles import load_device
    from flowedge.costs.sizing import tree_costs
    from flowedge.models.draft_head_io import read_config
    from flowedge.plan.planned_cluster import draft_shape, plan_cluster
    from flowedge.plan.shapes import load_shape

    with_head = plan_cluster("qwen2.5-coder-1.5b", ["x86-cpu"] * 2, draft=str(tiny_head))
    with_model = plan_cluster("qwen2.5-coder-1.5b", ["x86-cpu"] * 2)
    assert with_head.head_memory.weights_bytes < with_model.head_memory.weights_bytes
    assert with_head.drafter is None   # a head drafts from node 0's features: no drafter device
    assert draft_shape(str(tiny_head)) == read_config(tiny_head)
    base, dev = load_shape("qwen2.5-coder-1.5b"), load_device("x86-cpu")
    real_head = read_config(tiny_head).__class__.for_base(base, 3072, 32768)

    def costs(draft):
        return tree_costs(base, draft, [(0, 14), (14, 28)], [dev, dev], dev, draft_path="cpu-native")
    head, model = costs(real_head), costs(load_shape("qwen2.5-coder-0.5b"))
    assert head.draft_call_s < model.draft_call_s / 2   # what strategy auto and the tree sizing start from
