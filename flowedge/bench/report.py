"""Benchmark results as Markdown, in the shape of the FlowSpec paper's tables.

Input is the `results.json` object the bench writes: {"config", "runs", "summary"}. A strategy
whose output ever differed from plain autoregressive decoding is flagged loudly: speed is
meaningless if the method is not lossless.
"""
from __future__ import annotations

from collections.abc import Iterable, Sequence
from statistics import fmean
from typing import Any

NAIVE = "naive-pp"
AR = "ar-pp"
DASH = "–"
ORACLE = "@oracle"   # "<strategy>@oracle": the same strategy with the oracle draft (bench --draft oracle)


def summarize(runs: Sequence[dict[str, Any]]) -> dict[str, dict[str, float | None]]:
    """Mean tokens/s per strategy over all its runs; speedups are ratios of those means."""
    means = {s: fmean(r["tokens_per_s"] for r in group) for s, group in _by_strategy(runs).items()}
    out = {
        strategy: {
            "tokens_per_s": tps,
            "speedup_vs_naive_pp": _ratio(tps, means.get(NAIVE)),
            "speedup_vs_ar_pp": _ratio(tps, means.get(AR)),
        }
        for strategy, tps in means.items()
    }
    for strategy, row in out.items():   # bench --draft oracle: the share of perfect drafting reached
        if f"{strategy}{ORACLE}" in means:
            row["of_oracle_draft"] = _ratio(row["tokens_per_s"], means[f"{strategy}{ORACLE}"])
    return out


def markdown_table(results: dict[str, Any]) -> str:
    """Two tables (throughput per dataset; speedup vs AR, acceptance, restarts) plus notes."""
    runs: list[dict[str, Any]] = list(results.get("runs", []))
    if not runs:
        return "_no runs_\n"
    summary = results.get("summary") or summarize(runs)
    strategies = list(_by_strategy(runs))
    datasets = list(dict.fromkeys(r["dataset"] for r in runs))
    mismatched = _mismatches(runs)
    parts = [
        _config_line(results.get("config", {})),
        _throughput_table(runs, summary, strategies, datasets, mismatched),
        _detail_table(runs, summary, strategies, mismatched),
    ]
    parts.extend(_auto_notes(runs))
    parts.extend(_mismatch_notes(mismatched))
    return "\n".join(p for p in parts if p) + "\n"


def _throughput_table(
    runs: list[dict[str, Any]],
    summary: dict[str, Any],
    strategies: list[str],
    datasets: list[str],
    mismatched: dict[str, list[str]],
) -> str:
    by_cell: dict[tuple[str, str], list[float]] = {}
    for r in runs:
        by_cell.setdefault((r["strategy"], r["dataset"]), []).append(r["tokens_per_s"])
    cell = {key: fmean(values) for key, values in by_cell.items()}
    header = ["Strategy"]
    for name in [*datasets, "Mean"]:
        header += [f"{name} tok/s", f"{name} ×{NAIVE}"]
    rows = []
    for s in strategies:
        row = [_strategy_cell(s, mismatched)]
        for d in datasets:
            tps = cell.get((s, d))
            row += [_num(tps), _speedup(_ratio(tps, cell.get((NAIVE, d))))]
        mean = summary.get(s, {})
        row += [_num(mean.get("tokens_per_s")), _speedup(mean.get("speedup_vs_naive_pp"))]
        rows.append(row)
    return _table(header, rows, align_from=1)


def _detail_table(
    runs: list[dict[str, Any]],
    summary: dict[str, Any],
    strategies: list[str],
    mismatched: dict[str, list[str]],
) -> str:
    header = ["Strategy", f"×{AR}", "mean accepted length", "restarts", "matches AR"]
    oracle = any(s.endswith(ORACLE) for s in strategies)
    if oracle:
        header.append("of oracle-draft tok/s")
    groups = _by_strategy(runs)
    rows = []
    for s in strategies:
        group = groups[s]
        accept = [r["mean_accept_len"] for r in group if r.get("mean_accept_len") is not None]
        checked = [r for r in group if r.get("matches_ar") is not None]
        if s in mismatched:
            match = f"**MISMATCH** {len(mismatched[s])}/{len(checked)}"
        elif checked:
            match = f"yes {len(checked)}/{len(checked)}"
        else:
            match = DASH
        rows.append([
            _strategy_cell(s, mismatched),
            _speedup(summary.get(s, {}).get("speedup_vs_ar_pp")),
            _num(fmean(accept) if accept else None),
            str(sum(int(r.get("restarts", 0)) for r in group)),
            match,
        ] + ([_percent(summary.get(s, {}).get("of_oracle_draft"))] if oracle else []))
    return _table(header, rows, align_from=1)


def _percent(x: float | None) -> str:
    return DASH if x is None else f"{100 * x:.0f}%"


def _auto_notes(runs: list[dict[str, Any]]) -> list[str]:
    """What `auto` chose per answer (its first choice, and how many answers switched)."""
    autos = [r["auto"] for r in runs if r.get("auto")]
    if not autos:
        return []
    firsts: dict[str, int] = {}
    for a in autos:
        firsts[a["choice"]] = firsts.get(a["choice"], 0) + 1
    switched = sum(1 for a in autos if a.get("switches"))
    chosen = ", ".join(f"{k} on {v}" for k, v in firsts.items())
    return [f"auto started with {chosen} of {len(autos)} answers ({autos[0]['reason']}); "
            f"{switched} switched strategy mid-answer.\n"]


def _mismatch_notes(mismatched: dict[str, list[str]]) -> list[str]:
    notes = []
    for strategy, prompt_ids in mismatched.items():
        shown = ", ".join(prompt_ids[:8]) + (" …" if len(prompt_ids) > 8 else "")
        notes.append(
            f"> **MISMATCH: {strategy} produced different tokens from {AR} on "
            f"{len(prompt_ids)} prompt(s): {shown}. Its speed does not count: it is not lossless.**\n"
        )
    return notes


def _mismatches(runs: Iterable[dict[str, Any]]) -> dict[str, list[str]]:
    found: dict[str, list[str]] = {}
    for r in runs:
        if r.get("matches_ar") is False:
            found.setdefault(r["strategy"], []).append(f"{r['dataset']}:{r['prompt_id']}")
    return found


def _by_strategy(runs: Iterable[dict[str, Any]]) -> dict[str, list[dict[str, Any]]]:
    groups: dict[str, list[dict[str, Any]]] = {}
    for r in runs:
        groups.setdefault(r["strategy"], []).append(r)
    return groups


def _config_line(config: dict[str, Any]) -> str:
    scalars = [f"{k}={v}" for k, v in config.items() if isinstance(v, (str, int, float, bool))]
    return f"Config: {', '.join(scalars)}\n" if scalars else ""


def _table(header: list[str], rows: list[list[str]], align_from: int) -> str:
    aligns = ["---" if i < align_from else "---:" for i in range(len(header))]
    lines = ["| " + " | ".join(header) + " |", "| " + " | ".join(aligns) + " |"]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    return "\n".join(lines) + "\n"


def _strategy_cell(strategy: str, mismatched: dict[str, list[str]]) -> str:
    return f"{strategy} **MISMATCH**" if strategy in mismatched else strategy


def _ratio(num: float | None, den: float | None) -> float | None:
    if num is None or not den:
        return None
    return num / den


def _num(value: float | None) -> str:
    return DASH if value is None else f"{value:.2f}"


def _speedup(value: float | None) -> str:
    return DASH if value is None else f"{value:.2f}×"
