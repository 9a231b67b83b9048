"""`flowedge bench`: every strategy on the same prompts and the same (simulated) cluster, side by side.

Results are written after every run, so a long benchmark can be watched and survives an interrupt.
At temperature 0 every strategy's tokens are checked against plain greedy decoding (`ar`).
"""
from __future__ import annotations

import json
import logging
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable

from flowedge.core.config import SpecConfig
from flowedge.core.sampling import SamplingParams
from flowedge.datasets import Prompt
from flowedge.errors import ConfigError

log = logging.getLogger(__name__)

# A strategy named "<name>@oracle" runs <name> with the oracle draft: the reference answer as its top-1
# proposals at the real draft's cost (`bench --draft oracle`, sim/oracle_draft.py); T=0 only.
ORACLE_SUFFIX = "@oracle"


@dataclass(frozen=True)
class BenchConfig:
    model: str
    draft: str
    strategies: tuple[str, ...]
    max_new_tokens: int = 128
    temperature: float = 0.0
    seed: int = 0
    nodes: int = 5
    profile: str = "orin-nano-8gb"
    link: str | None = None
    path: str | None = None          # stages' compute path in the profile (None: its default)
    chat: bool = True
    verify: str = "stages"           # sim driver: "stages" (real stage math) or "oracle" (sim/oracle.py)
    tree_size: str = "profile"       # flowspec's initial tree: "profile" (costs/sizing.py) or "paper" (spec as given)
    spec: SpecConfig = field(default_factory=SpecConfig)


def record_run(results: dict, run: dict, out: Path) -> None:
    """Add one run, refresh the summary and rewrite results.json (a long bench can be watched)."""
    from flowedge.bench.report import summarize

    results["runs"].append(run)
    results["summary"] = summarize(results["runs"])
    (out / "results.json").write_text(json.dumps(results, indent=1))


def write_table(results: dict, out: Path) -> None:
    from flowedge.bench.report import markdown_table

    (out / "table.md").write_text(markdown_table(results))


def sim_cluster(cfg: BenchConfig):
    """The simulated cluster a bench runs on, built once: (cluster, tokenizer, base model dir, draft quant)."""
    from flowedge.engine.head_drafter import draft_source
    from flowedge.models.resolve import resolve_model
    from flowedge.text.prompts import load_tokenizer
    from flowedge.costs.pipeline import draft_quant_for
    from flowedge.sim.run import Cluster

    draft_quant = draft_quant_for(cfg.profile, cfg.path)
    base_dir, draft_dir = resolve_model(cfg.model), draft_source(cfg.draft, draft_quant)   # a model or a head
    cluster = Cluster(base_dir, draft_dir, cfg.nodes, cfg.spec, verify=cfg.verify,
                      size_from_costs=cfg.tree_size == "profile", draft_quant=draft_quant)
    return cluster, load_tokenizer(base_dir), base_dir, draft_quant


def run_bench(cfg: BenchConfig, prompts: list[Prompt], out: Path,
              say: Callable[[str], None] = lambda s: None) -> dict:
    from flowedge.bench.timeline import plot_timeline
    from flowedge.engine.local import generate_ar, stop_ids
    from flowedge.text.prompts import encode_prompt

    out.mkdir(parents=True, exist_ok=True)
    cluster, tok, base_dir, draft_quant = sim_cluster(cfg)
    reference_model = None
    config = {k: v for k, v in asdict(cfg).items() if k != "spec"} | {"spec": asdict(cfg.spec),
                                                                        "driver": "sim",
                                                                        "draft_quant": draft_quant}
    results: dict = {"config": config, "runs": [], "summary": {}}
    traces: dict = {}
    total = len(prompts) * len(cfg.strategies)
    for i, prompt in enumerate(prompts):
        ids = encode_prompt(tok, prompt.text, cfg.chat)
        params = SamplingParams(temperature=cfg.temperature, seed=cfg.seed + i)
        ref = None
        if cluster.oracle is not None:
            cluster.oracle.clear()
            if params.greedy:   # the reference's logits stay cached: every strategy reuses them
                ref = cluster.oracle.generate(ids, cfg.max_new_tokens, params, stop_ids(cluster.config))
        elif params.greedy:
            if reference_model is None:
                from flowedge.engine.local import load_reference

                reference_model = load_reference(base_dir)
            ref = generate_ar(base_dir, ids, cfg.max_new_tokens, params, model=reference_model).token_ids
        for j, name in enumerate(cfg.strategies):
            t0 = time.monotonic()
            res, head, _ = _generate(cluster, name, ids, ref, cfg, params)
            run = _sim_run(prompt, name, res, ref, time.monotonic() - t0)
            if i == 0:
                traces[name] = res.trace
            say(f"[{i * len(cfg.strategies) + j + 1}/{total}] {prompt.dataset}/{prompt.prompt_id} {name}: "
                f"{run['tokens_per_s']:.2f} tok/s (sim), accept {run['mean_accept_len']:.2f}, "
                f"restarts {run['restarts']}" + ("" if ref is None else
                                                 f", {'matches' if run['matches_ar'] else 'MISMATCH vs'} ar")
                + f" [{run['wall_s']:.0f} s wall]")
            record_run(results, run, out)
        if i == 0 and traces:
            plot_timeline(traces, out / "timeline.png",
                          title=f"{prompt.dataset}/{prompt.prompt_id} on {cfg.nodes}x {cfg.profile}")
    write_table(results, out)
    return results


def _sim_run(prompt: Prompt, name: str, res, ref: list[int] | None, wall_s: float) -> dict:
    """One simulated run's record (results.json): speed on the virtual clock, acceptance, overheads."""
    stats = res.done.stats
    run = {
        "prompt_id": prompt.prompt_id, "dataset": prompt.dataset, "strategy": name,
        "token_ids": res.done.token_ids,
        "tokens_per_s": len(res.done.token_ids) / res.sim_time_s,
        "sim_time_s": res.sim_time_s,
        "mean_accept_len": sum(stats.accept_lens) / max(1, len(stats.accept_lens)),
        "restarts": max(0, stats.rounds - 1),
        "steps": stats.steps,
        "draft_forwards": stats.draft_forwards,
        "head_overhead_ms": 1000 * sum(stats.overhead_s) / max(1, len(stats.overhead_s)),
        "tree_build_ms": 1000 * sum(stats.tree_build_s) / max(1, len(stats.tree_build_s)),
        "busy_fraction": res.trace.busy_fraction(),
        "matches_ar": (res.done.token_ids == ref) if ref is not None else None,
        "wall_s": wall_s,
    }
    if stats.auto:
        run["auto"] = stats.auto
    if stats.predraft:
        run["predraft"] = stats.predraft
    return run


def _generate(cluster, name: str, ids: list[int], ref: list[int] | None, cfg: BenchConfig, params):
    """One run; "<name>@oracle" swaps the cluster's draft for an `OracleDraft` following `ref`."""
    from flowedge.engine.head_drafter import is_head
    from flowedge.sim.oracle_draft import OracleDraft

    if not name.endswith(ORACLE_SUFFIX):
        return cluster.generate(name, ids, cfg.max_new_tokens, params, cfg.profile, cfg.link, path=cfg.path)
    if ref is None:
        raise ConfigError("the oracle draft needs the reference answer: temperature 0 only")
    if is_head(cluster.draft_model):
        raise ConfigError("the oracle draft stands in for a draft model; with a draft head run the plain strategies")
    real = cluster.draft_model
    cluster.draft_model = OracleDraft(real)
    cluster.draft_model.set_reference(ids, ref)
    try:
        return cluster.generate(name.removesuffix(ORACLE_SUFFIX), ids, cfg.max_new_tokens, params, cfg.profile,
                                cfg.link, path=cfg.path)
    finally:
        cluster.draft_model = real
