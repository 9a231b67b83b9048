"""The planner: memory limits honoured, faster devices get more layers, the optimum is exact, and a
model that cannot fit gets one clear error."""
from __future__ import annotations

import itertools
import json
import random
import subprocess
import sys
from dataclasses import replace
from types import SimpleNamespace

import pytest

from flowedge.costs.profiles import list_devices, load_device, load_link
from flowedge.plan.planned_cluster import plan_cluster
from flowedge.plan.memory import GiB
from flowedge.plan.partition import IDLE_GAIN, PlanError, PlanInputs, plan_partition, stage_devices
from flowedge.plan.shapes import list_shapes, load_shape, shape_from_dict

MIXED = ["agx-orin-64gb", "orin-nano-8gb", "orin-nano-8gb", "rpi5-8gb"]


def _inputs(model, names, free_gib=None, **kw) -> PlanInputs:
    free = [None if f is None else int(f * GiB) for f in free_gib] if free_gib else None
    config = load_shape(model) if isinstance(model, str) else model
    return PlanInputs(config, stage_devices([load_device(n) for n in names], free, quant=kw.get("quant", "int4")),
                      **kw)


def _fits(inputs: PlanInputs, plan) -> bool:
    return all(s.memory.total_bytes <= s.usable_bytes for s in plan.stages)


def test_shapes_ship_with_the_package():
    assert {"llama-2-7b", "llama-2-13b", "llama-2-70b", "qwen2.5-coder-1.5b"} <= set(list_shapes())
    assert load_shape("llama-2-70b").num_key_value_heads == 8


def test_faster_devices_get_more_layers_and_every_stage_fits():
    inputs = _inputs("llama-2-7b", ["orin-nano-8gb", "agx-orin-64gb", "orin-nano-8gb"], quant="int4")
    plan = plan_partition(inputs)
    counts = plan.counts
    assert sum(counts) == 32 and counts[1] > counts[0] and counts[1] > counts[2]
    assert _fits(inputs, plan)
    assert plan.ranges[0][0] == 0 and all(a[1] == b[0] for a, b in zip(plan.ranges, plan.ranges[1:]))


def test_memory_limits_move_layers_off_a_fast_but_full_device():
    free = plan_partition(_inputs("llama-2-7b", ["agx-orin-64gb", "orin-nano-8gb"], quant="int4"))
    tight = _inputs("llama-2-7b", ["agx-orin-64gb", "orin-nano-8gb"], free_gib=[2.5, None], quant="int4")
    plan = plan_partition(tight)
    assert plan.counts[0] < free.counts[0]
    assert _fits(tight, plan) and plan.stages[0].memory.total_bytes <= 2.5 * GiB
    # FlowSpec's 13B setting: 16-bit weights do not fit four Orin Nanos, bitsandbytes 4-bit does
    with pytest.raises(PlanError, match="does not fit"):
        plan_partition(_inputs("llama-2-13b", ["orin-nano-8gb"] * 4, quant="none"))
    nf4 = _inputs("llama-2-13b", ["orin-nano-8gb"] * 4, quant="nf4")
    assert _fits(nf4, plan_partition(nf4))


def test_a_model_that_cannot_fit_gets_one_error_naming_the_shortfall_and_the_devices():
    with pytest.raises(PlanError) as err:
        plan_partition(_inputs("llama-2-70b", ["orin-nano-8gb", "orin-nano-8gb", "rpi5-8gb"], quant="int4"))
    text = str(err.value)
    assert "\n" not in text and "does not fit" in text and "GiB missing" in text
    assert "stage 3 rpi5-8gb" in text and "holds" in text
    with pytest.raises(PlanError, match="cannot hold one layer"):
        plan_partition(_inputs("llama-2-7b", ["orin-nano-8gb", "orin-nano-8gb"], free_gib=[6, 0.5]))


def _brute_force(inputs: PlanInputs) -> float:
    layers, stages = inputs.config.num_hidden_layers, len(inputs.devices)
    best = float("inf")
    for cuts in itertools.combinations(range(1, layers), stages - 1):
        counts = [b - a for a, b in zip((0, *cuts), (*cuts, layers))]
        fits, bottleneck = inputs.evaluate(counts)
        if fits:
            best = min(best, bottleneck)
    return best


@pytest.mark.parametrize("seed", range(12))
def test_the_split_is_the_exact_minimum_bottleneck(seed):
    rng = random.Random(seed)
    config = shape_from_dict({"hidden_size": 2048, "intermediate_size": 5632, "num_attention_heads": 16,
                              "num_key_value_heads": rng.choice([4, 16]), "num_hidden_layers": rng.randint(6, 12),
                              "vocab_size": 32000}, "test")
    names = [rng.choice(list_devices()) for _ in range(rng.randint(2, 4))]
    free = [rng.choice([None, 1.0, 1.5, 3.0]) for _ in names]
    inputs = _inputs(config, names, free_gib=free, quant=rng.choice(["none", "int4"]),
                     step_tokens=rng.choice([1, 16]))
    expected = _brute_force(inputs)
    if expected == float("inf"):
        with pytest.raises(PlanError):
            plan_partition(inputs)
        return
    plan = plan_partition(inputs)
    assert _fits(inputs, plan) and plan.bottleneck_s == pytest.approx(expected, rel=1e-9)


def test_plan_cluster_puts_the_lm_head_on_the_best_last_stage_and_checks_node0():
    cluster = plan_cluster("llama-2-7b", MIXED, quant="int4", allow_idle=False)
    assert sorted(d.profile.name for d in cluster.devices) == sorted(MIXED)
    assert cluster.devices[-1].profile.name != "rpi5-8gb"       # the slowest board never runs the lm_head
    with pytest.raises(PlanError, match="node 0"):
        plan_cluster("llama-2-7b", ["agx-orin-64gb"] * 2, head_device="rpi5-8gb", head_free_bytes=GiB)


def _plan_cli(*args):
    return subprocess.run([sys.executable, "-m", "flowedge", "plan", *args], capture_output=True, text=True,
                          timeout=120)


def test_plan_command_prints_stages_memory_and_the_analytic_speed():
    proc = _plan_cli("--model", "llama-2-7b", "--devices", ",".join(MIXED), "--no-simulate", "--json")
    assert proc.returncode == 0, proc.stderr
    report = json.loads(proc.stdout)
    assert sum(s["count"] for s in report["stages"]) == 32
    assert all(s["total_gib"] <= s["usable_gib"] for s in report["stages"])
    assert report["predicted_tokens_per_s"]["ar-pp (analytic)"] > 0
    table = _plan_cli("--model", "llama-2-13b", "--devices", "orin-nano-8gb,orin-nano-8gb", "--quant", "int4",
                      "--no-simulate")
    assert table.returncode == 0 and "bottleneck" in table.stdout and "orin-nano-8gb" in table.stdout
    bad = _plan_cli("--model", "llama-2-70b", "--devices", "rpi5-8gb", "--no-simulate")
    assert bad.returncode == 1 and bad.stderr.strip().startswith("error: ") and "missing" in bad.stderr
    assert "Traceback" not in bad.stderr


def test_simulated_prediction_runs_every_strategy_on_shape_only_stages(tiny_pair):
    from flowedge.plan.predict import ar_pp_tokens_per_s, simulate

    cluster = plan_cluster("llama-2-7b", ["orin-nano-8gb"] * 4, quant="int4")
    out = simulate(cluster, *tiny_pair, ["abc def ghi"], ("ar-pp", "flowspec", "pipedec", "auto"), max_new_tokens=12)
    assert set(out) == {"ar-pp", "flowspec", "pipedec", "auto"} and all(r["tokens_per_s"] > 0 for r in out.values())
    assert all(r["identical_to_greedy"] for r in out.values())
    # one token through every stage: the simulated ar-pp is the analytic figure within the prefill's share
    assert out["ar-pp"]["tokens_per_s"] == pytest.approx(ar_pp_tokens_per_s(cluster), rel=0.35)


def test_ar_pp_minimises_the_latency_its_single_token_pays():
    one_token = plan_cluster("llama-2-7b", MIXED, quant="int4", strategy="ar-pp", allow_idle=False)
    assert one_token.plan.step_tokens == 1
    inputs = _inputs("llama-2-7b", [d.profile.name for d in one_token.devices], quant="int4", step_tokens=1)
    step = {(k, n): inputs.step_s(k, n) for k in range(4) for n in range(1, 30)}
    best = min(sum(step[k, n] for k, n in enumerate(b - a for a, b in zip((0, *cuts), (*cuts, 32))))
               for cuts in itertools.combinations(range(1, 32), 3))
    assert one_token.plan.latency_s == pytest.approx(best, rel=1e-9)


def test_predicted_costs_use_the_plans_kernel_path_not_the_profiles_default():
    from flowedge.plan.predict import cost_model
    from flowedge.costs.pipeline import draft_path_for
    from flowedge.costs.sizing import tree_costs

    draft = load_shape("qwen2.5-coder-0.5b")
    trees = {}
    for path in ("torch-int4", "hf-bnb4-multi"):
        cluster = plan_cluster("llama-2-7b", ["orin-nano-8gb"] * 4, quant="nf4", path=path)
        assert {d.path for d in cluster.devices} == {path}
        trees[path] = cost_model(cluster, draft, draft_quantized=True).tree
        expected = tree_costs(cluster.config, draft, cluster.plan.ranges, [d.profile for d in cluster.devices],
                              cluster.head_device, stage_path=path,
                              draft_path=draft_path_for(cluster.head_device, path), draft_quantized=True)
        assert trees[path] == expected
    # the dequantizing bitsandbytes path is far slower on a segment than tinygemm: the sizing must see it
    assert trees["hf-bnb4-multi"].pipeline_latency_s > 2 * trees["torch-int4"].pipeline_latency_s


def test_int4_stages_are_priced_on_the_kernels_each_device_runs_them_on():
    """flowedge's own W4A16 kernels on the x86 profile (its fitted `cpu-native`, not the estimated torch int4
    path it keeps), torch's tinygemm on a Jetson; unquantized weights on x86 still take the fp32 path."""
    x86, orin = load_device("x86-cpu"), load_device("orin-nano-8gb")
    assert [d.path for d in stage_devices([x86, orin], quant="int4")] == ["cpu-native", "torch-int4"]
    assert [d.path for d in stage_devices([x86], quant="none")] == ["cpu-fp32"]
    assert [d.path for d in stage_devices([x86], quant="int4", path="torch-int4")] == ["torch-int4"]


def test_a_head_of_another_kind_is_priced_drafting_on_its_own_kernels():
    """An x86 head beside Orin stages drafts on its own cpu-native kernels, as the live head prices it
    (engine/assembly.profile_tree_costs), not on the Orins' torch-int4 path the x86 profile also lists."""
    from flowedge.costs.model import draft_time_s
    from flowedge.plan.predict import cost_model

    draft = load_shape("qwen2.5-coder-0.5b")
    cluster = plan_cluster("qwen2.5-coder-1.5b", ["orin-nano-8gb"] * 2, head_device="x86-cpu")
    costs = cost_model(cluster, draft, draft_quantized=True)
    charged = costs.compute_s(0, SimpleNamespace(what="draft", tokens=10, context=200))
    x86 = load_device("x86-cpu")
    assert charged == pytest.approx(draft_time_s(x86, draft, 10, 200, "cpu-native", True))
    assert charged < draft_time_s(x86, draft, 10, 200, "torch-int4", True) / 2
    same = plan_cluster("qwen2.5-coder-1.5b", ["orin-nano-8gb"] * 2)   # an Orin head drafts as its stages
    orin = load_device("orin-nano-8gb")
    assert cost_model(same, draft, draft_quantized=True).compute_s(
        0, SimpleNamespace(what="draft", tokens=10, context=200)) == pytest.approx(
        draft_time_s(orin, draft, 10, 200, "torch-int4", True))


def test_the_live_heads_tree_costs_price_stages_on_their_quantizations_path():
    """The head sizes flowspec's tree from the stages' reported devices: fp32 stages on x86 (quant none)
    cost the fp32 path, int4 stages flowedge's kernels; the planner prices them the same way."""
    from flowedge.costs.sizing import tree_costs
    from flowedge.engine.assembly import profile_tree_costs
    from flowedge.core.config import SpecConfig

    base, draft = load_shape("qwen2.5-coder-1.5b"), load_shape("qwen2.5-coder-0.5b")
    ranges, x86, spec = [(0, 14), (14, 28)], load_device("x86-cpu"), SpecConfig()
    costs = {q: profile_tree_costs(base, draft, ranges, "x86-cpu", ["x86-cpu"] * 2, spec, True, quant=q)
             for q in ("int4", "none")}
    for quant, path in (("int4", "cpu-native"), ("none", "cpu-fp32")):
        assert costs[quant] == tree_costs(base, draft, ranges, [x86, x86], x86, draft_path="cpu-native",
                                          stage_paths=[path, path], l_max=spec.l_max, topk=spec.topk,
                                          draft_quantized=True)
    assert costs["none"].pipeline_latency_s > 2 * costs["int4"].pipeline_latency_s


def test_a_device_that_slows_the_pipeline_is_left_out_with_the_reason():
    used_all = plan_partition(_inputs("llama-2-7b", MIXED, quant="int4"))
    assert len(used_all.stages) == 4 and not used_all.unused   # by default every device serves layers
    inputs = _inputs("llama-2-7b", MIXED, quant="int4", allow_idle=True)
    plan = plan_partition(inputs)
    assert [u.device for u in plan.unused] == ["rpi5-8gb"] and "ms/step here" in plan.unused[0].reason
    assert [s.device for s in plan.stages] == MIXED[:3] and sum(plan.counts) == 32 and _fits(inputs, plan)
    assert plan.stages[-1].memory.total_bytes > inputs.need(2, plan.counts[-1], last=False).total_bytes  # lm_head
    assert plan.bottleneck_s < 0.5 * used_all.bottleneck_s
    # two slow boards: leaving out either alone gains nothing, both together do (an exact search, not greedy)
    two = plan_partition(_inputs("llama-2-7b", ["agx-orin-64gb", "rpi5-8gb", "rpi5-8gb", "orin-nano-8gb"],
                                 quant="int4", allow_idle=True))
    assert [u.device for u in two.unused] == ["rpi5-8gb", "rpi5-8gb"] and len(two.stages) == 2
    # alike devices all serve; a device without room for one layer is left out while the rest fit
    assert not plan_partition(_inputs("llama-2-7b", ["orin-nano-8gb"] * 4, allow_idle=True)).unused
    tight = plan_partition(_inputs("llama-2-7b", ["orin-nano-8gb"] * 3, free_gib=[6, 0.5, 6], allow_idle=True))
    assert [u.index for u in tight.unused] == [1] and "cannot hold one layer" in tight.unused[0].reason
    with pytest.raises(PlanError, match="does not fit"):   # leaving devices out never hides a real shortfall
        plan_partition(_inputs("llama-2-70b", ["orin-nano-8gb", "orin-nano-8gb", "rpi5-8gb"], allow_idle=True))


@pytest.mark.parametrize("seed", range(6))
def test_leaving_devices_out_finds_the_best_subset(seed):
    rng = random.Random(100 + seed)
    config = shape_from_dict({"hidden_size": 2048, "intermediate_size": 5632, "num_attention_heads": 16,
                              "num_key_value_heads": 4, "num_hidden_layers": rng.randint(5, 9),
                              "vocab_size": 32000}, "test")
    names = [rng.choice(list_devices()) for _ in range(rng.randint(2, 4))]
    inputs = _inputs(config, names, quant="int4", step_tokens=16, allow_idle=True,
                     link=load_link(load_device(names[0]).default_link))   # not the first device's: it may idle
    best = min((_brute_force(replace(inputs, devices=tuple(inputs.devices[k] for k in keep)))
                for r in range(1, len(names) + 1) for keep in itertools.combinations(range(len(names)), r)
                if r <= config.num_hidden_layers), default=float("inf"))
    plan = plan_partition(inputs)
    assert plan.bottleneck_s <= _brute_force(inputs) * (1 + 1e-9)
    if plan.unused:   # taken only for a real gain, and then the best subset's pace
        assert plan.bottleneck_s == pytest.approx(best, rel=1e-9)
        assert plan.bottleneck_s < _brute_force(inputs) * (1 - IDLE_GAIN) + 1e-12


def test_plan_command_marks_the_device_it_leaves_out():
    proc = _plan_cli("--model", "llama-2-7b", "--devices", ",".join(MIXED), "--no-simulate")
    assert proc.returncode == 0, proc.stderr
    # the board the stages leave out holds the draft model: listed as the drafter, not as unused
    assert "drafter rpi5-8gb" in proc.stdout and "unused rpi5" not in proc.stdout, proc.stdout
    assert "ms/step here" in proc.stdout and proc.stdout.count("orin-nano-8gb ") == 2
    forced = _plan_cli("--model", "llama-2-7b", "--devices", ",".join(MIXED), "--no-simulate", "--use-all", "--json")
    assert json.loads(forced.stdout)["unused"] == [] and len(json.loads(forced.stdout)["stages"]) == 4
    assert json.loads(forced.stdout)["drafter"] is None


def test_one_spare_board_becomes_the_drafter_and_the_others_stay_unused():
    devices = ["agx-orin-64gb", "rpi5-8gb", "rpi5-8gb", "orin-nano-8gb"]
    report = json.loads(_plan_cli("--model", "llama-2-7b", "--devices", ",".join(devices), "--no-simulate",
                                  "--json").stdout)
    assert report["drafter"]["device"] == "rpi5-8gb" and 0 < report["drafter"]["total_gib"] < 2
    assert [u["device"] for u in report["unused"]] == ["rpi5-8gb"] and len(report["stages"]) == 2
    # a spare that cannot hold the draft model stays unused
    tight = plan_cluster("llama-2-7b", ["orin-nano-8gb"] * 3, free_memory_bytes=[6 << 30, 1 << 29, 6 << 30])
    assert tight.drafter is None and [u.index for u in tight.plan.unused] == [1]
