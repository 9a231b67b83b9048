"""Pre-drafting (engine/predraft.py): the prediction, the lane's trees, and — on the simulated cluster — that
answers stay token-identical to greedy decoding (2, 3, 5 nodes; node 0's gaps and a drafter device) and keep
the base distribution when sampling, with hits and misses both exercised."""
from __future__ import annotations

import collections

import pytest
import torch
from scipy.stats import chi2_contingency

from flowedge.core.config import SpecConfig
from flowedge.core.sampling import SamplingParams
from flowedge.core.tree import DraftTree, subtree
from flowedge.engine.drafter import Drafter, TreeShape
from flowedge.engine.events import Compute, Offload, WhenIdle
from flowedge.engine.jobs import Job, Limits, RequestEngine
from flowedge.engine.local import generate_ar
from flowedge.engine.predraft import GapClock, PreDrafting, fresh_nodes
from flowedge.engine.scheduler import Scheduler
from flowedge.errors import ConfigError
from flowedge.models.stage import StageModel
from flowedge.sim.cluster import BatchConfig, SimRequest
from flowedge.sim.run import Cluster

SMALL = SpecConfig(tree_nodes=24, tree_depth=4, topk=4, l_max=6, exp_nodes=12, exp_depth=3, se_nodes=4,
                   prefill_chunk=5)
PROMPTS = [list(range(3, 20)), [72, 101, 108, 108, 111, 32, 119], [5] * 9 + [200, 201, 202]]


def _tree() -> DraftTree:
    """root(7) -> a(1) -> c(3);  root -> b(2)"""
    t = DraftTree.root_only(7)
    t.append(torch.tensor([1, 2]), torch.tensor([0, 0]), torch.tensor([-0.1, -0.9]))
    t.append(torch.tensor([3]), torch.tensor([1]), torch.tensor([-0.3]))
    return t


def test_fresh_nodes_counts_what_the_round_does_not_hold():
    t = _tree()
    sub = DraftTree.root_only(1)
    sub.append(torch.tensor([3, 9]), torch.tensor([0, 0]), torch.tensor([-0.1, -0.2]))   # c exists, 9 is new
    assert fresh_nodes(sub, t, torch.ones(len(t), dtype=torch.bool), 1) == 1


def test_the_gap_clock_lets_a_call_start_only_if_it_ends_before_the_next_segment():
    gaps = GapClock()
    assert gaps.fits(0.0, 1.0)            # nothing in flight
    gaps.on_send(1, 0.0)
    assert not gaps.fits(0.0, 0.001)      # in flight, no round trip measured yet: it may be back any moment
    gaps.on_return(1, 0.10)               # round trip 100 ms
    gaps.on_send(2, 0.10)
    assert gaps.fits(0.15, 0.04)          # due at 0.20: a 40 ms call ends at 0.19
    assert not gaps.fits(0.15, 0.06)      # a 60 ms one would delay it
    gaps.on_send(3, 0.12)
    pre = PreDrafting.__new__(PreDrafting)
    pre.gaps, pre.out = gaps, None
    pre.new_round()                       # a round ended: its segments in flight will never be walked
    assert gaps.fits(5.0, 1.0) and not gaps.sent


def test_pre_draft_calls_grow_the_tree_and_an_expansion_with_enough_new_nodes_is_a_hit(tiny_pair):
    from flowedge.engine.events import WhenIdle as Idle

    drafter = Drafter(StageModel.load(tiny_pair[1]))
    context = list(range(3, 15))
    base = drafter.build(context, TreeShape(4, 2))
    drafter.drain_calls()
    spec = SpecConfig(topk=4, l_max=4, predraft="idle", predraft_calls=2)
    pre = PreDrafting(drafter, spec, call_s=0.0)
    round_tree = subtree(base, 0)[0]                 # everything drafted so far was sent
    alive = torch.ones(len(round_tree), dtype=torch.bool)
    assert pre.base_for(context, round_tree, alive, 0) is None and pre.stats.hits == pre.stats.misses == 0
    assert pre.plan(context, in_flight=False) == []
    (idle,) = pre.plan(context, in_flight=True)
    assert isinstance(idle, Idle)
    actions, more = pre.on_event(idle.event, context, now=0.0)
    assert len(actions) == 2 and isinstance(actions[1], Idle) and not more    # a call, then the next
    actions, more = pre.on_event(idle.event, context, now=0.0)
    assert len(actions) == 1 and more and pre.stats.calls == 2
    assert pre.base_for(context, round_tree, alive, 0) is not None and pre.stats.hits == 1
    pre.on_event(pre.plan(context, in_flight=True)[0].event, context, now=0.0)
    assert pre.base_for(context, subtree(drafter.base, 0)[0], torch.ones(len(drafter.base), dtype=torch.bool),
                        0) is None and pre.stats.misses == 1     # the round holds all of it: nothing to skip with


def test_spec_rejects_unknown_predraft_modes():
    with pytest.raises(ConfigError, match="predraft"):
        SpecConfig(predraft="sometimes")
    with pytest.raises(ConfigError, match="predraft"):
        SpecConfig(predraft_calls=0)


def test_a_daemon_takes_every_predraft_mode_and_refuses_others():
    """`drafter` runs on a daemon too since the drafter node (node/drafter_node.py, test_node_drafter.py)."""
    from flowedge.node.node_config import NodeConfig

    assert [NodeConfig(predraft=m).predraft for m in ("off", "idle", "drafter")] == ["off", "idle", "drafter"]
    with pytest.raises(ConfigError, match="predraft must be one of"):
        NodeConfig(predraft="sometimes")


class _IdleEngine(RequestEngine):
    """An engine that asks for idle work and records what ran when."""

    def __init__(self, log: list) -> None:
        self.log = log

    def start(self, run_id, prompt_ids, max_new_tokens, params, now=None):
        return [WhenIdle("idle")]

    def receive(self, event, now=None):
        self.log.append(event)
        return [WhenIdle("idle")] if event == "idle" and self.log.count("idle") < 3 else []


def test_idle_work_runs_only_when_no_real_work_waits():
    log: list = []
    sched = Scheduler(lambda req, context: _IdleEngine(log), Limits(max_running=1))
    sched.submit(1, Job((1, 2), 4), 0.0)
    sched.tick(0.0, True)
    assert sched.has_idle_work() and not sched.has_work()
    sched.add_work(1, "segment", 0.0)
    assert sched.has_work()
    sched.step(0.0)
    assert log == ["segment"]
    sched.idle_step(0.0)
    sched.idle_step(0.0)
    assert log == ["segment", "idle", "idle"]
    sched.cancel(1)
    assert not sched.has_idle_work()


@pytest.fixture(scope="module")
def references(tiny_pair):
    return [generate_ar(tiny_pair[0], p, 40, SamplingParams()).token_ids for p in PROMPTS]


@pytest.mark.parametrize("mode", ["idle", "drafter"])
@pytest.mark.parametrize("nodes", [2, 3, 5])
def test_predrafting_is_lossless_at_t0(tiny_pair, references, nodes, mode):
    base, draft = tiny_pair
    cluster = Cluster(base, draft, nodes, SMALL.with_(predraft=mode, predraft_calls=2))
    hits = misses = 0
    for prompt, ref in zip(PROMPTS, references):
        res, _, _ = cluster.generate_many("flowspec", [SimRequest(1, tuple(prompt), 40)], BatchConfig(max_concurrent=1),
                                          device="orin-nano-8gb")
        done = res.requests[1].done
        assert done.token_ids == ref, (prompt, nodes, mode)
        hits += done.stats.predraft.get("hits", 0)
        misses += done.stats.predraft.get("misses", 0)
    if nodes > 2 and mode == "idle":
        assert hits > 0 and misses > 0, (hits, misses)   # both paths ran


def test_concurrent_requests_with_predrafting_equal_greedy(tiny_pair, references):
    base, draft = tiny_pair
    cluster = Cluster(base, draft, 3, SMALL.with_(predraft="idle"))
    reqs = [SimRequest(i, tuple(p), 40) for i, p in enumerate(PROMPTS)]
    res, _, _ = cluster.generate_many("flowspec", reqs, BatchConfig(max_concurrent=3), device="orin-nano-8gb")
    assert [res.requests[i].done.token_ids for i in range(len(PROMPTS))] == references


def test_the_drafter_device_is_charged_on_its_own_lane(tiny_pair):
    base, draft = tiny_pair
    cluster = Cluster(base, draft, 3, SMALL.with_(predraft="drafter"))
    res, _, _ = cluster.generate_many("flowspec", [SimRequest(1, tuple(PROMPTS[0]), 30)], BatchConfig(max_concurrent=1),
                                      device="orin-nano-8gb")
    lanes = {e.lane for e in res.trace.events}
    assert "drafter" in lanes
    predraft_on_node0 = [e for e in res.trace.events if e.lane.startswith("node0") and e.phase == "predraft"]
    assert not predraft_on_node0
    stats = res.requests[1].done.stats.predraft   # the answers were grafted into node 0's tree
    assert stats["grafted_nodes"] > 0 and stats["calls"] > 0 and stats["unanswered"] == 0, stats


def test_offload_and_idle_actions_carry_their_work():
    assert Offload("job", "snapshot", 10).snapshot == "snapshot" and WhenIdle("x").event == "x"


@pytest.mark.parametrize("mode", ["idle", "drafter"])
def test_sampling_with_predrafting_keeps_the_base_distribution(tiny_pair, mode):
    """Two-sample test: the 8th token with pre-drafting against plain ar-pp, 250 seeds each."""
    base, draft = tiny_pair
    cluster = Cluster(base, draft, 3, SMALL.with_(predraft=mode, predraft_calls=2))
    counts = {"predraft": collections.Counter(), "ar-pp": collections.Counter()}
    hits = 0
    for seed in range(250):
        res, _, _ = cluster.generate_many("flowspec", [SimRequest(1, tuple(PROMPTS[1]), 8,
                                                                  SamplingParams(temperature=1.0, seed=seed))],
                                          BatchConfig(max_concurrent=1), device="orin-nano-8gb")
        done = res.requests[1].done
        hits += done.stats.predraft.get("hits", 0)
        if len(done.token_ids) == 8:
            counts["predraft"][done.token_ids[7]] += 1
        ar, _, _ = cluster.generate("ar-pp", PROMPTS[1], 8, SamplingParams(temperature=1.0, seed=10_000 + seed))
        if len(ar.done.token_ids) == 8:
            counts["ar-pp"][ar.done.token_ids[7]] += 1
    assert hits > 10 or mode == "drafter"   # the drafter's answers mostly duplicate node 0's own calls
    top = [t for t, _ in (counts["predraft"] + counts["ar-pp"]).most_common(5)]
    table = [[c[t] for t in top] + [sum(c.values()) - sum(c[t] for t in top)] for c in counts.values()]
    assert chi2_contingency(table).pvalue > 1e-3


@pytest.mark.parametrize("mode", ["idle", "drafter"])
def test_auto_switching_from_flowspec_to_pipedec_drops_the_pre_draft_job(tiny_pair, references, monkeypatch, mode):
    """A job still out from a flowspec round must not grow pipedec's tree (pipedec's round tree is the draft
    tree itself): the answer completes, identical to greedy."""
    from flowedge.engine.auto_policy import FLOWSPEC, PIPEDEC, Chooser

    calls = {"n": 0}

    def decide(self, tokens_left=None):
        calls["n"] += 1
        return FLOWSPEC if calls["n"] <= 6 else PIPEDEC

    monkeypatch.setattr(Chooser, "decide", decide)
    base, draft = tiny_pair
    cluster = Cluster(base, draft, 3, SMALL.with_(predraft=mode, predraft_calls=3))
    res, _, _ = cluster.generate_many("auto", [SimRequest(1, tuple(PROMPTS[0]), 40)], BatchConfig(max_concurrent=1),
                                      device="orin-nano-8gb")
    assert res.requests[1].done.token_ids == references[0]


def test_no_drafter_job_is_made_while_no_drafter_is_there(tiny_pair):
    drafter = Drafter(StageModel.load(tiny_pair[1]))
    context = list(range(3, 15))
    drafter.build(context, TreeShape(4, 2))
    present = [False]
    pre = PreDrafting(drafter, SpecConfig(topk=4, l_max=4, predraft="drafter"), present=lambda: present[0])
    assert pre.plan(context, in_flight=True) == [] and pre.stats.jobs == 0
    present[0] = True
    (offload,) = pre.plan(context, in_flight=True)
    assert isinstance(offload, Offload) and offload.snapshot.context == tuple(context)
