"""`flowedge bench --driver zmq`: real processes, wall clock, the same report as the simulator."""
from __future__ import annotations

import json

from cluster_helpers import flowedge_home, free_port_pair
from flowedge.bench.runner import BenchConfig
from flowedge.bench.zmq_driver import run_bench_zmq
from flowedge.datasets import Prompt


def test_zmq_bench_runs_strategies_on_real_processes_and_checks_them_against_ar(tiny_pair, tmp_path):
    base, draft = tiny_pair
    cfg = BenchConfig(model=str(base), draft=str(draft), strategies=("ar-pp", "flowspec"), max_new_tokens=24,
                      nodes=3)
    prompts = [Prompt("p0", "custom", "abc def ghi jkl"), Prompt("p1", "custom", "zzzz")]
    with flowedge_home(tmp_path / "home"):
        results = run_bench_zmq(cfg, prompts, tmp_path / "out", wire_dtype="float32", threads=1,
                                port=free_port_pair())
    saved = json.loads((tmp_path / "out" / "results.json").read_text())
    assert saved["config"]["driver"] == "zmq" and len(saved["runs"]) == 4
    assert all(run["matches_ar"] is True for run in results["runs"])
    assert all(run["tokens_per_s"] > 0 and len(run["stage_step_ms_median"]) == 2 for run in results["runs"])
    assert "flowspec" in (tmp_path / "out" / "table.md").read_text()


def test_zmq_concurrency_sweep_batches_requests_and_keeps_every_answer(tiny_pair, tmp_path):
    from flowedge.bench.zmq_concurrency import run_concurrency_zmq

    base, draft = tiny_pair
    cfg = BenchConfig(model=str(base), draft=str(draft), strategies=("ar-pp",), max_new_tokens=16, nodes=3)
    prompts = [Prompt(f"p{i}", "custom", text) for i, text in enumerate(["abc def", "zzzz yy", "hello there"])]
    with flowedge_home(tmp_path / "home"):
        results = run_concurrency_zmq(cfg, prompts, (1, 3), tmp_path / "out", wire_dtype="float32", threads=1,
                                      port=free_port_pair())
    one, three = results["rows"]
    assert one["matches_ar"] and three["matches_ar"], results["rows"]   # batched answers == one at a time
    assert one["mean_batch"] == 1.0 and three["mean_batch"] > 1.0, (one["mean_batch"], three["mean_batch"])
    assert "requests per stage forward" in (tmp_path / "out" / "table.md").read_text()


def test_zmq_bench_with_a_drafter_process(tiny_pair, tmp_path):
    """`--predraft drafter` on the zmq driver starts a drafter process beside the stages and waits for it."""
    from flowedge.core.config import SpecConfig

    base, draft = tiny_pair
    cfg = BenchConfig(model=str(base), draft=str(draft), strategies=("flowspec",), max_new_tokens=40, nodes=3,
                      spec=SpecConfig().with_(predraft="drafter"))
    with flowedge_home(tmp_path / "home"):
        results = run_bench_zmq(cfg, [Prompt("p0", "custom", "abc def ghi jkl")], tmp_path / "out",
                                wire_dtype="float32", threads=1, port=free_port_pair())
    run, = results["runs"]
    assert run["matches_ar"] is True and len(run["stage_step_ms_median"]) == 2
    assert run["predraft"]["jobs"] > 0 and run["predraft"]["unanswered"] < run["predraft"]["jobs"], run["predraft"]
