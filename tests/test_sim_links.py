"""The simulator's link model (costs/link_costs.py): delay, jitter, bandwidth, stalls and the per-message
cost behave as the testbed relay does, repeatably per seed; the presets are named as the testbed names them."""
from __future__ import annotations

import pytest

from flowedge.core.sampling import SamplingParams
from flowedge.costs.link_costs import CHUNK_BYTES, LinkClock, LinkClocks, chunks_of, expected_s
from flowedge.costs.pipeline import CostModel
from flowedge.costs.profiles import LinkProfile, load_link
from flowedge.errors import ConfigError
from flowedge.sim.cluster import SimCluster
from flowedge.sim.run import Cluster
from tests.test_engine_strategies import PROMPTS, SMALL

MBIT = 1e6


def _link(**kw) -> LinkProfile:
    return LinkProfile(**{"name": "t", "latency_s": 0.005, "bandwidth_bps": 100 * MBIT, **kw})


def test_a_plain_link_charges_latency_serialisation_and_the_message_cost():
    clock = LinkClock(_link(message_s=0.0004), seed=0, src=0, dst=1)
    c = clock.send(1.0, 12_500)          # 100 kbit at 100 Mbit/s: 1 ms on the wire
    assert c.start_s == 1.0 and c.wire_end_s == pytest.approx(1.001)
    assert c.arrive_s == pytest.approx(1.001 + 0.005 + 0.0004)
    assert expected_s(_link(message_s=0.0004), 12_500) == pytest.approx(c.arrive_s - 1.0)


def test_bandwidth_is_shared_in_order_while_latency_overlaps():
    """Two messages sent together: the second waits for the first's bytes, not for its latency."""
    clock = LinkClock(_link(), seed=0, src=0, dst=1)
    a, b = clock.send(0.0, 125_000), clock.send(0.0, 125_000)   # 10 ms on the wire each
    assert b.start_s == pytest.approx(a.wire_end_s) == pytest.approx(0.010)
    assert b.arrive_s == pytest.approx(0.020 + 0.005)
    assert b.arrive_s - a.arrive_s == pytest.approx(0.010)      # not 10 + 5 ms
    later = clock.send(1.0, 0)                                   # an idle wire again
    assert later.start_s == 1.0 and later.arrive_s == pytest.approx(1.005)


def test_jitter_stays_within_its_bounds_never_reorders_and_keeps_its_mean():
    clock = LinkClock(_link(jitter_s=0.003), seed=7, src=0, dst=1)
    arrivals, delays = [], []
    for i in range(2000):
        c = clock.send(i * 0.0005, 100)   # closer together than the jitter: order must hold
        arrivals.append(c.arrive_s)
    assert arrivals == sorted(arrivals)
    sparse = LinkClock(_link(jitter_s=0.003), seed=7, src=0, dst=1)
    for i in range(2000):
        t = i * 1.0
        delays.append(sparse.send(t, 0).arrive_s - t)
    assert 0.002 - 1e-9 <= min(delays) < 0.0025 and 0.0075 < max(delays) <= 0.008 + 1e-9
    assert sum(delays) / len(delays) == pytest.approx(0.005, abs=0.0002)


def test_stalls_come_per_chunk_at_their_rate_and_add_their_time():
    always = LinkClock(_link(stall_prob=1.0, stall_s=0.2), seed=0, src=0, dst=1)
    assert always.send(0.0, 10).arrive_s == pytest.approx(0.205, abs=1e-4)
    big = 3 * CHUNK_BYTES + 1
    assert chunks_of(big) == 4 and chunks_of(0) == 1
    clock = LinkClock(_link(stall_prob=0.01, stall_s=0.2), seed=3, src=0, dst=1)
    for i in range(20_000):
        clock.send(i * 1.0, 100)
    assert clock.stalls == pytest.approx(200, rel=0.25)
    never = LinkClock(_link(), seed=3, src=0, dst=1)
    assert all(never.send(i * 1.0, 100).arrive_s == pytest.approx(i + 0.005 + 8e-6) for i in range(100))
    assert expected_s(_link(stall_prob=0.01, stall_s=0.2), big) == pytest.approx(
        0.005 + 8 * big / (100 * MBIT) + 4 * 0.002)


def test_each_seed_and_each_link_draws_its_own_repeatable_stream():
    def run(seed, src=0, dst=1):
        clock = LinkClocks(_link(jitter_s=0.003, stall_prob=0.05, stall_s=0.2), seed)
        return [clock.send(src, dst, i * 1.0, 1000).arrive_s for i in range(200)]
    assert run(1) == run(1)
    assert run(1) != run(2)
    assert run(1, 0, 1) != run(1, 1, 0)


def test_bad_figures_are_refused():
    for kw in ({"jitter_s": -1.0}, {"stall_prob": 1.5}, {"stall_s": -0.1}, {"message_s": -1e-3}):
        with pytest.raises(ConfigError):
            _link(**kw)
    with pytest.raises(ConfigError):
        chunks_of(-1)


@pytest.mark.parametrize("preset,latency_ms,jitter_ms,stall_prob", [
    ("lan", 0.3, 0.0, 0.0), ("wifi", 5.0, 3.0, 0.0), ("bad-wifi", 20.0, 10.0, 0.01)])
def test_the_testbed_presets_are_links_by_their_own_names(preset, latency_ms, jitter_ms, stall_prob):
    link = load_link(preset)
    assert link == load_link(f"testbed-{preset}")
    assert (link.latency_s, link.jitter_s, link.stall_prob) == pytest.approx(
        (latency_ms / 1e3, jitter_ms / 1e3, stall_prob))
    assert link.message_s > 0
    with pytest.raises(ConfigError):
        load_link("no-such-link")


def _sim_time(tiny_pair, link: LinkProfile | None, seed: int = 0) -> tuple[float, list[int]]:
    base, draft = tiny_pair
    costs = CostModel(lambda node, c: 0.01 if node else 0.0, lambda a, b, n: 0.0, link=link, link_seed=seed)
    head, stages = Cluster(base, draft, 3, SMALL).build("ar-pp", costs)
    res = SimCluster(head, stages, costs).run(1, PROMPTS[0], 12, SamplingParams())
    return res.sim_time_s, res.done.token_ids


def test_the_simulator_pays_each_hop_on_the_link_clocks(tiny_pair):
    """ar-pp on 3 nodes: every token crosses three links; slower links cost just that, same answer."""
    free_s, ids = _sim_time(tiny_pair, None)
    slow_s, slow_ids = _sim_time(tiny_pair, _link(latency_s=0.01))
    assert slow_ids == ids
    assert slow_s - free_s == pytest.approx(12 * 3 * 0.01, rel=0.1)
    stally = _link(latency_s=0.01, jitter_s=0.005, stall_prob=0.2, stall_s=0.2)
    assert _sim_time(tiny_pair, stally, 1) == _sim_time(tiny_pair, stally, 1)
    assert _sim_time(tiny_pair, stally, 1)[0] != _sim_time(tiny_pair, stally, 2)[0]
    assert _sim_time(tiny_pair, stally, 1)[0] > slow_s + 0.2
