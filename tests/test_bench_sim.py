"""`flowedge bench` on the simulator: the results.json schema, the table and the timeline."""
from __future__ import annotations

import json

from click.testing import CliRunner

from flowedge.cli import main


def test_sim_bench_writes_results_table_and_timeline(tiny_pair, tmp_path):
    base, draft = tiny_pair
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"prompt": "abc def ghi jkl"}\n{"prompt": "zzzz"}\n')
    out = tmp_path / "out"
    res = CliRunner().invoke(main, ["bench", "--model", str(base), "--draft", str(draft), "--prompts", str(prompts),
                                    "--strategies", "ar-pp,naive-pp,flowspec", "--max-new-tokens", "16",
                                    "--nodes", "3", "--profile", "orin-nano-8gb", "--threads", "1",
                                    "--out", str(out)])
    assert res.exit_code == 0, res.output
    results = json.loads((out / "results.json").read_text())
    assert results["config"]["driver"] == "sim" and len(results["runs"]) == 6
    for run in results["runs"]:
        assert {"prompt_id", "dataset", "strategy", "token_ids", "tokens_per_s", "mean_accept_len", "restarts",
                "matches_ar"} <= set(run)
        assert run["matches_ar"] is True and run["tokens_per_s"] > 0
    assert set(results["summary"]["flowspec"]) >= {"tokens_per_s", "speedup_vs_naive_pp", "speedup_vs_ar_pp"}
    assert "flowspec" in (out / "table.md").read_text()
    assert (out / "timeline.png").stat().st_size > 1000
