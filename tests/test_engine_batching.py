"""Several requests in one pipeline (the scheduler, engine/scheduler.py, + the stages' batched forwards): every
request's output token-identical to running it alone at T=0, the base distribution when sampling, KV freed on every
stage when a request ends or is cancelled, admission within the KV budget, first come first served."""
from __future__ import annotations

import collections

import pytest
import torch
from scipy.stats import chisquare

from flowedge.core.config import SpecConfig
from flowedge.core.sampling import SamplingParams, warp_probs
from flowedge.engine.events import Emit, Finish, Prune, Segment
from flowedge.engine.local import generate_ar, stop_ids
from flowedge.engine.jobs import FromEngine, Job, ResetStages, kv_need, tree_reserve
from flowedge.errors import ConfigError
from flowedge.sim.cluster import BatchConfig, SimRequest
from flowedge.sim.run import Cluster

SMALL = SpecConfig(tree_nodes=24, tree_depth=4, topk=4, l_max=6, exp_nodes=12, exp_depth=3,
                   se_nodes=4, pipedec_width=4, prefill_chunk=5)
PROMPTS = [list(range(3, 20)), [72, 101, 108, 108, 111, 32, 119], [5] * 9 + [200, 201, 202], [40, 41, 42, 43]]
NEW = 24


@pytest.fixture(scope="module")
def references(tiny_pair):
    base, _ = tiny_pair
    return [generate_ar(base, p, NEW, SamplingParams()).token_ids for p in PROMPTS]


def _requests(params=SamplingParams(), **kw) -> list[SimRequest]:
    return [SimRequest(i + 1, tuple(p), NEW, params, **kw) for i, p in enumerate(PROMPTS)]


@pytest.mark.parametrize("nodes,strategy,lm_head_at", [(3, "flowspec", "last-stage"), (3, "ar-pp", "head"),
                                                      (5, "flowspec", "head"), (5, "pipedec", "last-stage")])
def test_concurrent_requests_match_sequential_greedy(tiny_pair, references, nodes, strategy, lm_head_at):
    base, draft = tiny_pair
    cluster = Cluster(base, draft, nodes, SMALL.with_(lm_head_at=lm_head_at))
    res, multi, stages = cluster.generate_many(strategy, _requests(), BatchConfig(max_concurrent=3),
                                               device="orin-nano-8gb")
    for i, ref in enumerate(references):
        assert res.requests[i + 1].done.token_ids == ref, f"request {i + 1} diverged under batching"
        head = multi.get(i + 1).engine
        for st in stages:   # every stage applied the request's prunes in step with its head
            assert all(p == head.prefix_at_version[v] for v, p in st.history_of(i + 1))
    # the stages really batched several requests into one forward, and hold no KV afterwards
    assert max(max(st.batch_sizes) for st in stages) >= 2
    if multi.batcher is not None:   # node 0 shared draft forwards between requests too
        assert max(multi.batcher.batch_sizes) >= 2
    assert all(st.cached_tokens() == 0 and not st.slots for st in stages)


def test_batching_beats_one_at_a_time_on_a_memory_bound_device(tiny_pair):
    """The simulated Orin charges a batched forward as one forward of all its rows: 3 concurrent requests
    finish well before the same 3 served one after another."""
    base, draft = tiny_pair
    cluster = Cluster(base, draft, 3, SMALL)
    one, _, _ = cluster.generate_many("ar-pp", _requests()[:3], BatchConfig(max_concurrent=1), device="orin-nano-8gb")
    three, _, _ = cluster.generate_many("ar-pp", _requests()[:3], BatchConfig(max_concurrent=3), device="orin-nano-8gb")
    assert three.sim_time_s < 0.6 * one.sim_time_s


def test_batched_sampling_keeps_the_base_distribution(tiny_pair):
    """Two requests sampled side by side (flowspec, tokens drawn on the last stage in batched forwards):
    request 1's second token against its exact marginal under the base model."""
    from flowedge.models.stage import StageModel, bool_to_float_mask, causal_mask

    base, draft = tiny_pair
    params = SamplingParams(temperature=1.0)
    model = StageModel.load(base)
    prompt = PROMPTS[1]
    cluster = Cluster(base, draft, 3, SMALL.with_(lm_head_at="last-stage"))
    seconds = collections.Counter()
    for seed in range(300):
        reqs = [SimRequest(1, tuple(prompt), 2, SamplingParams(temperature=1.0, seed=seed)),
                SimRequest(2, tuple(PROMPTS[0]), 6, SamplingParams(temperature=1.0, seed=10_000 + seed))]
        res, _, _ = cluster.generate_many("flowspec", reqs, BatchConfig(max_concurrent=2))
        out = res.requests[1].done.token_ids
        if len(out) == 2:
            seconds[out[1]] += 1
    draws = sum(seconds.values())

    def last_logits(ids):
        n = ids.numel()
        h = model.forward_layers(model.embed(ids), torch.arange(n), bool_to_float_mask(causal_mask(n, 0)),
                                 model.new_cache())
        return model.logits(h[-1:])[0]

    with torch.inference_mode():
        ids = torch.tensor(prompt)
        p1 = warp_probs(last_logits(ids), params)
        p1[list(stop_ids(model.config))] = 0.0
        p1 /= p1.sum()
        firsts = p1.nonzero().flatten()
        logits = torch.stack([last_logits(torch.cat([ids, f.view(1)])) for f in firsts])
        marginal = (p1[firsts, None] * warp_probs(logits, params)).sum(0)
    top = marginal.argsort(descending=True)[:6].tolist()
    observed = [seconds[t] for t in top] + [draws - sum(seconds[t] for t in top)]
    expected = [float(marginal[t]) * draws for t in top]
    expected.append(draws - sum(expected))
    assert chisquare(observed, expected).pvalue > 1e-3


def test_cancel_frees_kv_on_every_stage_and_drops_queued_requests(tiny_pair, references):
    base, draft = tiny_pair
    cluster = Cluster(base, draft, 4, SMALL)
    reqs = _requests()
    # request 2 is cancelled mid-flight, request 4 while still queued behind max_concurrent=2
    reqs[1] = SimRequest(2, tuple(PROMPTS[1]), NEW, cancel_s=0.12)
    reqs[3] = SimRequest(4, tuple(PROMPTS[3]), NEW, cancel_s=0.001)
    res, multi, stages = cluster.generate_many("flowspec", reqs, BatchConfig(max_concurrent=2),
                                               device="orin-nano-8gb")
    two, four = res.requests[2], res.requests[4]
    assert two.done.cancelled and 0 < len(two.done.token_ids) < len(references[1])
    assert four.done.cancelled and four.done.token_ids == [] and not four.emits
    assert res.requests[1].done.token_ids == references[0]
    assert res.requests[3].done.token_ids == references[2]
    for st in stages:
        assert st.cache_lengths() == {} and st.cached_tokens() == 0
        assert 4 not in st.history_by_request


def test_stage_frees_a_cancelled_request_mid_round(tiny_pair):
    """Drive one stage directly: two requests hold KV; Finish for one frees exactly its cache, and its
    stragglers (a late segment, a late prefill) never recreate it."""
    base, draft = tiny_pair
    cluster = Cluster(base, draft, 3, SMALL)
    multi, stages, _ = cluster.build_many("flowspec", BatchConfig(max_concurrent=2))
    first = stages[0]
    multi.submit(1, Job(tuple(PROMPTS[0]), NEW), 0.0)
    multi.submit(2, Job(tuple(PROMPTS[1]), NEW), 0.0)
    sends = multi.tick(0.0, True)
    segs = [a.action.message for a in sends if isinstance(a, FromEngine) and isinstance(a.action.message, Segment)]
    first.receive_all(segs)
    assert first.cache_lengths() == {1: len(PROMPTS[0]), 2: len(PROMPTS[1])}
    assert max(first.batch_sizes) == 2   # both prompts' first chunks ran as one forward
    cancel = multi.cancel(2)
    (reset,) = [a for a in cancel if isinstance(a, ResetStages)]   # the driver sends Finish to every stage
    assert reset.run_id == 2 and [a.done.cancelled for a in cancel if a is not reset] == [True]
    first.receive(Finish(reset.run_id))
    assert first.cache_lengths() == {1: len(PROMPTS[0])}
    assert first.receive(segs[-1]) == [] and 2 not in first.slots
    assert multi.running_count() == 1


def test_admission_respects_the_kv_budget_fifo(tiny_pair):
    base, draft = tiny_pair
    cluster = Cluster(base, draft, 3, SMALL)
    budget = 2 * (17 + NEW + 40)
    multi, _, spec = cluster.build_many("ar-pp", BatchConfig(max_concurrent=4, kv_budget_tokens=budget))
    reserve = tree_reserve(spec)
    sizes = [kv_need(spec, len(p), NEW) for p in PROMPTS]
    assert sizes[0] == 17 + NEW + reserve
    for rid in (1, 2, 3):
        multi.submit(rid, Job(tuple(PROMPTS[rid - 1]), NEW, kv_tokens=sizes[rid - 1]), 0.0)
        multi.tick(0.0, True)
    assert multi.kv_reserved() <= multi.kv_budget().tokens == budget
    assert len(multi.running) + len(multi.queue) == 3 and len(multi.queue) >= 1
    assert [r.key for r in multi.queue] == sorted(r.key for r in multi.queue)
    (failed,) = multi.submit(9, Job(tuple(range(500)), NEW, kv_tokens=kv_need(spec, 500, NEW)), 0.0)
    assert "kv_budget_tokens = " in failed.message and f"can hold {budget}" in failed.message
    with pytest.raises(ConfigError, match="in use"):
        multi.submit(1, Job(tuple(PROMPTS[0]), NEW), 0.0)


def test_a_single_request_runs_as_before(tiny_pair, references):
    """max_concurrent=1 through the scheduler, and the plain Head path, give the same tokens and time."""
    base, draft = tiny_pair
    cluster = Cluster(base, draft, 3, SMALL)
    single, _, _ = cluster.generate("flowspec", PROMPTS[0], NEW, SamplingParams(), device="orin-nano-8gb")
    res, _, _ = cluster.generate_many("flowspec", _requests()[:1], BatchConfig(max_concurrent=4),
                                      device="orin-nano-8gb")
    assert single.done.token_ids == res.requests[1].done.token_ids == references[0]
    assert res.sim_time_s == pytest.approx(single.sim_time_s, rel=1e-9)


def test_draft_batcher_shares_forwards_and_keeps_each_tree(tiny_pair):
    """Three requests' tree builds side by side: the draft calls run as shared forwards (each charged
    once), and every request gets the tree it would have got alone."""
    from functools import partial

    from flowedge.engine.draft_batch import DraftBatcher
    from flowedge.engine.drafter import Drafter, TreeShape, load_draft_model

    _, draft = tiny_pair
    model = load_draft_model(draft, "none")
    shape = TreeShape(topk=4, depth=3)
    alone = [Drafter(model).build(p, shape) for p in PROMPTS[:3]]
    batcher = DraftBatcher(model)
    drafters = [Drafter(model, batcher) for _ in PROMPTS[:3]]
    trees = batcher.run_step([partial(d.build, p, shape) for d, p in zip(drafters, PROMPTS[:3])])
    assert list(batcher.batch_sizes) == [3, 3, 3]   # the prompt call, then one per level, for all three at once
    assert sum(len(d.drain_calls()) for d in drafters) == len(batcher.batch_sizes)
    for a, b in zip(alone, trees):
        assert torch.equal(a.tokens, b.tokens) and torch.equal(a.parents, b.parents)
        assert torch.allclose(a.log_scores, b.log_scores, atol=1e-4)


def _random_batch(model, gen: torch.Generator):
    """2-4 requests with different cache lengths and row counts: prefilled caches, new rows, tree masks."""
    from flowedge.models.stage import bool_to_float_mask, causal_mask

    hidden = model.config.hidden_size
    k = int(torch.randint(2, 5, (1,), generator=gen))
    pasts = torch.randint(1, 120, (k,), generator=gen).tolist()
    rows = torch.randint(1, 12, (k,), generator=gen).tolist()
    caches, reqs = [], []
    for past, n in zip(pasts, rows):
        cache = model.new_cache()
        model.forward_layers(torch.randn(past, hidden, generator=gen), torch.arange(past),
                             bool_to_float_mask(causal_mask(past, 0)), cache)
        allowed = torch.ones(n, past + n, dtype=torch.bool)   # a random tree: each row sees itself, some earlier
        allowed[:, past:] = (torch.rand(n, n, generator=gen) < 0.5).tril(-1) | torch.eye(n, dtype=torch.bool)
        caches.append(cache)
        reqs.append((torch.randn(n, hidden, generator=gen), past + torch.arange(n), bool_to_float_mask(allowed)))
    return caches, reqs


@pytest.mark.parametrize("quant", ["int4", "none"])
def test_a_batched_stage_forward_gives_each_request_its_rows_alone(tiny_pair, quant):
    """A batched forward (`StageModel.forward_packed`) of 2-4 requests with different cache lengths and row
    counts: each request's rows and its cache's new K/V are bit-identical to running it alone (W4A16: the int4
    Linear is row-invariant and each request attends over its own cache with its own mask; the former single
    SDPA over the packed columns with a block-diagonal mask differed in ~20% of these batches). fp32 (quant
    none) cannot be bit-identical: on this CPU an nn.Linear of 1-3 rows takes another kernel than a larger
    one (~1e-6 apart), so it is only checked to a tight tolerance."""
    import copy

    from flowedge.models.stage import StageModel

    model = StageModel.load(tiny_pair[0], quant=quant)
    gen = torch.Generator().manual_seed(16)
    for _ in range(12):
        caches, reqs = _random_batch(model, gen)
        alone_caches = [copy.deepcopy(c) for c in caches]
        alone = [model.forward_layers(h, pos, mask, c) for (h, pos, mask), c in zip(reqs, alone_caches)]
        packed = model.forward_packed(torch.cat([h for h, _, _ in reqs]), torch.cat([p for _, p, _ in reqs]),
                                      [m for _, _, m in reqs], caches)
        for a, b, ca, cb in zip(alone, packed.split([h.shape[0] for h, _, _ in reqs]), alone_caches, caches):
            if quant == "int4":
                assert torch.equal(a, b)
                assert ca.length == cb.length
                for i in ca.layer_ids:
                    assert torch.equal(ca._k[i][:, :, :ca.length], cb._k[i][:, :, :cb.length])
                    assert torch.equal(ca._v[i][:, :, :ca.length], cb._v[i][:, :, :cb.length])
            else:
                torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)


def test_a_packed_forward_refuses_a_mask_that_does_not_fit_its_cache(tiny_pair):
    from flowedge.errors import ModelError
    from flowedge.models.stage import StageModel

    model = StageModel.load(tiny_pair[0], quant="int4")
    caches = [model.new_cache(), model.new_cache()]
    with pytest.raises(ModelError, match="does not match 2 rows after 0 cached"):
        model.forward_packed(torch.zeros(4, model.config.hidden_size), torch.arange(4),
                             [torch.zeros(2, 2), torch.zeros(2, 3)], caches)
    with pytest.raises(ModelError, match="5 rows for masks of 4"):
        model.forward_packed(torch.zeros(5, model.config.hidden_size), torch.arange(5),
                             [torch.zeros(2, 2), torch.zeros(2, 2)], caches)


def test_every_admitted_head_sees_the_requests_running():
    """Strategy `auto` weighs its predictions by the requests sharing the pipeline (engine/auto_policy.py):
    each head admitted reads the scheduler's count, not its own view of one."""
    from flowedge.engine.jobs import Limits, RequestEngine
    from flowedge.engine.scheduler import Scheduler

    class Head(RequestEngine):
        def __init__(self, context) -> None:
            self.running_requests = context.running_requests

        outputs: list[int] = []
        stats = None
        finished = False

        def start(self, run_id, prompt_ids, max_new_tokens, params, now=None):
            return []

        def receive(self, event, now=None):
            return []

    heads = []
    multi = Scheduler(lambda req, context: heads.append(Head(context)) or heads[-1], Limits(max_running=2))
    for rid in (1, 2, 3):
        multi.submit(rid, Job((5, 6), 4), 0.0)
        multi.tick(0.0, True)
    assert len(heads) == 2 and [h.running_requests() for h in heads] == [2, 2] and len(multi.queue) == 1
    multi.cancel(1)
    multi.tick(0.0, True)   # the third is admitted in its place: still two running
    assert len(heads) == 3 and all(h.running_requests() == 2 for h in heads)
