"""`flowedge bench --concurrency 1,2,4,8`: many requests arriving together, served with dynamic batching.

Every prompt arrives at t=0; the head admits up to `c` of them at once (engine/scheduler.py) and the
stages batch what they hold. Concurrency 1 is today's behaviour: the same requests served one at a time.
Reported per strategy and concurrency: aggregate tokens/s (all tokens / time until the last request
finished), p50/p99 time between tokens (`RequestTiming.token_gaps_s`), mean time to first token, and the
requests per stage forward. At temperature 0 every request's tokens are checked against plain greedy
decoding, so batching can never buy speed with wrong tokens.
"""
from __future__ import annotations

import json
import logging
import time
from dataclasses import asdict
from pathlib import Path
from typing import Callable

from flowedge.bench.runner import BenchConfig, sim_cluster
from flowedge.core.sampling import SamplingParams
from flowedge.datasets import Prompt

log = logging.getLogger(__name__)


def percentile(values: list[float], q: float) -> float | None:
    """Nearest-rank percentile (q in [0, 100]); None for no values."""
    if not values:
        return None
    ordered = sorted(values)
    rank = max(0, min(len(ordered) - 1, round(q / 100.0 * len(ordered) + 0.5) - 1))
    return ordered[rank]


def _ms(seconds: float | None) -> float | None:
    return None if seconds is None else 1000 * seconds


def summarize_level(strategy: str, concurrency: int, res, multi, stages, refs: list[list[int]] | None) -> dict:
    """One row of the sweep from a `MultiResult`."""
    timings = [res.requests[i + 1] for i in range(len(res.requests))]
    tokens = sum(len(t.done.token_ids) for t in timings)
    gaps = [g for t in timings for g in t.token_gaps_s()]
    ttft = [t.emits[0][0] - t.arrival_s for t in timings if t.emits]
    forwards = sum(st.forwards for st in stages)
    drafts = multi.batcher.batch_sizes if multi.batcher is not None else []
    busy = res.trace.busy_fraction()
    return {
        "strategy": strategy, "concurrency": concurrency, "requests": len(timings), "tokens": tokens,
        "sim_time_s": res.sim_time_s, "tokens_per_s": tokens / res.sim_time_s,
        "p50_tbt_ms": _ms(percentile(gaps, 50)), "p99_tbt_ms": _ms(percentile(gaps, 99)),
        "mean_ttft_s": sum(ttft) / len(ttft),
        "mean_batch": sum(st.forward_requests for st in stages) / max(1, forwards),
        "mean_draft_batch": sum(drafts) / len(drafts) if drafts else None,
        "busy_fraction": {k: round(v, 3) for k, v in busy.items() if not k.startswith("link")},
        "matches_ar": None if refs is None else all(t.done.token_ids == r for t, r in zip(timings, refs)),
        "token_ids": [t.done.token_ids for t in timings],
        **_auto_summary([t.done.stats.auto for t in timings]),
    }


def _auto_summary(reports: list[dict]) -> dict:
    """Strategy `auto` under load: the tokens each strategy produced and the switches, over all requests."""
    reports = [r for r in reports if r]
    if not reports:
        return {}
    tokens: dict[str, int] = {}
    for r in reports:
        for name, n in r.get("tokens", {}).items():
            tokens[name] = tokens.get(name, 0) + n
    return {"auto_tokens": tokens, "auto_switches": sum(len(r.get("switches", [])) for r in reports),
            "auto": reports}   # each request's choice, reason and switches, in the order of the prompts


def run_concurrency(cfg: BenchConfig, prompts: list[Prompt], levels: tuple[int, ...], out: Path,
                    say: Callable[[str], None] = lambda s: None) -> dict:
    from flowedge.engine.local import generate_ar, stop_ids
    from flowedge.sim.cluster import BatchConfig
    from flowedge.text.prompts import encode_prompt
    from flowedge.sim.cluster import SimRequest

    out.mkdir(parents=True, exist_ok=True)
    cluster, tok, base_dir, draft_quant = sim_cluster(cfg)
    ids = [encode_prompt(tok, p.text, cfg.chat) for p in prompts]
    params = [SamplingParams(temperature=cfg.temperature, seed=cfg.seed + i) for i in range(len(prompts))]
    refs = None
    if cfg.temperature == 0:
        if cluster.oracle is not None:   # per-prompt path caches: every strategy and level reuses them
            refs = [cluster.prompt_oracle(p).generate(p, cfg.max_new_tokens, SamplingParams(), stop_ids(cluster.config))
                    for p in ids]
        else:
            refs = [generate_ar(base_dir, p, cfg.max_new_tokens, SamplingParams()).token_ids for p in ids]
    config = {k: v for k, v in asdict(cfg).items() if k != "spec"} | {
        "spec": asdict(cfg.spec), "driver": "sim", "draft_quant": draft_quant, "levels": list(levels),
        "prompts": [p.prompt_id for p in prompts]}
    results: dict = {"config": config, "rows": []}
    requests = [SimRequest(i + 1, tuple(p), cfg.max_new_tokens, params[i]) for i, p in enumerate(ids)]
    for name in cfg.strategies:
        for c in levels:
            t0 = time.monotonic()
            res, multi, stages = cluster.generate_many(name, requests, BatchConfig(max_concurrent=c), cfg.profile,
                                                       cfg.link, cfg.path)
            row = summarize_level(name, c, res, multi, stages, refs) | {"wall_s": time.monotonic() - t0}
            results["rows"].append(row)
            say(f"{name} x{c}: {row['tokens_per_s']:.2f} tok/s, p50 {row['p50_tbt_ms']:.0f} ms, "
                f"p99 {row['p99_tbt_ms']:.0f} ms between tokens, {row['mean_batch']:.2f} requests/forward"
                + ("" if refs is None else f", {'matches' if row['matches_ar'] else 'MISMATCH vs'} ar")
                + f" [{row['wall_s']:.0f} s wall]")
            (out / "results.json").write_text(json.dumps(results, indent=1))
    (out / "table.md").write_text(concurrency_table(results))
    plot_concurrency(results, out / "concurrency.png")
    return results


def concurrency_table(results: dict) -> str:
    cfg = results["config"]
    rows = results["rows"]
    one = {r["strategy"]: r["tokens_per_s"] for r in rows if r["concurrency"] == 1}
    ar = {r["concurrency"]: r["tokens_per_s"] for r in rows if r["strategy"] == "ar-pp"}
    lines = [f"Config: model={cfg['model']}, draft={cfg['draft']}, {len(cfg['prompts'])} prompts arriving together "
             f"({', '.join(cfg['prompts'])}), max_new_tokens={cfg['max_new_tokens']}, "
             f"temperature={cfg['temperature']}, "
             f"nodes={cfg['nodes']}, profile={cfg['profile']}, verify={cfg['verify']}, driver={cfg['driver']}",
             "",
             "\"matches\": the simulator compares every answer with plain greedy decoding; the zmq driver with the "
             "same prompt served one at a time (T=0).",
             "",
             "| Strategy | concurrent | tok/s (all requests) | × one at a time | × ar-pp (same concurrency) "
             "| p50 between tokens (ms) "
             "| p99 between tokens (ms) | mean first token (s) | requests per stage forward | requests per draft call "
             "| matches AR |",
             "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for r in rows:
        base = one.get(r["strategy"])
        ratio = f"{r['tokens_per_s'] / base:.2f}×" if base else "–"
        match = "–" if r["matches_ar"] is None else ("yes" if r["matches_ar"] else "**NO**")
        vs_ar = f"{r['tokens_per_s'] / ar[r['concurrency']]:.2f}×" if r["concurrency"] in ar else "–"
        lines.append(f"| {r['strategy']} | {r['concurrency']} | {r['tokens_per_s']:.2f} | {ratio} | {vs_ar} | "
                     f"{r['p50_tbt_ms']:.0f} | {r['p99_tbt_ms']:.0f} | {r['mean_ttft_s']:.2f} | "
                     f"{_num(r['mean_batch'])} | {_num(r['mean_draft_batch'])} | {match} |")
    return "\n".join(lines) + "\n"


def _num(value: float | None) -> str:
    return "–" if value is None else f"{value:.2f}"


def plot_concurrency(results: dict, path: Path) -> None:
    """Throughput (left) and time between tokens (right) against the number of concurrent requests."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(10, 4))
    FigureCanvasAgg(fig)
    tput, tbt = fig.add_subplot(1, 2, 1), fig.add_subplot(1, 2, 2)
    strategies = list(dict.fromkeys(r["strategy"] for r in results["rows"]))
    for name in strategies:
        rows = [r for r in results["rows"] if r["strategy"] == name]
        cs = [r["concurrency"] for r in rows]
        line = tput.plot(cs, [r["tokens_per_s"] for r in rows], marker="o", label=name)[0]
        tbt.plot(cs, [r["p50_tbt_ms"] for r in rows], marker="o", color=line.get_color(), label=f"{name} p50")
        tbt.plot(cs, [r["p99_tbt_ms"] for r in rows], marker="x", linestyle="--", color=line.get_color(),
                 label=f"{name} p99")
    for ax, ylabel in ((tput, "tokens/s, all requests"), (tbt, "time between tokens (ms)")):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("concurrent requests")
        ax.set_ylabel(ylabel)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    cfg = results["config"]
    fig.suptitle(f"{len(cfg['prompts'])} requests on {cfg['nodes']}x {cfg['profile']} (simulated)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
