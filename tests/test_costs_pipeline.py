"""A pipeline's costs on profiled devices: which kernels node 0's draft is charged on, and the CostModel."""
from __future__ import annotations

from types import SimpleNamespace

import pytest

from flowedge.costs.model import draft_time_s, forward_time_s, lm_head_time_s, shape_of_layers, transfer_time_s
from flowedge.costs.pipeline import CostModel, draft_path_for, draft_quant_for, profile_costs
from flowedge.costs.profiles import load_device, load_link
from flowedge.errors import ConfigError

BASE = SimpleNamespace(hidden_size=1536, num_hidden_layers=28, num_attention_heads=12, num_key_value_heads=2,
                       intermediate_size=8960, vocab_size=151936, head_dim=None)
DRAFT = SimpleNamespace(hidden_size=896, num_hidden_layers=24, num_attention_heads=14, num_key_value_heads=2,
                        intermediate_size=4864, vocab_size=151936, head_dim=None)
RANGES = [(0, 14), (14, 28)]


def _work(what: str, tokens: int, context: int = 64) -> SimpleNamespace:
    return SimpleNamespace(what=what, tokens=tokens, context=context, attended=None)


def test_the_simulated_draft_runs_the_numerics_it_is_charged_for() -> None:
    assert draft_quant_for("orin-nano-8gb") == "int4"             # torch-int4 stages and draft
    assert draft_quant_for("orin-nano-8gb", "hf-bnb4") == "none"  # bnb testbed: the draft runs fp16
    assert draft_quant_for("x86-cpu") == "int4"                   # flowedge's W4A16 CPU kernels
    assert draft_quant_for("x86-cpu", "cpu-fp32") == "none"       # the HF fp32 path
    assert draft_quant_for(None) == "none"


def test_node0_drafts_on_the_stage_kernels_except_a_dequantizing_family() -> None:
    orin = load_device("orin-nano-8gb")
    assert draft_path_for(orin) == "torch-int4"
    assert draft_path_for(orin, "hf-bnb4") == "hf-fp16"     # a family name, not a path: fp16 drafting
    assert draft_path_for(load_device("x86-cpu")) == "cpu-native"


def test_free_costs_charge_nothing() -> None:
    free = CostModel.free()
    assert free.compute_s(1, _work("stage", 16)) == 0.0 and free.transfer_s(0, 1, 10_000) == 0.0
    assert free.tree is None and free.lm_head_segment_ratio is None


def test_profile_costs_charge_each_node_its_own_work() -> None:
    dev, link = load_device("orin-nano-8gb"), load_link("1gbe")
    costs = profile_costs(BASE, DRAFT, RANGES, "orin-nano-8gb", "1gbe")
    second = shape_of_layers(BASE, *RANGES[1])
    assert costs.compute_s(2, _work("stage", 16)) == forward_time_s(dev, second, 16, 64)
    assert costs.compute_s(0, _work("draft", 10)) == draft_time_s(dev, DRAFT, 10, 64, "torch-int4")
    assert costs.compute_s(0, _work("lm_head", 1)) == lm_head_time_s(dev, BASE, 1)
    assert costs.compute_s(0, _work("embed", 16)) == 0.0    # node 0's embedding is not charged
    assert costs.transfer_s(0, 1, 4096) == transfer_time_s(link, 4096)
    assert costs.tree is not None and costs.tree.n_stages == 2
    assert costs.lm_head_segment_ratio is not None and costs.lm_head_segment_ratio >= 1.0


def test_profile_costs_without_a_draft_have_no_tree_and_unknown_devices_fail() -> None:
    assert profile_costs(BASE, None, RANGES, "x86-cpu", None).tree is None
    with pytest.raises(ConfigError):
        profile_costs(BASE, DRAFT, RANGES, "no-such-board", None)
