"""`auto` and tree sizing priced with the links: one trip's link time (from a link profile in the simulator,
from the round trips the head measures in the daemon) is added to every trip through the pipeline."""
from __future__ import annotations

from types import SimpleNamespace

import pytest

from flowedge.core.config import SpecConfig
from flowedge.costs.link_costs import ring_s_for_link, ring_s_from_rtts
from flowedge.costs.pipeline import DRAFT_QUANT_OF_PATH, draft_path_for
from flowedge.costs.profiles import load_device, load_link
from flowedge.costs.sizing import sized_spec_for, tree_costs
from flowedge.engine.auto_policy import AR_PP, FLOWSPEC, Chooser, predict_from_costs
from flowedge.node.head_engines import RING_STEP_S, link_ring_s
from flowedge.node.link_rtt import RttSamples
from flowedge.sim.run import balanced
from tests.test_engine_auto import BASE, DRAFT

PRESETS = ("lan", "wifi", "bad-wifi")


def _costs(device: str, nodes: int):
    dev = load_device(device)
    ranges = balanced(BASE.num_hidden_layers, nodes - 1)
    path = draft_path_for(dev)
    return tree_costs(BASE, DRAFT, ranges, [dev] * len(ranges), dev, draft_path=path,
                      draft_quantized=DRAFT_QUANT_OF_PATH.get(path) == "int4")


def _choose(device: str, nodes: int, preset: str | None, tokens_left: int = 128):
    costs = _costs(device, nodes)
    ring = ring_s_for_link(load_link(preset), nodes - 1) if preset else 0.0
    prediction = predict_from_costs(costs.over_links(ring))
    return Chooser(prediction, tokens_left=tokens_left), prediction


@pytest.mark.parametrize("nodes", [2, 3])
def test_on_the_testbeds_cpus_ar_pp_stays_the_choice_on_every_preset(nodes):
    """The testbed (1-core x86 devices, 2 and 3 of them): auto ran ar-pp on every preset and beat llama.cpp's
    RPC from wifi on. With the links priced, ar-pp's predicted rate falls with each preset, flowspec's much
    less (its link time is paid once a round), and ar-pp is still ahead: the choice was right."""
    rates = []
    for preset in (None, *PRESETS):
        chooser, prediction = _choose("x86-cpu", nodes, preset)
        assert chooser.choice == AR_PP, (preset, chooser.reason)
        rates.append(prediction.rates)
    ar = [r[AR_PP] for r in rates]
    ratio = [r[FLOWSPEC] / r[AR_PP] for r in rates]
    assert ar == sorted(ar, reverse=True) and ar[-1] < 0.75 * ar[0]
    assert ratio == sorted(ratio) and ratio[-1] > 1.3 * ratio[0]


def test_over_slow_links_a_longer_pipeline_turns_speculative():
    """5 CPU devices: four hops of a token through the ring; on bad-wifi those cost more than flowspec's
    compute-bound steps, so auto speculates there, and only there."""
    choices = {p: _choose("x86-cpu", 5, p)[0].choice for p in PRESETS}
    assert choices == {"lan": AR_PP, "wifi": AR_PP, "bad-wifi": FLOWSPEC}
    assert _choose("x86-cpu", 5, None)[0].choice == AR_PP


def test_the_tree_deepens_to_cover_a_slower_ring():
    costs = _costs("x86-cpu", 2)
    depths = [sized_spec_for(SpecConfig(), costs.over_links(ring_s_for_link(load_link(p), 1))).tree_depth
              for p in PRESETS]
    assert depths == sorted(depths) and depths[-1] > depths[0]


def test_links_are_added_once_whatever_the_calls():
    costs = _costs("x86-cpu", 3)
    once = costs.over_links(0.05)
    assert once.token_latency_s == pytest.approx(costs.token_latency_s + 0.05)
    assert once.pipeline_latency_s == pytest.approx(costs.pipeline_latency_s + 0.05)
    assert once.over_links(0.05) == once and once.over_links(0.0) == costs.over_links(0.0) == costs


def test_the_ring_from_measured_round_trips():
    assert ring_s_from_rtts([], 2) == 0.0 and ring_s_from_rtts([None, None], 2) == 0.0
    assert ring_s_from_rtts([10.0, None, 12.0, 500.0], 3) == pytest.approx(4 * 12.0 / 2e3)   # the median
    assert ring_s_from_rtts([10.0, 12.0], 2) == pytest.approx(3 * 11.0 / 2e3)
    wifi = load_link("wifi")
    # a round trip measured on a wifi preset gives the ring the profile would
    assert ring_s_from_rtts([2 * 1e3 * ring_s_for_link(wifi, 0)] * 2, 2) == pytest.approx(ring_s_for_link(wifi, 2))


def test_the_head_reads_its_stages_round_trips_rounded():
    def peer(*ms):
        samples = RttSamples()
        for m in ms:
            samples.add(m)
        return SimpleNamespace(rtt=samples)

    peers = {b"a": peer(20.0, 21.0, 22.0), b"b": peer(24.0), b"old": peer()}
    members = SimpleNamespace(peers=peers, stage_identities=lambda: [b"a", b"b", b"old"])
    ring = link_ring_s(members)
    assert ring == pytest.approx(round(4 * 22.5 / 2e3 / RING_STEP_S) * RING_STEP_S) == pytest.approx(0.045)
    peers[b"a"].rtt.add(21.5)   # heartbeat noise leaves the engines' key alone
    assert link_ring_s(members) == ring
    assert link_ring_s(SimpleNamespace(peers={}, stage_identities=lambda: [])) == 0.0
