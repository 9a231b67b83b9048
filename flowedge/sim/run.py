"""Build a simulated cluster for a model pair and a device profile, and run one request on it."""
from __future__ import annotations

import logging
from pathlib import Path
from typing import Callable

from flowedge.core.config import SpecConfig
from flowedge.costs.pipeline import CostModel, draft_quant_for, profile_costs
from flowedge.engine.assembly import build_head, check_strategy, result_stats, sized_spec
from flowedge.engine.draft_batch import DraftBatcher
from flowedge.engine.draft_sync import DrafterDevice
from flowedge.engine.engine_context import EngineContext
from flowedge.engine.head_drafter import draft_source, is_head, load_draft
from flowedge.engine.head import Head
from flowedge.engine.jobs import KvBudget
from flowedge.engine.local import GenerationResult, stop_ids
from flowedge.text.prompts import check_context
from flowedge.engine.scheduler import Scheduler
from flowedge.engine.stage_worker import StageLayers, StageWorker
from flowedge.engine.strategies import make_strategy
from flowedge.errors import ConfigError
from flowedge.models.stage import StageModel, StageParts, load_config
from flowedge.sim.cluster import BatchConfig, SimCluster, SimRequest, StageFault
from flowedge.sim.oracle import PathOracle, ShapeOnlyStage

log = logging.getLogger(__name__)


def balanced(num_layers: int, stages: int) -> list[tuple[int, int]]:
    """Half-open layer ranges of near-equal size, earlier stages taking the extra layers."""
    if not 1 <= stages <= num_layers:
        raise ConfigError(f"cannot split {num_layers} layers into {stages} stages")
    q, r = divmod(num_layers, stages)
    bounds, a = [], 0
    for i in range(stages):
        b = a + q + (1 if i < r else 0)
        bounds.append((a, b))
        a = b
    return bounds


VERIFY_MODES = ("stages", "oracle")


class Cluster:
    """Head + stage workers for one model pair, reusable across requests and strategies.

    verify="stages" runs every segment through real stage layers (the default: the stages' math is
    exercised); "oracle" skips the layer arithmetic and takes verification logits from a whole-model
    `PathOracle` along the accepted path (same tokens, same simulated time, ~10-50x less CPU).
    `quant`: the base model's weights as stored (None: a W4A16 checkpoint runs int4) or quantized at
    load (`generate --quant`), so the simulated stages run the model `ar` runs."""

    def __init__(self, base_dir: Path, draft_dir: Path | None, nodes: int, spec: SpecConfig,
                 verify: str = "stages", size_from_costs: bool = False, draft_quant: str = "none",
                 quant: str | None = None) -> None:
        if nodes < 2:
            raise ConfigError(f"a pipeline needs at least 2 nodes (head + 1 stage), got {nodes}")
        if verify not in VERIFY_MODES:
            raise ConfigError(f"unknown verify mode {verify!r}; choose from {', '.join(VERIFY_MODES)}")
        self.config = load_config(base_dir)
        self.ranges = balanced(self.config.num_hidden_layers, nodes - 1)
        self.oracle: PathOracle | None = None
        if verify == "oracle":
            self.oracle = PathOracle(StageModel.load(base_dir, quant=quant))
            self.head_model = self.oracle.model
            self.stage_models: list[StageLayers] = [ShapeOnlyStage(self.config, a, b) for a, b in self.ranges]
        else:
            self.head_model = StageModel.load(base_dir, StageParts(0, 0, embed=True, head=True), quant=quant)
            # The last stage also holds the final norm + lm_head, for strategies that choose tokens there.
            self.stage_models = [StageModel.load(base_dir, StageParts(a, b, head=k == len(self.ranges) - 1),
                                                 quant=quant)
                                 for k, (a, b) in enumerate(self.ranges)]
        self.draft_quant = draft_quant
        self.prompt_oracles: dict[tuple[int, ...], PathOracle] = {}
        self.draft_model = load_draft(draft_dir, base_dir, draft_quant) if draft_dir is not None else None
        self.spec = spec
        self.size_from_costs = size_from_costs   # flowspec's initial tree from the profile (costs/sizing.py)

    def build(self, strategy_name: str, costs: CostModel | None = None) -> tuple[Head, list[StageWorker]]:
        make_head, _ = self.head_factory(strategy_name, costs, own_oracle=False)
        n = len(self.stage_models)
        stages = [StageWorker(i + 1, m, n, can_choose=i == n - 1) for i, m in enumerate(self.stage_models)]
        return make_head(None), stages

    def head_factory(self, strategy_name: str, costs: CostModel | None = None, own_oracle: bool = True,
                     batcher: DraftBatcher | None = None) -> tuple[Callable, SpecConfig]:
        """A function making one request's Head (from the scheduler's `Request`): its own strategy, draft cache and
        (oracle mode) path cache, over the shared models. `own_oracle`: requests interleave, so one shared
        path cache would re-run each request's whole context on every switch; each prompt gets its own
        (`prompt_oracle`), which also keeps its logits across runs of the same prompt."""
        check_strategy(strategy_name, self.draft_model)
        tree = costs.tree if self.size_from_costs and costs is not None else None
        spec = sized_spec(self.spec, strategy_name, tree)
        n = len(self.stage_models)
        ratio = costs.lm_head_segment_ratio if costs else None
        stops = stop_ids(self.config)

        def make_head(req, context: EngineContext = EngineContext()) -> Head:
            oracle = self.prompt_oracle(req.job.prompt_ids) if own_oracle and self.oracle is not None else self.oracle
            return build_head(self.head_model, self.draft_model, strategy_name, n, spec, stops,
                              lm_head_ratio=ratio, oracle=oracle, batcher=batcher,
                              predict_costs=costs.tree if costs is not None else None, context=context)
        return make_head, spec

    def prompt_oracle(self, prompt_ids) -> PathOracle:
        """Oracle mode: the path cache for requests with this prompt (created on first use)."""
        if self.oracle is None:
            raise ConfigError("prompt oracles are for oracle verification (verify='oracle')")
        key = tuple(prompt_ids)
        if key not in self.prompt_oracles:
            self.prompt_oracles[key] = PathOracle(self.oracle.model)
        return self.prompt_oracles[key]

    def build_many(self, strategy_name: str, batch: BatchConfig, costs: CostModel | None = None
                   ) -> tuple[Scheduler, list[StageWorker], SpecConfig]:
        """Node 0's request scheduler (the daemon's) and fresh stage workers (per-request KV slots, batched
        forwards); the spec the heads run (a job's KV need follows from it)."""
        needs_draft = make_strategy(strategy_name).needs_draft
        own_draft = self.draft_model if self.draft_model is not None and not is_head(self.draft_model) else None
        batcher = DraftBatcher(own_draft) if needs_draft and own_draft is not None and batch.batch_drafts else None
        make_head, spec = self.head_factory(strategy_name, costs, batcher=batcher)
        n = len(self.stage_models)
        budget = None if batch.kv_budget_tokens is None else \
            KvBudget(batch.kv_budget_tokens, 0, f"kv_budget_tokens = {batch.kv_budget_tokens}")
        sched = Scheduler(make_head, batch.limits(), lambda: budget, batcher=batcher, contain_errors=False,
                          keep_ended_engines=True)
        return sched, [StageWorker(i + 1, m, n, can_choose=i == n - 1) for i, m in enumerate(self.stage_models)], spec

    def generate_many(self, strategy: str, requests: list[SimRequest], batch: BatchConfig,
                      device: str | None = None, link: str | None = None, path: str | None = None,
                      faults: tuple[StageFault, ...] = ()):
        """Several requests, arriving and possibly cancelled as `requests` say, through one pipeline; a
        stage may be lost and come back as `faults` say."""
        for r in requests:
            check_context(len(r.prompt_ids), r.max_new_tokens, self.config.max_position_embeddings)
        costs = self.costs(device, link, path)
        sched, stages, spec = self.build_many(strategy, batch, costs)
        return SimCluster(sched, stages, costs, faults, spec, self.drafter_device()).run_many(requests), sched, stages

    def drafter_device(self) -> DrafterDevice | None:
        """A drafter device's engine for `predraft = drafter` (fresh replicas per simulation)."""
        drafts = self.draft_model is not None and not is_head(self.draft_model)
        return DrafterDevice(self.draft_model) if drafts and self.spec.predraft == "drafter" else None

    def costs(self, device: str | None, link: str | None, path: str | None = None) -> CostModel:
        if device is None:
            return CostModel.free()
        draft_cfg = self.draft_model.config if self.draft_model is not None else None
        return profile_costs(self.config, draft_cfg, self.ranges, device, link, path,
                             draft_quantized=self.draft_quant != "none", l_max=self.spec.l_max,
                             topk=self.spec.topk)

    def generate(self, strategy: str, prompt_ids: list[int], max_new_tokens: int, params,
                 device: str | None = None, link: str | None = None, on_tokens=None, request_id: int = 1,
                 path: str | None = None):
        check_context(len(prompt_ids), max_new_tokens, self.config.max_position_embeddings)
        costs = self.costs(device, link, path)
        head, stages = self.build(strategy, costs)
        sim = SimCluster(head, stages, costs, drafter=self.drafter_device())
        return sim.run(request_id, prompt_ids, max_new_tokens, params, on_tokens), head, stages


def run_simulated(req, base_dir: Path, prompt_ids: list[int], stream) -> tuple[GenerationResult, dict]:
    spec = SpecConfig().with_(tree_nodes=req.tree_nodes, tree_depth=req.tree_depth, topk=req.tree_topk)
    draft_quant = draft_quant_for(req.profile)
    draft_dir = None if req.strategy == "ar-pp" else draft_source(req.draft, draft_quant)
    cluster = Cluster(base_dir, draft_dir, req.nodes, spec,
                      size_from_costs=req.tree_depth is None and req.tree_nodes is None,
                      draft_quant=draft_quant, quant=req.quant)
    res, head, _ = cluster.generate(req.strategy, prompt_ids, req.max_new_tokens, req.params,
                                    req.profile, req.link, stream)
    stats = res.done.stats
    out = GenerationResult(res.done.token_ids, res.sim_time_s, stats.accept_lens, stats.rounds,
                           stats.draft_forwards)
    busy = res.trace.busy_fraction()
    extra = result_stats(res.done, head, strategy=req.strategy, prompt_tokens=len(prompt_ids), nodes=req.nodes) | {
        "sim_tokens_per_s": round(len(out.token_ids) / res.sim_time_s, 3) if res.sim_time_s else None,
        "sim_time_s": round(res.sim_time_s, 4),
        "busy_fraction": {k: round(v, 3) for k, v in busy.items() if not k.startswith("link")},
        "profile": req.profile,
    }
    return out, extra
