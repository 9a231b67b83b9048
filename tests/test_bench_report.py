"""Markdown tables from results.json, and the summary block."""
from __future__ import annotations

import pytest

from flowedge.bench.report import markdown_table, summarize


def _run(strategy: str, dataset: str, pid: str, tps: float, match: bool | None = True, restarts: int = 0) -> dict:
    return {"prompt_id": pid, "dataset": dataset, "strategy": strategy, "token_ids": [1, 2, 3],
            "tokens_per_s": tps, "mean_accept_len": 1.0 if strategy.endswith("pp") else 3.5,
            "restarts": restarts, "matches_ar": match}


RUNS = [
    _run("ar-pp", "mt-bench", "a", 2.0, None), _run("ar-pp", "humaneval", "b", 2.0, None),
    _run("naive-pp", "mt-bench", "a", 4.0), _run("naive-pp", "humaneval", "b", 6.0),
    _run("flowspec", "mt-bench", "a", 8.0), _run("flowspec", "humaneval", "b", 9.0, restarts=2),
]


def test_summarize_means_and_ratios() -> None:
    summary = summarize(RUNS)
    assert summary["naive-pp"] == {"tokens_per_s": 5.0, "speedup_vs_naive_pp": 1.0, "speedup_vs_ar_pp": 2.5}
    assert summary["flowspec"]["speedup_vs_naive_pp"] == pytest.approx(8.5 / 5.0)
    assert summary["flowspec"]["speedup_vs_ar_pp"] == pytest.approx(8.5 / 2.0)


def test_summarize_missing_baseline_is_none() -> None:
    summary = summarize([r for r in RUNS if r["strategy"] != "naive-pp"])
    assert summary["flowspec"]["speedup_vs_naive_pp"] is None
    assert summary["flowspec"]["speedup_vs_ar_pp"] == pytest.approx(4.25)


def _row(table: str, first_cell: str, nth: int = 0) -> list[str]:
    rows = [line for line in table.splitlines() if line.startswith(f"| {first_cell} ")]
    return [c.strip() for c in rows[nth].strip("|").split("|")]


def test_table_has_paper_shape() -> None:
    results = {"config": {"model": "qwen-1.5b", "devices": ["a", "b"], "temperature": 0.0},
               "runs": RUNS, "summary": summarize(RUNS)}
    md = markdown_table(results)
    assert "Config: model=qwen-1.5b, temperature=0.0" in md
    header = _row(md, "Strategy")
    assert header == ["Strategy", "mt-bench tok/s", "mt-bench ×naive-pp", "humaneval tok/s",
                      "humaneval ×naive-pp", "Mean tok/s", "Mean ×naive-pp"]
    assert _row(md, "flowspec") == ["flowspec", "8.00", "2.00×", "9.00", "1.50×", "8.50", "1.70×"]
    detail = _row(md, "flowspec", 1)
    assert detail == ["flowspec", "4.25×", "3.50", "2", "yes 2/2"]
    assert _row(md, "ar-pp", 1)[-1] == "–"
    assert "MISMATCH" not in md


def test_mismatch_is_flagged_loudly() -> None:
    runs = RUNS + [_run("pipedec", "mt-bench", "a", 7.0, match=False), _run("pipedec", "humaneval", "b", 7.0)]
    md = markdown_table({"config": {}, "runs": runs})  # no summary block: computed
    assert _row(md, "pipedec **MISMATCH**")[1] == "7.00"
    assert "**MISMATCH** 1/2" in md
    assert "> **MISMATCH: pipedec produced different tokens from ar-pp on 1 prompt(s): mt-bench:a." in md


def test_missing_baseline_cells_are_dashes_and_empty_runs() -> None:
    runs = [r for r in RUNS if r["strategy"] == "flowspec"]
    md = markdown_table({"runs": runs})
    assert _row(md, "flowspec") == ["flowspec", "8.00", "–", "9.00", "–", "8.50", "–"]
    assert markdown_table({"runs": []}) == "_no runs_\n"


def test_oracle_draft_rows_give_each_strategy_its_share_of_perfect_drafting() -> None:
    runs = [{"prompt_id": "1", "dataset": "d", "strategy": s, "tokens_per_s": t, "matches_ar": True}
            for s, t in (("ar-pp", 10.0), ("flowspec", 24.0), ("flowspec@oracle", 30.0))]
    summary = summarize(runs)
    assert summary["flowspec"]["of_oracle_draft"] == pytest.approx(0.8)
    assert "of_oracle_draft" not in summary["ar-pp"]
    assert "80%" in markdown_table({"config": {}, "runs": runs, "summary": summary})
