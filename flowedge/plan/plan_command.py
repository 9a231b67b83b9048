"""`flowedge plan`: the partition a cluster of named devices gets, each stage's memory, and the
simulator's predicted tokens/s per strategy."""
from __future__ import annotations

import json
import logging

import click

from flowedge.plan.memory import GiB, QUANT_BYTES_PER_PARAM
from flowedge.plan.shapes import list_shapes

log = logging.getLogger(__name__)
REAL_PAIR = ("qwen2.5-coder-1.5b", "qwen2.5-coder-0.5b")


@click.command("plan")
@click.option("--model", default="qwen2.5-coder-1.5b", show_default=True,
              help=f"Model shape ({', '.join(list_shapes())}) or a model directory.")
@click.option("--devices", required=True, help="Stage device profiles, comma-separated (one per stage).")
@click.option("--head-device", default=None, help="Node 0's device profile (default: the first stage's).")
@click.option("--free-gb", default=None, help="Free memory per stage in GB, comma-separated (default: the "
              "profile's memory less an OS reserve).")
@click.option("--quant", default="int4", show_default=True, type=click.Choice(sorted(QUANT_BYTES_PER_PARAM)))
@click.option("--context", default=4096, show_default=True, type=int, help="KV cache tokens per stage.")
@click.option("--strategy", default="flowspec", show_default=True, help="What the split is tuned for.")
@click.option("--path", "compute_path", default=None, help="Stages' kernel path (default: each profile's).")
@click.option("--link", default=None, help="Link profile (default: the first device's).")
@click.option("--keep-order", is_flag=True, help="Stages in the order given (default: best last stage).")
@click.option("--use-all", is_flag=True, help="Give every device layers, even one that slows the pipeline "
              "(default: such a device, or one that cannot hold a layer, is left out and listed as unused).")
@click.option("--simulate/--no-simulate", default=True, show_default=True,
              help="Predict tokens/s per strategy with the simulator (needs the real pair cached and the "
                   "node extra's torch; without them only the analytic ar-pp figure).")
@click.option("--strategies", default="ar-pp,naive-pp,pipedec,flowspec", show_default=True)
@click.option("--dataset", "datasets", multiple=True, default=("mt-bench",), show_default=True,
              help="Prompts for the simulated run (repeatable: `--samples` of each).")
@click.option("--samples", default=2, show_default=True, type=int)
@click.option("--max-new-tokens", default=64, show_default=True, type=int)
@click.option("--tokens-from", nargs=2, default=REAL_PAIR, show_default=True, metavar="BASE DRAFT",
              help="The model pair whose tokens and acceptance the simulated run uses (names or directories; "
                   "DRAFT may be a draft head).")
@click.option("--draft", default=REAL_PAIR[1], show_default=True,
              help="Node 0's draft: a model shape or directory, or a draft head (head:NAME or a head file), "
                   "priced as one layer and a reduced lm_head; a head also drafts the simulated run.")
@click.option("--json", "as_json", is_flag=True, help="One JSON object instead of the table.")
def plan(model, devices, head_device, free_gb, quant, context, strategy, compute_path, link, keep_order, use_all,
         simulate, strategies, datasets, samples, max_new_tokens, tokens_from, draft, as_json) -> None:
    """Plan a model over named devices: layer ranges, memory per stage, predicted tokens/s."""
    from flowedge.plan.planned_cluster import plan_cluster
    from flowedge.plan.predict import ar_pp_tokens_per_s

    names = [d.strip() for d in devices.split(",") if d.strip()]
    free = [int(float(x) * 1e9) for x in free_gb.split(",")] if free_gb else None
    cluster = plan_cluster(model, names, head_device=head_device, free_memory_bytes=free, quant=quant,
                           context=context, strategy=strategy, link=link, reorder=not keep_order,
                           path=compute_path, allow_idle=not use_all, draft=draft)
    if draft.startswith("head:") and tuple(tokens_from) == REAL_PAIR:
        tokens_from = (tokens_from[0], draft)
    report = _report(cluster, model, quant, context)
    report["predicted_tokens_per_s"] = {"ar-pp (analytic)": round(ar_pp_tokens_per_s(cluster), 3)}
    if simulate:
        report["predicted_tokens_per_s"].update(
            _simulated(cluster, [s.strip() for s in strategies.split(",") if s.strip()], datasets, samples,
                       max_new_tokens, tuple(tokens_from), report))
    click.echo(json.dumps(report, indent=2) if as_json else _table(report))


def _report(cluster, model: str, quant: str, context: int) -> dict:
    stages = [{"stage": k + 1, "device": s.device, "layers": [s.start, s.end], "count": s.layers,
               "weights_gib": round(s.memory.weights_bytes / GiB, 2), "kv_gib": round(s.memory.kv_bytes / GiB, 2),
               "runtime_gib": round(s.memory.overhead_bytes / GiB, 2),
               "total_gib": round(s.memory.total_bytes / GiB, 2), "usable_gib": round(s.usable_bytes / GiB, 2),
               "step_ms": round(1e3 * s.step_s, 2)} for k, s in enumerate(cluster.plan.stages)]
    head = cluster.head_memory
    return {"model": model, "layers": int(cluster.config.num_hidden_layers), "quant": quant, "context": context,
            "link": cluster.link.name, "step_tokens": cluster.plan.step_tokens, "stages": stages,
            "node0": {"device": cluster.head_device.name,
                      "total_gib": round(head.total_bytes / GiB, 2) if head else None},
            "unused": [{"device": u.device, "reason": u.reason} for u in cluster.plan.unused
                       if cluster.drafter is None or u.index != cluster.drafter.index],
            "drafter": None if cluster.drafter is None else {
                "device": cluster.drafter.device, "total_gib": round(cluster.drafter.memory.total_bytes / GiB, 2),
                "reason": f"spare ({cluster.drafter.why_spare}): holds the draft model and pre-drafts for node 0 "
                          "(`flowedge join --drafter`, predraft = \"drafter\")"},
            "bottleneck_ms": round(1e3 * cluster.plan.bottleneck_s, 2),
            "pipeline_latency_ms": round(1e3 * cluster.plan.latency_s, 2)}


def _simulated(cluster, strategies: list[str], datasets, samples: int, max_new_tokens: int,
               pair: tuple[str, str], report: dict) -> dict:
    from flowedge.models import registry

    if not all(registry.is_cached(registry.get_entry(n)) for n in pair if n in registry.MODELS):
        click.echo("note: the real pair is not cached (`flowedge models pull`), so only the analytic ar-pp "
                   "figure is given", err=True)
        return {}
    try:   # the simulator runs the real pair's models: a client install plans without it
        import torch  # noqa: F401
    except ModuleNotFoundError:
        click.echo("note: the simulated figures need torch (the `node` extra), which this install lacks, so only "
                   "the analytic ar-pp figure is given", err=True)
        return {}
    from flowedge.datasets import load_prompts
    from flowedge.engine.head_drafter import draft_source
    from flowedge.models.resolve import resolve_model
    from flowedge.plan.predict import simulate

    prompts = [p.text for d in datasets for p in load_prompts(d, samples)]
    results = simulate(cluster, resolve_model(pair[0]), draft_source(pair[1]), prompts, strategies,
                       max_new_tokens)
    report["identical_to_greedy"] = {name: r["identical_to_greedy"] for name, r in results.items()}
    return {name: round(r["tokens_per_s"], 3) for name, r in results.items()}


def _table(r: dict) -> str:
    lines = [f"{r['model']}: {r['layers']} layers, quant {r['quant']}, context {r['context']}, link {r['link']}, "
             f"steps of {r['step_tokens']} tokens",
             f"{'stage':<6}{'device':<16}{'layers':<12}{'weights':>9}{'KV':>7}{'runtime':>9}{'total':>8}"
             f"{'usable':>8}{'step ms':>9}"]
    for s in r["stages"]:
        rng = f"{s['layers'][0]}-{s['layers'][1]} ({s['count']})"
        lines.append(f"{s['stage']:<6}{s['device']:<16}{rng:<12}{s['weights_gib']:>9.2f}{s['kv_gib']:>7.2f}"
                     f"{s['runtime_gib']:>9.2f}{s['total_gib']:>8.2f}{s['usable_gib']:>8.2f}{s['step_ms']:>9.2f}")
    if r.get("drafter"):
        d = r["drafter"]
        lines.append(f"drafter {d['device']:<15}{d['total_gib']:.2f} GiB; {d['reason']}")
    lines += [f"unused {u['device']:<16}{u['reason']}" for u in r["unused"]]
    lines.append(f"node 0 {r['node0']['device']}: {r['node0']['total_gib']} GiB (embedding, lm_head, draft, KV, "
                 "runtime); memory in GiB")
    lines.append(f"bottleneck {r['bottleneck_ms']} ms/step, pipeline latency {r['pipeline_latency_ms']} ms")
    lines.append("predicted tokens/s: " + ", ".join(f"{k} {v}" for k, v in r["predicted_tokens_per_s"].items()))
    if "identical_to_greedy" in r:
        lines.append("identical to greedy: " + ", ".join(f"{k} {'yes' if v else 'NO'}"
                                                         for k, v in r["identical_to_greedy"].items()))
    return "\n".join(lines)
