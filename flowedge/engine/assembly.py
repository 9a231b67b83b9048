"""Engine assembly shared by both drivers: build a strategy's engine head, size its first tree, and
turn a finished request into the result stats both report.

The simulator (`sim/run.py`) and the ZeroMQ head (`node/head_node.py`) used to do each of these in
their own words; one function each keeps their answers and their stats comparable.
"""
from __future__ import annotations

import logging

from flowedge.core.config import SpecConfig
from flowedge.costs.pipeline import draft_path_for, path_for_quant
from flowedge.costs.profiles import load_device, load_named_device
from flowedge.costs.sizing import sized_spec_for, tree_costs
from flowedge.engine.auto_policy import predict_from_costs
from flowedge.engine.engine_context import EngineContext
from flowedge.engine.events import Done
from flowedge.engine.head import Head
from flowedge.errors import ConfigError

log = logging.getLogger(__name__)


def check_strategy(strategy_name: str, draft_model, predict_costs=None):
    """The strategy, or ConfigError when it needs a draft model and there is none (or it is unknown);
    `auto` starts its choice from `predict_costs` (TreeCosts: engine/auto_policy.predict_from_costs)."""
    from flowedge.engine.strategies import STRATEGIES, make_strategy
    from flowedge.engine.strategies.auto import Auto

    prediction = None
    if STRATEGIES.get(strategy_name) is Auto and predict_costs is not None:
        # auto starts from the profiles. A drafter board's hit rate (auto_policy.DrafterCosts) is not passed:
        # simulated with the graft, its answers add no node node 0 does not draft itself (docs/bench/predraft)
        prediction = predict_from_costs(predict_costs)
    strategy = make_strategy(strategy_name, prediction)
    if strategy.needs_draft and draft_model is None:
        raise ConfigError(f"strategy {strategy_name} needs a draft model; this head runs without one")
    return strategy


def sized_spec(spec: SpecConfig, strategy_name: str, tree_costs=None) -> SpecConfig:
    """`spec` sized from `tree_costs` (costs.sizing.TreeCosts): the prefill chunk for every strategy (the
    prompt's way through the pipeline does not depend on it), and the initial tree for strategies that
    size from costs (flowspec); unchanged without costs."""
    from flowedge.engine.strategies import make_strategy

    if tree_costs is None:
        return spec
    if tree_costs.prefill_chunk is not None:
        spec = spec.with_(prefill_chunk=tree_costs.prefill_chunk)
    if not getattr(make_strategy(strategy_name), "sizes_from_costs", False):
        return spec
    sized = sized_spec_for(spec, tree_costs)
    log.debug("%s's first tree sized from the device profiles: depth %d, %d nodes, draft calls %d wide "
              "(pipeline %.1f ms, draft call %.1f ms, stage segment x%.2f)", strategy_name, sized.tree_depth,
              sized.tree_nodes, sized.draft_width, 1e3 * tree_costs.pipeline_latency_s,
              1e3 * tree_costs.draft_call_s, tree_costs.stage_segment_ratio)
    return sized


def build_head(head_model, draft_model, strategy_name: str, n_stages: int, spec: SpecConfig,
               stop_ids: set[int], *, tree_costs=None, lm_head_ratio: float | None = None,
               oracle=None, batcher=None, predict_costs=None, context: EngineContext = EngineContext()) -> Head:
    """The engine head for one strategy (one request at a time; a fresh one per request under batching).

    `tree_costs`: where given, flowspec's initial tree is sized from it (`sized_spec`); `lm_head_ratio`:
    how a segment's lm_head scales on the last stage (None: the strategy's own placement choice holds);
    `batcher`: the draft batcher shared by concurrent requests (engine/draft_batch.py); `predict_costs`:
    the TreeCosts strategy `auto` starts its choice from (engine/auto_policy.predict_from_costs); `context`:
    what the engine reads of its driver (engine/engine_context.py)."""
    from flowedge.engine.head_drafter import make_drafter

    strategy = check_strategy(strategy_name, draft_model, predict_costs)
    spec = sized_spec(spec, strategy_name, tree_costs)
    drafter = make_drafter(draft_model, head_model, batcher) if strategy.needs_draft else None
    lm_head_at = spec.lm_head_for(strategy, lm_head_ratio)
    if drafter is not None and drafter.wants_features:
        spec, lm_head_at = head_draft_spec(spec, lm_head_at)
    return Head(head_model, drafter, strategy, n_stages, spec, stop_ids, oracle, lm_head_at=lm_head_at,
                predraft_call_s=predict_costs.draft_call_s if predict_costs is not None else None, context=context)


def head_draft_spec(spec: SpecConfig, lm_head_at: str) -> tuple[SpecConfig, str]:
    """What a draft head needs of the round: the base's final hidden states back on node 0 (so node 0
    chooses the tokens: an explicit `last-stage` is refused) and no pre-drafting (its rows are drafted
    from the verified tokens' features, which only come with the verification)."""
    if spec.lm_head_at == "last-stage":
        raise ConfigError("a draft head reads the base model's hidden states on node 0: lm_head_at must be "
                          "head or auto, not last-stage")
    if spec.predraft != "off":
        log.info("pre-drafting is off with a draft head (it drafts from verified features)")
        spec = spec.with_(predraft="off")
    return spec, "head"


def profile_tree_costs(base_config, draft_config, ranges, head_device: str, stage_devices: list[str],
                       spec: SpecConfig, draft_quantized: bool, quant: str = "int4"):
    """TreeCosts from node 0's device profile and the stages' (names as reported by the stages: only
    shipped profiles are looked up, never a path), each stage priced on the kernel path that runs `quant`
    weights there (fp32 stages on a CPU are not int4 ones); None where a device has no profile."""
    try:
        head_dev = load_device(head_device)
        stage_devs = [load_named_device(n) for n in stage_devices]
    except ConfigError:
        log.info("a device in %s has no profile: flowspec keeps the configured tree",
                 [head_device, *stage_devices])
        return None
    return tree_costs(base_config, draft_config, ranges, stage_devs, head_dev, draft_path=draft_path_for(head_dev),
                      stage_paths=[path_for_quant(d, quant) for d in stage_devs],
                      l_max=spec.l_max, topk=spec.topk, draft_quantized=draft_quantized)


def result_stats(done: Done, head: Head, *, strategy: str, prompt_tokens: int, nodes: int) -> dict:
    """The stats of a finished request, in the same words on every driver (each adds its clock's)."""
    st = done.stats
    stats = {
        "strategy": strategy, "prompt_tokens": prompt_tokens, "new_tokens": len(done.token_ids),
        "steps": st.steps, "rounds": st.rounds, "round_restarts": max(0, st.rounds - 1), "nodes": nodes,
        "head_overhead_ms_per_step": round(1000 * sum(st.overhead_s) / max(1, len(st.overhead_s)), 3),
        "lm_head_at": head.lm_head_at, "stage_chosen_tokens": st.stage_chosen,
        "tree_depth": head.config.tree_depth, "tree_nodes": head.config.tree_nodes,
    }
    if st.accept_lens:
        stats["mean_accept_len"] = round(sum(st.accept_lens) / len(st.accept_lens), 4)
        stats["verifications"] = len(st.accept_lens)
    if st.auto:   # strategy auto: what it chose and why
        stats["auto"] = st.auto
    if st.predraft:   # pre-drafting: jobs, lane calls, hits and misses (engine/predraft.py)
        stats["predraft"] = st.predraft
    return stats
