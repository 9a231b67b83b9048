"""Strategy `auto`: its choice from the profiles, its online switches, and that switching stays lossless."""
from __future__ import annotations

import collections
from types import SimpleNamespace

import pytest
from scipy.stats import chi2_contingency

from flowedge.core.sampling import SamplingParams
from flowedge.costs.pipeline import DRAFT_QUANT_OF_PATH, CostModel, draft_path_for
from flowedge.costs.profiles import list_devices, load_device
from flowedge.costs.sizing import tree_costs
from flowedge.engine.auto_policy import (AR_PP, FLOWSPEC, PIPEDEC, START_TOKENS, AutoPolicy, Chooser,
                                         DrafterCosts, Prediction, predict_from_costs)
from flowedge.engine.local import generate_ar
from flowedge.sim.cluster import SimCluster
from flowedge.sim.run import Cluster, balanced
from tests.test_engine_strategies import PROMPTS, SMALL

# The real pair's shapes (Qwen2.5-Coder 1.5B base, 0.5B draft), without loading the models.
BASE = SimpleNamespace(hidden_size=1536, num_hidden_layers=28, num_attention_heads=12, num_key_value_heads=2,
                       intermediate_size=8960, vocab_size=151936, head_dim=None)
DRAFT = SimpleNamespace(hidden_size=896, num_hidden_layers=24, num_attention_heads=14, num_key_value_heads=2,
                        intermediate_size=4864, vocab_size=151936, head_dim=None)
COMPUTE_BOUND = {"x86-cpu", "rpi5-8gb"}   # stage cost grows with a segment's tokens: speculation cannot pay


def _prediction(device: str, nodes: int, drafter: DrafterCosts | None = None) -> Prediction:
    dev = load_device(device)
    ranges = balanced(BASE.num_hidden_layers, nodes - 1)
    path = draft_path_for(dev)
    return predict_from_costs(tree_costs(BASE, DRAFT, ranges, [dev] * len(ranges), dev, draft_path=path,
                                         draft_quantized=DRAFT_QUANT_OF_PATH.get(path) == "int4"), drafter)


@pytest.mark.parametrize("device", list_devices())
def test_auto_starts_with_flowspec_on_bandwidth_bound_devices_and_ar_pp_on_cpus(device):
    """The Jetsons in FlowSpec's setting (5 nodes; flowspec measured 2.55x ar-pp on the Orin Nano); the
    CPUs on 2 and 3 nodes, where flowspec measured slower than ar-pp (docs/bench/sim-x86-cpu-3nodes,
    zmq-x86-cpu-3nodes-lookup); on flowedge's native x86 runtime up to 5 nodes (a 16-row step costs ~5x a
    row: device_profiles/README.md, x86-cpu)."""
    if device in COMPUTE_BOUND:
        for nodes in (2, 3, 4, 5) if device == "x86-cpu" else (2, 3):
            chooser = Chooser(_prediction(device, nodes))
            assert chooser.choice == AR_PP, (nodes, chooser.reason)
    else:
        chooser = Chooser(_prediction(device, 5))
        assert chooser.choice == FLOWSPEC, chooser.reason
    assert "profiles predict" in chooser.reason


@pytest.mark.parametrize("device", list_devices())
def test_the_load_model_never_speeds_a_request_up_and_is_one_alone(device):
    prediction = _prediction(device, 5)
    assert prediction.load is not None   # the profiles give it: no load model would read as "no slowdown"
    for strategy in prediction.rates:
        factors = [prediction.load_factor(strategy, c) for c in range(1, 17)]
        assert factors[0] == 1.0 and all(0 < b <= a + 1e-12 <= 1.0 + 1e-12 for a, b in zip(factors, factors[1:]))


def test_the_load_model_follows_the_simulated_orin_sweep():
    """docs/bench/orin-nano-concurrency-8 (5 x Orin Nano, 8 prompts x 48 tokens): aggregate over one at a
    time, flowspec 1.39 / 1.91 / 2.48x and ar-pp 1.98 / 2.93 / 4.98x at 2 / 4 / 8 concurrent."""
    prediction = _prediction("orin-nano-8gb", 5)
    for strategy, measured in ((FLOWSPEC, {2: 1.39, 4: 1.91, 8: 2.48}), (AR_PP, {2: 1.98, 4: 2.93, 8: 4.98})):
        for c, speedup in measured.items():
            assert prediction.load_factor(strategy, c) * c == pytest.approx(speedup, rel=0.1), (strategy, c)


@pytest.mark.parametrize("device", list_devices())
def test_under_load_auto_starts_with_ar_pp_from_some_load_on_and_never_goes_back(device):
    """Under enough load ar-pp is the first choice (node 0's draft calls batch less than the stages' tokens
    do), and stays so above; on the GPU profiles flowspec keeps paying at a few concurrent requests."""
    prediction = _prediction(device, 5)
    choices = [Chooser(prediction, load=lambda c=c: c, tokens_left=47).choice for c in range(1, 17)]
    if choices[0] == AR_PP:
        assert set(choices) == {AR_PP}
    else:
        first_ar = choices.index(AR_PP) if AR_PP in choices else len(choices)
        assert set(choices[first_ar:]) <= {AR_PP}, choices
        # a GPU's draft call costs about as much for several requests' rows as for one's
        assert device in COMPUTE_BOUND or first_ar >= 4, choices
    if device == "orin-nano-8gb":   # 48-token answers: flowspec 1.23x at 4, 0.94x at 8
        assert choices[3] == FLOWSPEC and choices[7] == AR_PP
        assert "each of 8 requests" in Chooser(prediction, load=lambda: 8, tokens_left=47).reason


def test_a_request_started_on_ar_pp_for_load_goes_speculative_once_the_load_falls():
    running = [8]
    chooser = Chooser(_prediction("orin-nano-8gb", 5), load=lambda: running[0], tokens_left=47)
    assert chooser.choice == AR_PP and chooser.report()["requests_running"] == 8
    chooser.observe(5, 0.5)
    assert chooser.decide() == AR_PP   # still 8 running
    running[0] = 3
    assert chooser.decide(tokens_left=10) == AR_PP   # too little left to pay for a new round
    assert chooser.decide(tokens_left=100) == FLOWSPEC and "3 requests running now" in chooser.reason
    assert Chooser(_prediction("x86-cpu", 3), load=lambda: running[0]).decide() == AR_PP   # ar-pp alone too


def test_concurrent_auto_requests_choose_at_the_load_they_see(tiny_pair):
    """Real engine heads under the scheduler: the first choice is made when a request's first round starts,
    with the requests running then, and is filed with the answer."""
    from flowedge.sim.cluster import BatchConfig
    from flowedge.sim.cluster import SimRequest

    base, draft = tiny_pair
    cluster = Cluster(base, draft, 3, SMALL)
    requests = [SimRequest(i + 1, tuple(p), 12, SamplingParams()) for i, p in enumerate(PROMPTS[:3])]
    res, _, _ = cluster.generate_many("auto", requests, BatchConfig(max_concurrent=3), device="orin-nano-8gb")
    reports = [res.requests[i + 1].done.stats.auto for i in range(3)]
    assert all(r["requests_running"] == 3 and "each of 3 requests" in r["reason"] for r in reports), reports
    # every token is counted, but the first, which the prompt's prefill chose before any strategy ran
    assert all(sum(r["tokens"].values()) == len(res.requests[i + 1].done.token_ids) - 1 for i, r in enumerate(reports))


def test_under_load_flowspec_is_weighed_against_ar_pp_at_the_same_load():
    """5 x Orin Nano (docs/bench/orin-nano-concurrency-8: per request, flowspec 11.98 and ar-pp 9.47 tok/s at
    4 concurrent; 7.52 and 8.06 at 8). Alone ar-pp's predicted 13.6 tok/s, which made `auto` fall back at 4
    concurrent; at the same load the model puts ar-pp at ~9.1 tok/s, from 4 requests on (the slowest stage,
    the last with its lm_head, is busy all the time)."""
    prediction = _prediction("orin-nano-8gb", 5)
    assert prediction.load_factor(AR_PP, 2) == 1.0 and 0.6 < prediction.load_factor(AR_PP, 4) < 0.75
    running = [4]
    policy = AutoPolicy(window_tokens=16)
    loaded = Chooser(prediction, policy, load=lambda: running[0])
    loaded.observe(1, 1.0)
    loaded.observe(24, 24 / 11.98)
    assert loaded.decide() == FLOWSPEC
    alone = Chooser(prediction, policy)
    alone.observe(1, 1.0)   # the start: counted, not measured
    alone.observe(24, 24 / 11.98)
    assert alone.decide() == AR_PP   # alone, 12 tok/s of flowspec is slower than ar-pp would be
    running[0] = 6
    busier = Chooser(prediction, policy, load=lambda: running[0])
    assert busier.choice == FLOWSPEC
    busier.observe(1, 1.0)
    busier.observe(24, 24 / 7.0)
    # 7 tok/s: slower than all six on ar-pp (9.1) but faster than this one alone on ar-pp among five
    # speculating requests (~4.4): it stays
    assert busier.decide() == FLOWSPEC
    assert prediction.ar_among_speculating(6) == pytest.approx(4.4, abs=0.3)
    busier.observe(24, 24 / 2.5)
    assert busier.decide() == AR_PP and "among 5 speculating requests" in busier.reason


def test_without_a_profile_auto_runs_flowspec():
    assert Chooser(None).choice == FLOWSPEC


def test_measured_slow_flowspec_falls_back_then_probes_with_doubling():
    chooser = Chooser(Prediction({FLOWSPEC: 30.0, AR_PP: 10.0}), AutoPolicy(window_tokens=4, probe_tokens=8))
    chooser.observe(1, 5.0)                        # the start
    chooser.observe(3, 1.0)
    assert chooser.decide() == FLOWSPEC           # not a window yet
    chooser.observe(2, 1.0)                        # 5 tokens in 2 s: 2.5 tok/s < predicted ar-pp 10
    assert chooser.decide() == AR_PP and "measured flowspec" in chooser.reason
    chooser.observe(7, 0.5)
    assert chooser.decide() == AR_PP
    chooser.observe(1, 0.1)                        # 8 ar-pp tokens: probe flowspec again
    assert chooser.decide() == FLOWSPEC and "probe" in chooser.reason
    chooser.observe(1, 1.0)
    chooser.observe(4, 2.0)
    assert chooser.decide() == AR_PP               # measured ar-pp (~15 tok/s) beats it again
    assert chooser.probe_after == 16
    assert [s["to"] for s in chooser.report()["switches"]] == [AR_PP, FLOWSPEC, AR_PP]


def test_predicted_ar_pp_is_never_probed():
    chooser = Chooser(Prediction({FLOWSPEC: 1.0, AR_PP: 10.0}), AutoPolicy(window_tokens=2, probe_tokens=2))
    for _ in range(50):
        chooser.observe(1, 0.1)
        assert chooser.decide() == AR_PP


def test_flowspecs_prediction_follows_ar_pps_measured_speed():
    chooser = Chooser(Prediction({FLOWSPEC: 30.0, AR_PP: 10.0}), AutoPolicy(window_tokens=2))
    chooser.observe(4, 1.0)                        # flowspec measured at 4 tok/s, predicted 30
    assert chooser.rate(AR_PP) == (10.0, "predicted")   # acceptance is flowspec's alone
    chooser._switch(AR_PP, "test")
    chooser.observe(4, 0.5)                        # ar-pp measured at 8 tok/s, predicted 10
    chooser.meters[FLOWSPEC].clear()
    rate, how = chooser.rate(FLOWSPEC)
    assert how == "predicted" and rate == pytest.approx(30.0 * 8 / 10)


# ---- answer length -----------------------------------------------------------------------------------
def test_a_speculative_start_is_paid_over_the_tokens_left():
    """flowspec's rate over n tokens left is rate x n / (n + START_TOKENS): its start amortized."""
    assert START_TOKENS == 8
    assert Chooser.over(30.0, 8) == pytest.approx(15.0)
    assert Chooser.over(30.0, 120) == pytest.approx(30.0 * 120 / 128)
    assert Chooser.over(30.0, None) == 30.0          # no length known: as long as it takes
    assert Chooser.over(30.0, 0) == pytest.approx(30.0 / 9)
    policy = AutoPolicy(margin=1.0)
    prediction = Prediction({FLOWSPEC: 12.0, AR_PP: 10.0})   # 1.2x: pays from 40 tokens left on
    assert Chooser(prediction, policy, tokens_left=39).choice == AR_PP
    assert Chooser(prediction, policy, tokens_left=40).choice == FLOWSPEC
    assert Chooser(prediction, AutoPolicy(margin=1.1), tokens_left=40).choice == AR_PP   # 1.2 x 40/48 < 1.1


def test_at_8_concurrent_on_orin_short_answers_take_ar_pp_and_long_ones_flowspec():
    """docs/bench/orin-nano-concurrency-8: at 8 concurrent ar-pp leads by 7% on 48-token answers and flowspec
    by 11% on 128-token ones; at 1-4 concurrent flowspec leads at both lengths."""
    prediction = _prediction("orin-nano-8gb", 5)
    for n, want in ((31, AR_PP), (47, AR_PP), (127, FLOWSPEC), (255, FLOWSPEC)):
        chooser = Chooser(prediction, load=lambda: 8, tokens_left=n)
        assert chooser.choice == want, chooser.reason
        assert f"over {n} tokens left, its start included" in chooser.reason
        assert chooser.report()["tokens_left"] == n
    for running in (1, 2, 4):
        for n in (31, 47, 127):
            assert Chooser(prediction, load=lambda r=running: r, tokens_left=n).choice == FLOWSPEC
    assert Chooser(prediction, tokens_left=2).choice == AR_PP   # two tokens cannot pay for a tree


def test_a_speculative_start_is_counted_but_not_measured():
    """Up to its first tokens a start is paid (prefill, first tree, first trip): a fall-back weighs the rate
    after it. After a probe the same."""
    chooser = Chooser(Prediction({FLOWSPEC: 30.0, AR_PP: 10.0}), AutoPolicy(window_tokens=4, probe_tokens=2))
    chooser.observe(0, 0.5)                         # the tree grows: nothing yet
    chooser.observe(2, 1.5)                         # the first segment's tokens: 1 tok/s with the start
    assert chooser.meters[FLOWSPEC].tokens == 0 and chooser.tokens[FLOWSPEC] == 2
    chooser.observe(4, 0.2)                         # 20 tok/s from there on
    assert chooser.decide(100) == FLOWSPEC
    chooser.observe(8, 4.0)                         # slower: 12 tokens in 4.2 s, 2.9 tok/s
    assert chooser.decide(100) == AR_PP
    chooser.observe(2, 0.2)
    assert chooser.decide(100) == FLOWSPEC and chooser.starting   # the probe's start, not measured either
    chooser.observe(3, 3.0)
    assert chooser.meters[FLOWSPEC].tokens == 0 and not chooser.starting


def test_the_first_decide_makes_the_first_choice_with_the_answers_length():
    """Strategy `auto` builds its Chooser, then asks with `RoundView.tokens_left`: the first choice is made
    again, with the length, before any token; later calls never redo it."""
    chooser = Chooser(_prediction("orin-nano-8gb", 5), load=lambda: 8)
    assert chooser.choice == FLOWSPEC                  # unbounded: 1.18x >= 1.08x
    assert chooser.decide(47) == AR_PP and chooser.initial[0] == AR_PP and "over 47 tokens left" in chooser.reason
    assert chooser.report()["tokens_left"] == 47 and not chooser.switches
    later = Chooser(_prediction("orin-nano-8gb", 5), load=lambda: 8)
    later.observe(1, 1.0)
    assert later.decide(47) == FLOWSPEC and later.tokens_left is None


def test_a_measured_window_within_the_margin_does_not_fall_back():
    chooser = Chooser(Prediction({FLOWSPEC: 30.0, AR_PP: 10.0}), AutoPolicy(window_tokens=4, margin=1.08))
    chooser.observe(1, 1.0)
    chooser.observe(19, 2.0)                        # 9.5 tok/s: 5% under ar-pp, noise
    assert chooser.decide(100) == FLOWSPEC
    chooser.observe(1, 0.2)                         # 20 tokens in 2.2 s: 9.09 tok/s, 10% under
    assert chooser.decide(100) == AR_PP and "/ 1.08" in chooser.reason


def test_one_request_falling_back_among_speculating_ones_gets_their_stage_steps():
    """Orin, 128-token answers: a request that fell back while the others ran flowspec measured ar-pp at
    6.7 tok/s at 2 concurrent and 4.1 at 8, not the 13.6 and 9.1 of all on ar-pp."""
    prediction = _prediction("orin-nano-8gb", 5)
    assert prediction.ar_among_speculating(1) is None
    assert prediction.ar_among_speculating(2) == pytest.approx(6.7, rel=0.15)
    assert prediction.ar_among_speculating(8) == pytest.approx(4.1, rel=0.15)
    chooser = Chooser(prediction, load=lambda: 8, tokens_left=127)
    chooser.observe(1, 1.0)
    chooser.observe(17, 17 / 6.34)                  # the window that made it fall back before
    assert chooser.decide(110) == FLOWSPEC
    assert Chooser(Prediction({FLOWSPEC: 30.0, AR_PP: 10.0})).prediction.ar_among_speculating(4) is None


def test_a_probe_is_tried_only_where_the_tokens_left_pay_for_its_start():
    chooser = Chooser(Prediction({FLOWSPEC: 15.0, AR_PP: 10.0}), AutoPolicy(window_tokens=2, probe_tokens=4))
    chooser.observe(1, 1.0)
    chooser.observe(4, 1.0)                         # flowspec measured 4 tok/s
    assert chooser.decide(100) == AR_PP
    chooser.observe(4, 0.4)                         # 4 ar-pp tokens as predicted: probe time
    # 15 tok/s over 10 tokens left is 8.33 < 1.08 x 10: no probe near the end, no doubling either
    assert chooser.decide(10) == AR_PP and chooser.probe_after == 4
    assert chooser.decide(40) == FLOWSPEC and chooser.probe_after == 8
    assert "over 40 tokens left" in chooser.reason and "measured 4.00 before" in chooser.reason


# ---- a drafter board --------------------------------------------------------------------------------------
def test_a_drafter_leaves_the_link_on_a_hit_and_the_call_on_a_miss():
    drafter = DrafterCosts(link_rtt_s=0.002, hit_rate=0.75)
    assert drafter.call_s(0.040) == pytest.approx(0.75 * 0.002 + 0.25 * 0.040)
    assert drafter.call_s(0.001) == pytest.approx(0.001)   # a link slower than the call: node 0 drafts
    assert DrafterCosts(0.002, 0.0).call_s(0.040) == 0.040
    with pytest.raises(ValueError):
        DrafterCosts(0.002, 1.5)


def test_without_a_drafter_the_prediction_is_unchanged_and_with_one_it_is_on_the_numbers():
    """Orin Nano, 5 nodes: node 0's draft call (35.6 ms) limits flowspec's step, a stage's mean segment
    costs 20.4 ms. A drafter hitting 80% at a 2 ms link leaves 8.7 ms of call: the stage sets the step."""
    plain = _prediction("orin-nano-8gb", 5)
    assert plain.undrafted is None
    missed = _prediction("orin-nano-8gb", 5, DrafterCosts(0.002, 0.0))
    for c in (1, 2, 4, 8):
        assert missed.at_load(c) == pytest.approx(plain.at_load(c))
    drafted = _prediction("orin-nano-8gb", 5, DrafterCosts(0.002, 0.8))
    load = plain.load
    step_s, trip_s = max(load.flow_batch_s[0], 0.8 * 0.002 + 0.2 * load.draft_batch_s[0]), load.pipeline_latency_s
    assert drafted.rates[FLOWSPEC] == pytest.approx(1 / (step_s / 1.73 + trip_s / 8))
    assert drafted.rates[FLOWSPEC] > 1.4 * plain.rates[FLOWSPEC]
    assert drafted.rates[AR_PP] == plain.rates[AR_PP] and drafted.rates[PIPEDEC] == plain.rates[PIPEDEC]
    for c in range(1, 17):   # never below node 0 drafting alone
        assert drafted.at_load(c)[FLOWSPEC] >= plain.at_load(c)[FLOWSPEC] - 1e-9
    assert drafted.at_load(2)[FLOWSPEC] > 1.2 * plain.at_load(2)[FLOWSPEC]
    # 12 tokens left among 2 requests: the start does not pay alone, with the drafter it does
    assert Chooser(plain, load=lambda: 2, tokens_left=12).choice == AR_PP
    assert Chooser(drafted, load=lambda: 2, tokens_left=12).choice == FLOWSPEC


# ---- switching on the simulated cluster --------------------------------------------------------------
SWITCHY = AutoPolicy(window_tokens=2, probe_tokens=2, max_probe_tokens=2)


def _slow_draft_costs() -> CostModel:
    """A draft call costs 1 s, a stage 10 ms a token: flowspec measures slow, ar-pp fast."""
    def compute_s(node, c):
        if node == 0:
            return 1.0 if c.what == "draft" else 0.0
        return 0.01 * c.tokens
    return CostModel(compute_s, lambda a, b, n: 0.001)


def _run_switchy(cluster: Cluster, prompt, max_new: int, params: SamplingParams,
                 prediction: Prediction = Prediction({FLOWSPEC: 100.0, AR_PP: 10.0})):
    costs = _slow_draft_costs()
    head, stages = cluster.build("auto", costs)
    head.strategy.prediction = prediction
    head.strategy.policy = SWITCHY
    return SimCluster(head, stages, costs).run(1, prompt, max_new, params), head, stages


@pytest.mark.parametrize("nodes", [2, 3, 5])
def test_switching_mid_answer_stays_token_identical_to_greedy(tiny_pair, nodes):
    base, draft = tiny_pair
    cluster = Cluster(base, draft, nodes, SMALL)
    for prompt in PROMPTS:
        ref = generate_ar(base, prompt, 30, SamplingParams()).token_ids
        res, head, stages = _run_switchy(cluster, prompt, 30, SamplingParams())
        assert res.done.token_ids == ref
        report = res.done.stats.auto
        assert len(report["switches"]) >= 2 and report["choice"] == FLOWSPEC
        assert report["tokens"][FLOWSPEC] > 0 and report["tokens"][AR_PP] > 0
        for st in stages:   # every stage dropped the abandoned rounds' tokens
            for version, prefix_len in st.history:
                assert prefix_len == head.prefix_at_version[version]


@pytest.mark.parametrize("nodes", [3, 5])
def test_auto_running_pipedec_and_switching_stays_token_identical(tiny_pair, nodes):
    """Where the profiles predict pipedec fastest (deep pipelines) auto runs it, falls back to ar-pp when
    measured slower and probes again: every answer still equals greedy, every stage in step."""
    base, draft = tiny_pair
    cluster = Cluster(base, draft, nodes, SMALL)
    for prompt in PROMPTS:
        ref = generate_ar(base, prompt, 30, SamplingParams()).token_ids
        res, head, stages = _run_switchy(cluster, prompt, 30, SamplingParams(),
                                         Prediction({FLOWSPEC: 50.0, PIPEDEC: 100.0, AR_PP: 10.0}))
        assert res.done.token_ids == ref
        report = res.done.stats.auto
        assert report["choice"] == PIPEDEC and len(report["switches"]) >= 2
        assert report["tokens"][PIPEDEC] > 0 and report["tokens"][AR_PP] > 0
        for st in stages:
            for version, prefix_len in st.history:
                assert prefix_len == head.prefix_at_version[version]


def test_switching_mid_answer_keeps_the_sampling_distribution(tiny_pair):
    """Two-sample test: the 6th token under switching auto against plain ar-pp, 300 seeds each."""
    base, draft = tiny_pair
    cluster = Cluster(base, draft, 3, SMALL)
    counts = {"auto": collections.Counter(), "ar-pp": collections.Counter()}
    switched = 0
    for seed in range(300):
        params = SamplingParams(temperature=1.0, seed=seed)
        res, _, _ = _run_switchy(cluster, PROMPTS[0], 6, params)
        switched += bool(res.done.stats.auto["switches"])
        if len(res.done.token_ids) == 6:
            counts["auto"][res.done.token_ids[5]] += 1
        ar, _, _ = cluster.generate("ar-pp", PROMPTS[0], 6, SamplingParams(temperature=1.0, seed=10_000 + seed))
        if len(ar.done.token_ids) == 6:
            counts["ar-pp"][ar.done.token_ids[5]] += 1
    assert switched > 200
    top = [t for t, _ in (counts["auto"] + counts["ar-pp"]).most_common(5)]
    table = [[c[t] for t in top] + [sum(c.values()) - sum(c[t] for t in top)] for c in counts.values()]
    assert chi2_contingency(table).pvalue > 1e-3


def test_auto_reports_its_choice_on_a_profile(tiny_pair):
    base, draft = tiny_pair
    cluster = Cluster(base, draft, 3, SMALL, size_from_costs=True)
    res, head, _ = cluster.generate("auto", PROMPTS[0], 12, SamplingParams(), device="x86-cpu")
    report = res.done.stats.auto
    assert report["choice"] in (FLOWSPEC, AR_PP) and report["reason"].startswith("profiles predict")
    assert set(report["predicted_tok_s"]) == {FLOWSPEC, PIPEDEC, AR_PP}


def test_auto_on_the_14_stage_70b_cluster_weighs_pipedec_and_picks_flowspec():
    """PipeDec's setting (docs/bench/orin-nano-70b-14stages): both speculative strategies are predicted
    far above ar-pp, flowspec above pipedec (measured 4.06 vs 3.64 vs ar-pp 0.835 tok/s on MT-bench/81)."""
    from flowedge.plan.planned_cluster import plan_cluster
    from flowedge.plan.predict import cost_model

    costs = cost_model(plan_cluster("llama-2-70b", ["orin-nano-8gb"] * 14, quant="int4"), DRAFT,
                       draft_quantized=True).tree
    prediction = predict_from_costs(costs)
    rates = prediction.rates
    assert rates[FLOWSPEC] > rates[PIPEDEC] > 3 * rates[AR_PP]
    chooser = Chooser(prediction)
    assert chooser.choice == FLOWSPEC and "pipedec" in chooser.reason
