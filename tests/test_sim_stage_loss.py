"""A stage lost mid-answer in the simulator (sim/cluster.py `StageFault`): node 0's scheduler pauses the
request and replays it when the slot is filled, exactly as the daemon's head does (the same scheduler,
engine/scheduler.py). The daemon's twin of this scenario runs head, stages and a client on the in-memory link."""
from __future__ import annotations

import pytest

from flowedge.core.config import SpecConfig
from flowedge.core.sampling import SamplingParams
from flowedge.engine.local import generate_ar
from flowedge.errors import ConfigError
from flowedge.sim.cluster import BatchConfig, SimRequest, StageFault
from flowedge.sim.run import Cluster

SMALL = SpecConfig(tree_nodes=24, tree_depth=4, topk=4, l_max=6, exp_nodes=12, exp_depth=3,
                   se_nodes=4, pipedec_width=4, prefill_chunk=5)
PROMPT = list(range(3, 20))
NEW = 24
DOWN_S = 0.5   # simulated seconds the stage is gone


@pytest.fixture(scope="module")
def reference(tiny_pair):
    return generate_ar(tiny_pair[0], PROMPT, NEW, SamplingParams()).token_ids


def _run(cluster: Cluster, strategy: str, faults=(), batch=BatchConfig(max_concurrent=2)):
    res, _, stages = cluster.generate_many(strategy, [SimRequest(1, tuple(PROMPT), NEW)], batch,
                                           device="orin-nano-8gb", faults=faults)
    return res, stages


@pytest.mark.parametrize("strategy", ["flowspec", "ar-pp"])
def test_a_stage_lost_mid_answer_is_replayed_to_the_same_tokens(tiny_pair, reference, strategy):
    cluster = Cluster(*tiny_pair, 3, SMALL)
    calm, _ = _run(cluster, strategy)
    emits = calm.requests[1].emits
    assert calm.requests[1].done.token_ids == reference and calm.requests[1].replays == 0
    mid = len(emits) // 2   # lose stage 2 between two emits in the middle of the answer
    at_s = (emits[mid - 1][0] + emits[mid][0]) / 2
    res, stages = _run(cluster, strategy, (StageFault(2, at_s, at_s + DOWN_S),))
    timing = res.requests[1]
    assert timing.done.token_ids == reference and not timing.done.cancelled and timing.failed is None
    assert timing.replays == 1
    before = sum(k for t, k in timing.emits if t < at_s)
    assert 0 < before < NEW                                          # lost mid-answer
    # nothing while the stage is gone, but the verification node 0 was running when it died (its input was in)
    assert len([t for t, _ in timing.emits if at_s <= t < at_s + DOWN_S]) <= 1
    assert res.sim_time_s > calm.sim_time_s + DOWN_S                  # the outage and the replay cost time
    assert all(st.cached_tokens() == 0 for st in stages)              # every stage freed the request


def test_an_outage_longer_than_the_recovery_deadline_fails_the_request(tiny_pair):
    cluster = Cluster(*tiny_pair, 3, SMALL)
    res, _ = _run(cluster, "ar-pp", (StageFault(1, 0.05, 5.0),), BatchConfig(max_concurrent=2, recovery_s=1.0))
    timing = res.requests[1]
    assert timing.failed is not None and "stage 1 lost" in timing.failed and "within 1 s" in timing.failed
    assert timing.finish_s == pytest.approx(1.05, abs=1e-6)   # failed at the deadline, not when the stage came back
    assert timing.replays == 0 and len(timing.done.token_ids) < NEW


def test_a_fault_plan_is_checked():
    with pytest.raises(ConfigError, match="stage fault"):
        StageFault(0, 1.0, 2.0)
    with pytest.raises(ConfigError, match="stage fault"):
        StageFault(1, 2.0, 1.0)
