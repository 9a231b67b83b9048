"""The engine side of the head's requests: what `head_requests.HeadRequests` computes with.

Preparing a prompt (token ids, sampling params, the context check), its KV need and the stages' KV
budget, building one request's engine head the way the simulator builds it (`engine.assembly`), the
answer's stats, and turning a segment back from the pipeline into its engine's event (node/run_router.py
checked it on arrival). No sockets here: the head node (`head_node.py`) owns them and is the lifecycle's
way out (`requests.OutPort`).
"""
from __future__ import annotations

import logging
import time
from dataclasses import replace
from functools import partial
from typing import TYPE_CHECKING, Callable

from flowedge.core.config import SpecConfig
from flowedge.core.sampling import SamplingParams
from flowedge.engine import assembly
from flowedge.engine.draft_batch import DraftBatcher
from flowedge.engine.engine_context import EngineContext
from flowedge.engine.events import Done
from flowedge.engine.head import Head
from flowedge.engine.jobs import kv_need
from flowedge.engine.scheduler import Handlers, run_in_turn
from flowedge.errors import ConfigError, ProtocolError
from flowedge.models.draft_head import DraftHead
from flowedge.node import kv_budget, wire
from flowedge.node.droplog import DropLog
from flowedge.node.head_requests import ClientRequest, Prepared
from flowedge.node.kv_budget import StageMemory
from flowedge.node.membership import Membership
from flowedge.node.node_config import NodeConfig
from flowedge.text.prompts import check_vocab, prompt_ids
from flowedge.transport import protocol as proto
from flowedge.transport.validate import ReturnPlan

if TYPE_CHECKING:
    from flowedge.node.partition_plan import Plan

log = logging.getLogger(__name__)


class HeadEngines:
    """Engines for the plan in force; the plan (and with it the draft batcher) changes on a re-plan."""

    def __init__(self, config: NodeConfig, members: Membership, drops: DropLog) -> None:
        self.config, self.members, self.drops = config, members, drops
        self.plan: Plan | None = None
        # (strategy, placement ratio, stage devices) -> a function building one request's engine head
        self.builders: dict[tuple, Callable[..., Head]] = {}
        self.batcher: DraftBatcher | None = None   # node 0's draft calls shared across running requests

    @property
    def in_force(self) -> Plan:
        """The plan in force: requests reach the engines only after `use_plan`."""
        assert self.plan is not None, "the engines are used before a plan is in force"
        return self.plan

    def use_plan(self, plan: Plan) -> Handlers:
        """Take a (new) plan; returns how one step's handlers run: side by side through a draft batcher
        (their draft calls share forwards, engine/draft_batch.py), or in turn without a draft model."""
        self.plan, self.builders = plan, {}
        # a draft head's calls run alone (one small layer each: engine/head_drafter.py)
        draft = plan.draft_model
        self.batcher = None if draft is None or isinstance(draft, DraftHead) else DraftBatcher(draft)
        return self.batcher.run_step if self.batcher is not None else run_in_turn

    def prepare(self, msg: proto.PromptRequest) -> Prepared:
        from flowedge.text.prompts import check_context

        params = SamplingParams(msg.temperature, msg.top_k or 0, msg.top_p if msg.top_p is not None else 1.0, msg.seed)
        ids = prompt_ids(self.in_force.tokenizer, msg)
        check_vocab(ids, self._vocab_size())
        check_context(len(ids), msg.max_new_tokens, self.in_force.base_config.max_position_embeddings)
        return Prepared(ids, params, msg.strategy or self.config.strategy)

    def _vocab_size(self) -> int:
        """Token ids both models can embed (the draft's table may be smaller than the base's)."""
        plan = self.in_force
        sizes = [plan.base_config.vocab_size]
        if plan.draft_model is not None:
            sizes.append(plan.draft_model.config.vocab_size)
        return min(sizes)

    def kv_need(self, prepared: Prepared, max_new_tokens: int) -> int:
        return kv_need(self._spec(), len(prepared.prompt_ids), max_new_tokens)

    def kv_budget(self) -> kv_budget.KvBudget | None:
        """The tightest stage's KV budget, from the stages that joined (node/kv_budget.py)."""
        plan = self.in_force
        return kv_budget.tightest(plan.base_config, self._stage_memory(), plan.head_model.dtype.itemsize,
                                  self.config.kv_budget_tokens)

    def kv_budgets(self) -> dict[int, int]:
        """Each joined stage's own KV budget in tokens, by stage (status: each stage's KV use against it)."""
        if self.plan is None:
            return {}
        plan, cap = self.plan, self.config.kv_budget_tokens
        budgets = {s.stage: kv_budget.stage_budget(plan.base_config, s, plan.head_model.dtype.itemsize, cap)
                   for s in self._stage_memory()}
        return {k: b.tokens for k, b in budgets.items() if b is not None}

    def _stage_memory(self) -> list[StageMemory]:
        plan, m = self.in_force, self.members
        return [StageMemory(k, b - a, m.peers[i].hello.free_memory_bytes, plan.shards[k - 1].size)
                for k, ((a, b), i) in enumerate(zip(plan.ranges, m.slots), 1) if i is not None]

    def _spec(self) -> SpecConfig:
        cfg = self.config
        return SpecConfig().with_(tree_nodes=cfg.tree_nodes or None, lm_head_at=cfg.lm_head_at,
                                  lookup_tokens=cfg.lookup_tokens, predraft=cfg.predraft)

    def text_stream(self, sink):
        from flowedge.text.streams import TextStream

        return TextStream(self.in_force.tokenizer, sink)

    def engine(self, strategy: str, context: EngineContext) -> Head:
        """A fresh engine head for one request: up to `max_concurrent` run at once, each with its own tree,
        draft cache and sampling state (their segments interleave and the stages batch them). Sizing and
        placement are worked out once per strategy and set of stage devices. `context`: the scheduler's
        load; a drafter device is present while the membership has one (pre-draft jobs)."""
        ratio = self._last_stage_lm_head_ratio() if self.config.lm_head_at == "auto" else None
        devices = self.members.stage_devices()
        ring_s = link_ring_s(self.members)
        key = (strategy, ratio, devices, ring_s)
        if key not in self.builders:
            from flowedge.engine.local import stop_ids

            plan, cfg = self.in_force, self.config
            spec = self._spec()
            costs = None
            if plan.draft_model is not None:
                costs = assembly.profile_tree_costs(plan.base_config, plan.draft_model.config, plan.ranges,
                                                    cfg.device, list(devices), spec, cfg.draft_quant != "none",
                                                    quant=cfg.quant)
                costs = costs.over_links(ring_s) if costs is not None else None
            sizing = cfg.tree_size == "profile" and not cfg.tree_nodes
            self.builders[key] = partial(assembly.build_head, plan.head_model, plan.draft_model, strategy,
                                        cfg.stages, spec, stop_ids(plan.base_config),
                                        tree_costs=costs if sizing else None, lm_head_ratio=ratio,
                                        predict_costs=costs, batcher=self.batcher)
        return self.builders[key](context=replace(context, drafters_present=self._drafters_present))

    def _drafters_present(self) -> bool:
        return bool(self.members.drafters())

    def _last_stage_lm_head_ratio(self) -> float | None:
        """For `lm_head_at = "auto"`: how a segment's lm_head scales on the last stage's device profile
        (named in its Hello); None when the profile is unknown (the strategy's own choice then holds)."""
        from flowedge.costs.model import lm_head_segment_ratio
        from flowedge.costs.profiles import load_named_device

        identity = self.members.stage_identity(self.config.stages)
        if identity is None:
            return None
        device = self.members.peers[identity].hello.device
        try:
            return lm_head_segment_ratio(load_named_device(device), self.in_force.base_config, SpecConfig().l_max)
        except ConfigError:
            log.info("last stage's device %r has no profile: lm_head placement follows the strategy", device)
            return None

    def finish_stats(self, req: ClientRequest, done: Done) -> dict:
        wall = time.monotonic() - req.started_s
        n = len(req.emitted)
        assert isinstance(req.engine, Head), "the head's requests run on the Heads `engine` builds"
        stats = assembly.result_stats(done, req.engine, strategy=req.prepared.strategy,
                                      prompt_tokens=len(req.prepared.prompt_ids), nodes=self.config.stages + 1)
        return stats | {"new_tokens": n, "wall_s": round(wall, 4), "wire_dtype": self.config.wire_dtype,
                        "tokens_per_s": round(n / wall, 3) if wall > 0 else None, "replays": req.replays}

    def return_plan(self) -> ReturnPlan:
        """What the plan in force accepts back from the last stage (the run router checks against it)."""
        cfg = self.in_force.base_config
        return ReturnPlan(cfg.hidden_size, cfg.vocab_size)

    def accept(self, msg: proto.Segment):
        """A routed segment (checked on arrival: node/run_router.py) as its engine's event, in the compute
        dtype; None: dropped and counted."""
        try:
            return wire.segment_from_wire(msg, self.in_force.head_model.dtype)
        except ProtocolError as err:
            self.drops.drop("malformed", f"pipeline return: {err}")
        return None


RING_STEP_S = 0.005   # the measured ring is rounded to this: a new one rebuilds the heads' sizing and prediction


def link_ring_s(members) -> float:
    """One trip's link time around the pipeline from the round trips the head measures to its stages
    (node/link_rtt.py), rounded so that heartbeat noise does not rebuild the engines' sizing each request."""
    from flowedge.costs.link_costs import ring_s_from_rtts

    rtts = [members.peers[i].rtt.median_ms() for i in members.stage_identities() if i in members.peers]
    return round(ring_s_from_rtts(rtts, len(rtts)) / RING_STEP_S) * RING_STEP_S
