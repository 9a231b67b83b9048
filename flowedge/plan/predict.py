"""Predicted tokens/s of a planned cluster: the simulator run with the plan's per-stage devices and the
planned model's shape, tokens taken from the real pair.

The planned model (say LLaMA-2-70B) has no weights here, so its stages are shape-only: every Compute is
charged by the roofline cost model for the planned model's layers on the stage's own device, and every
hidden-state message by the planned model's hidden size; which tokens are drafted, accepted and sent
comes from running the real pair (Qwen2.5-Coder 1.5B + 0.5B draft) under oracle verification. So the
acceptance is the real pair's, the costs are the planned cluster's. Node 0 charges the real draft model
on its own device. The analytic `ar_pp_tokens_per_s` needs no model at all: one token crosses every stage.
"""
from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from flowedge.core.config import SpecConfig
from flowedge.costs.model import (draft_time_s, forward_time_s, lm_head_segment_ratio, lm_head_time_s,
                                  shape_of_layers, transfer_time_s)
from flowedge.costs.pipeline import CostModel, draft_path_for
from flowedge.costs.sizing import SIZING_CONTEXT, tree_costs
from flowedge.errors import ConfigError
from flowedge.plan.planned_cluster import ClusterSpec
from flowedge.plan.partition import HIDDEN_WIRE_BYTES

log = logging.getLogger(__name__)

DEFAULT_STRATEGIES = ("ar-pp", "naive-pp", "pipedec", "flowspec")


def ar_pp_tokens_per_s(cluster: ClusterSpec, context: int = SIZING_CONTEXT) -> float:
    """Plain pipelined decoding: each token runs through every stage in turn, then the lm_head."""
    cfg, hidden_bytes = cluster.config, int(cluster.config.hidden_size) * HIDDEN_WIRE_BYTES
    t = sum(forward_time_s(d.profile, shape_of_layers(cfg, a, b), 1, context, d.path)
            for d, (a, b) in zip(cluster.devices, cluster.plan.ranges))
    t += len(cluster.devices) * transfer_time_s(cluster.link, hidden_bytes) + transfer_time_s(cluster.link, 64)
    last = cluster.devices[-1]
    return 1.0 / (t + lm_head_time_s(last.profile, cfg, 1, last.path))


def _stage_path(cluster: ClusterSpec) -> str | None:
    """The stages' kernel path where node 0 is the same kind of device (it then drafts on the same kernels:
    costs/pipeline.draft_path_for); None for another kind, whose draft runs on its own draft path, as the
    live head prices it (an x86 head beside Orin stages drafts on cpu-native, not on a torch-int4 estimate)."""
    first = cluster.devices[0]
    same_kind = first.profile.name == cluster.head_device.name
    return first.path if same_kind and first.path and cluster.head_device.has_path(first.path) else None


def cost_model(cluster: ClusterSpec, draft_config: Any, *, draft_quantized: bool, hidden_scale: float = 1.0,
               spec: SpecConfig = SpecConfig()) -> CostModel:
    """Charges for the planned cluster; `hidden_scale`: planned / simulated hidden size (message bytes)."""
    cfg, devs = cluster.config, cluster.devices
    shapes = [shape_of_layers(cfg, a, b) for a, b in cluster.plan.ranges]
    head = cluster.head_device
    draft_path = draft_path_for(head, _stage_path(cluster))

    def compute_s(node: int, c) -> float:
        if c.what == "lm_head":   # node 0, or the last stage when it chooses tokens
            dev = head if node == 0 else devs[node - 1].profile
            return lm_head_time_s(dev, cfg, c.tokens, None if node == 0 else devs[node - 1].path)
        if node == 0:
            return draft_time_s(head, draft_config, c.tokens, c.context, draft_path, draft_quantized) \
                if c.what == "draft" else 0.0
        return forward_time_s(devs[node - 1].profile, shapes[node - 1], c.tokens, c.context, devs[node - 1].path,
                              c.attended)

    costs = CostModel(compute_s, lambda a, b, n: transfer_time_s(cluster.link, int(n * hidden_scale)))
    last = devs[-1]
    costs.lm_head_segment_ratio = lm_head_segment_ratio(last.profile, cfg, spec.l_max, last.path)
    costs.tree = tree_costs(cfg, draft_config, cluster.plan.ranges, [d.profile for d in devs], head,
                            stage_paths=[d.path for d in devs], draft_path=draft_path,
                            draft_quantized=draft_quantized, l_max=spec.l_max, topk=spec.topk)
    return costs


@dataclass
class _Totals:
    """One strategy's sums over the prompts."""
    tokens: int = 0
    seconds: float = 0.0
    accepts: list[int] = field(default_factory=list)
    same: bool = True   # every answer equal to greedy decoding

    def summary(self) -> dict:
        return {"tokens_per_s": self.tokens / self.seconds if self.seconds else 0.0,
                "mean_accept_len": sum(self.accepts) / len(self.accepts) if self.accepts else None,
                "identical_to_greedy": self.same}


def simulate(cluster: ClusterSpec, base_dir: Path, draft_dir: Path, prompts: Sequence[str],
             strategies: Sequence[str] = DEFAULT_STRATEGIES, max_new_tokens: int = 64) -> dict[str, dict]:
    """{strategy: {tokens_per_s, mean_accept_len, identical_to_greedy}} over `prompts`, on the real pair's
    tokens (oracle); identical_to_greedy: every answer equals plain greedy decoding of the real base."""
    from flowedge.core.sampling import SamplingParams
    from flowedge.costs.pipeline import draft_quant_for
    from flowedge.engine.local import stop_ids
    from flowedge.text.prompts import encode_prompt, load_tokenizer
    from flowedge.sim.cluster import SimCluster
    from flowedge.sim.run import Cluster

    spec = SpecConfig()
    draft_quant = draft_quant_for(cluster.head_device.name, _stage_path(cluster))
    sim = Cluster(base_dir, draft_dir, len(cluster.devices) + 1, spec, verify="oracle", size_from_costs=True,
                  draft_quant=draft_quant)
    if sim.oracle is None or sim.draft_model is None:
        raise ConfigError("a prediction runs the real pair: a draft model, under oracle verification")
    tok = load_tokenizer(base_dir)
    ids = [encode_prompt(tok, p, chat=True) for p in prompts]
    costs = cost_model(cluster, sim.draft_model.config, draft_quantized=draft_quant != "none",
                       hidden_scale=int(cluster.config.hidden_size) / int(sim.config.hidden_size), spec=spec)
    totals = {s: _Totals() for s in strategies}
    for i, prompt_ids in enumerate(ids):
        # greedy through the oracle first: its logits stay cached for every strategy (prompt-major)
        ref = sim.oracle.generate(prompt_ids, max_new_tokens, SamplingParams(), stop_ids(sim.config))
        for strategy in strategies:
            head, stages = sim.build(strategy, costs)
            res = SimCluster(head, stages, costs).run(i + 1, prompt_ids, max_new_tokens, SamplingParams())
            sums = totals[strategy]
            sums.tokens += len(res.done.token_ids)
            sums.seconds += res.sim_time_s
            sums.accepts += list(res.done.stats.accept_lens)
            sums.same &= res.done.token_ids == ref
            log.info("prompt %d %s: %.3f tok/s, %d rounds%s", i + 1, strategy,
                     len(res.done.token_ids) / res.sim_time_s, res.done.stats.rounds,
                     "" if res.done.token_ids == ref else ", DIFFERS from greedy")
        sim.oracle.clear()
    out = {strategy: sums.summary() for strategy, sums in totals.items()}
    for strategy, row in out.items():
        log.info("simulated %s: %.2f tok/s", strategy, row["tokens_per_s"])
    return out
