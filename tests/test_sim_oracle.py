"""Oracle verification must be indistinguishable from real stage math: same tokens, same virtual clock."""
from __future__ import annotations

import pytest
import torch

from flowedge.core.config import SpecConfig
from flowedge.core.sampling import SamplingParams
from flowedge.engine.strategies import STRATEGIES
from flowedge.errors import ConfigError
from flowedge.sim.oracle import LengthOnlyCache, PathOracle, ShapeOnlyStage
from flowedge.sim.run import Cluster

SMALL = SpecConfig(tree_nodes=24, tree_depth=4, topk=4, l_max=6, exp_nodes=12, exp_depth=3,
                   se_nodes=4, pipedec_width=4, prefill_chunk=5)
PROMPTS = [list(range(3, 20)), [72, 101, 108, 108, 111, 32, 119]]


@pytest.fixture(scope="module")
def clusters(tiny_pair):
    base, draft = tiny_pair
    return Cluster(base, draft, 4, SMALL), Cluster(base, draft, 4, SMALL, verify="oracle")


def _pair(tiny_pair, lm_head_at: str):
    base, draft = tiny_pair
    spec = SMALL.with_(lm_head_at=lm_head_at)
    return Cluster(base, draft, 4, spec), Cluster(base, draft, 4, spec, verify="oracle")


def _trace(res) -> list[tuple]:
    return [(e.lane, e.kind, e.phase, round(e.start_s, 9), round(e.end_s, 9), e.tokens, e.nbytes)
            for e in res.trace.events]


# Sampled runs are seed-identical only with the lm_head on node 0: with lm_head_at=last-stage the stage
# draws a token at every node it runs while the oracle draws only along the path (same distribution,
# different random stream), so T=1 is compared there in distribution (test_engine_strategies).
@pytest.mark.parametrize("temperature,lm_head_at", [(0.0, "auto"), (0.0, "head"), (0.0, "last-stage"),
                                                    (1.0, "head")])
def test_oracle_gives_the_same_tokens_and_clock_as_stage_math(tiny_pair, temperature, lm_head_at):
    stages, oracle = _pair(tiny_pair, lm_head_at)
    for name in STRATEGIES:
        for i, prompt in enumerate(PROMPTS):
            params = SamplingParams(temperature=temperature, seed=i)
            a, _, _ = stages.generate(name, prompt, 24, params, device="orin-nano-8gb")
            b, _, _ = oracle.generate(name, prompt, 24, params, device="orin-nano-8gb")
            assert a.done.token_ids == b.done.token_ids, (name, temperature, i)
            assert a.sim_time_s == pytest.approx(b.sim_time_s, rel=1e-12), (name, temperature, i)
            assert _trace(a) == _trace(b), (name, temperature, i)


def test_oracle_reference_is_plain_greedy(tiny_pair, clusters):
    from flowedge.engine.local import generate_ar, stop_ids

    base, _ = tiny_pair
    _, oracle = clusters
    ref = generate_ar(base, PROMPTS[0], 20, SamplingParams()).token_ids
    got = oracle.oracle.generate(PROMPTS[0], 20, SamplingParams(), stop_ids(oracle.config))
    assert got == ref


def test_oracle_reuses_cached_paths_and_rewinds(clusters):
    oracle: PathOracle = clusters[1].oracle
    oracle.clear()
    first = oracle.logits([5, 6, 7, 8])
    runs = oracle.tokens_run
    assert torch.equal(oracle.logits([5, 6, 7, 8]), first) and oracle.tokens_run == runs   # cached
    branch = oracle.logits([5, 6, 9])          # rewinds to the common prefix [5, 6]
    assert oracle.tokens_run == runs + 1
    again = oracle.logits([5, 6, 7])           # a prefix of nothing cached: recomputed from [5, 6]
    assert again.shape == first.shape and not torch.equal(branch, again)


def test_shape_only_stage_checks_masks_and_cache_bounds(tiny_pair):
    from flowedge.models.stage import load_config

    stage = ShapeOnlyStage(load_config(tiny_pair[0]), 0, 2)
    cache = stage.new_cache()
    out = stage.forward_layers(torch.zeros(3, 8), torch.arange(3), torch.zeros(3, 3), cache)
    assert out.shape == (3, 8) and cache.length == 3
    with pytest.raises(ValueError):
        stage.forward_layers(torch.zeros(2, 8), torch.arange(2), torch.zeros(2, 2), cache)
    with pytest.raises(IndexError):
        LengthOnlyCache().keep(torch.tensor([0]))


def test_unknown_verify_mode_is_a_config_error(tiny_pair):
    with pytest.raises(ConfigError, match="verify mode"):
        Cluster(tiny_pair[0], tiny_pair[1], 3, SMALL, verify="psychic")
