"""A planned cluster from names: model shape, stage devices, node 0's device. What `flowedge plan`, the
daemon's head and the benchmarks share."""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any

from flowedge.core.config import SpecConfig
from flowedge.costs.model import is_draft_head
from flowedge.costs.profiles import DeviceProfile, LinkProfile, load_device, load_link
from flowedge.plan.memory import GiB, MemoryNeed, drafter_need, head_need, usable_bytes
from flowedge.plan.partition import (IDLE_GAIN, PartitionPlan, PlanError, PlanInputs, StageDevice,
                                     plan_partition, stage_devices)
from flowedge.plan.shapes import load_shape

DRAFT_SHAPE = "qwen2.5-coder-0.5b"   # node 0's draft (the real pair's) unless told otherwise


def step_tokens_for(strategy: str, spec: SpecConfig = SpecConfig()) -> int:
    """Tokens one stage forward carries in the steady state: one for ar-pp, a full segment otherwise."""
    return 1 if strategy == "ar-pp" else spec.l_max


def objective_for(strategy: str) -> str:
    """ar-pp has one token in flight (speed = 1 / latency); the others keep the pipeline full."""
    return "latency" if strategy == "ar-pp" else "bottleneck"


@dataclass(frozen=True, slots=True)
class ClusterSpec:
    """A planned cluster as the simulator charges it."""

    config: Any                          # the planned model's shape
    plan: PartitionPlan
    devices: tuple[StageDevice, ...]     # in stage order (the plan's), the devices left out excluded
    head_device: DeviceProfile
    link: LinkProfile
    head_memory: MemoryNeed | None = None
    drafter: Drafter | None = None       # a spare device that holds the draft model for node 0


@dataclass(frozen=True, slots=True)
class Drafter:
    """A device the stages leave out that can hold the draft model: it pre-drafts for node 0 (predraft =
    "drafter", engine/predraft.py) instead of sitting idle."""

    device: str
    index: int                 # in the device order planned (`PartitionPlan.unused`)
    memory: MemoryNeed
    why_spare: str             # why the stages leave it out


def best_order_plan(inputs: PlanInputs, reorder: bool) -> tuple[PlanInputs, PartitionPlan]:
    """The plan for the given device order, or with `reorder` the best over which device kind is last:
    only the last stage differs from the others (it also runs the lm_head), so that choice is the order.
    With `inputs.allow_idle`, a plan leaving devices out wins only if it beats the best plan using every
    device (over all orders) by IDLE_GAIN, and its reasons quote that plan."""
    candidates = [inputs]
    if reorder and inputs.last_stage_head:
        seen = {inputs.devices[-1].profile.name}
        for k, dev in enumerate(inputs.devices[:-1]):
            if dev.profile.name not in seen:
                seen.add(dev.profile.name)
                rest = inputs.devices[:k] + inputs.devices[k + 1:]
                candidates.append(replace(inputs, devices=rest + (dev,)))
    every, error = _best([replace(c, allow_idle=False) for c in candidates], inputs.objective)
    if inputs.allow_idle:
        fewer, _ = _best(candidates, inputs.objective)
        if fewer is not None and fewer[1].unused and (
                every is None or fewer[1].objective_s(inputs.objective)
                < every[1].objective_s(inputs.objective) * (1 - IDLE_GAIN)):
            with_all = None if every is None else every[1].objective_s(inputs.objective)
            unused = tuple(replace(u, with_all_s=with_all) for u in fewer[1].unused)
            return fewer[0], replace(fewer[1], unused=unused)
    if every is None:
        raise error or PlanError("no plan")
    return every


def _best(candidates: list[PlanInputs], objective: str) -> tuple[tuple[PlanInputs, PartitionPlan] | None,
                                                                   PlanError | None]:
    best: tuple[PlanInputs, PartitionPlan] | None = None
    error: PlanError | None = None
    for cand in candidates:
        try:
            plan = plan_partition(cand)
        except PlanError as err:
            error = error or err
            continue
        if best is None or _rank(plan, objective) < _rank(best[1], objective):
            best = (cand, plan)
    return best, error


def _rank(plan: PartitionPlan, objective: str) -> tuple[float, float]:
    if objective == "latency":
        return plan.latency_s, plan.bottleneck_s
    return plan.bottleneck_s, plan.latency_s


def plan_cluster(model: str, devices: Sequence[str], *, head_device: str | None = None,
                 free_memory_bytes: Sequence[int | None] | None = None, quant: str = "int4",
                 context: int = 4096, strategy: str = "flowspec", link: str | None = None,
                 reorder: bool = True, path: str | None = None, draft: str | None = DRAFT_SHAPE,
                 draft_quant: str = "int4", head_free_bytes: int | None = None,
                 allow_idle: bool = True) -> ClusterSpec:
    """Plan `model` (a shipped shape name or a model directory) over stage `devices` (profile names);
    with `allow_idle` devices that would slow the pipeline (or cannot hold a layer) are left out."""
    config = load_shape(model)
    profiles = [load_device(d) for d in devices]
    head = load_device(head_device or devices[0])
    lnk = load_link(link or profiles[0].default_link)
    inputs = PlanInputs(config, stage_devices(profiles, free_memory_bytes, path, quant), quant=quant,
                        context=context, step_tokens=step_tokens_for(strategy), link=lnk,
                        objective=objective_for(strategy), allow_idle=allow_idle)
    inputs, plan = best_order_plan(inputs, reorder)
    idle = {u.index for u in plan.unused}
    draft_config = draft_shape(draft) if draft else None
    need = head_need(config, draft_config, draft_quant, context, head)
    room = usable_bytes(head, head_free_bytes)
    if need.total_bytes > room:
        raise PlanError(f"node 0 ({head.name}) needs {need.total_bytes / GiB:.2f} GiB (embedding + lm_head + "
                        f"draft + KV + runtime), has {room / GiB:.2f} GiB usable: "
                        f"{(need.total_bytes - room) / GiB:.2f} GiB missing")
    used = tuple(d for k, d in enumerate(inputs.devices) if k not in idle)
    # a drafter device replicates a draft model; a draft head drafts from features only node 0 has
    drafter = spare_drafter(plan, inputs, draft_config, draft_quant, context) \
        if draft_config is not None and not is_draft_head(draft_config) else None
    return ClusterSpec(config, plan, used, head, lnk, need, drafter)


def draft_shape(draft: str) -> Any:
    """Node 0's draft: a model shape (name or directory), or a draft head (`head:NAME` or a head file)."""
    from flowedge.models.draft_head_spec import is_head_spec, resolve_head

    if not is_head_spec(draft):
        return load_shape(draft)
    from flowedge.models.draft_head_io import read_config   # torch: only for a head (a light install plans models)

    return read_config(resolve_head(draft))


def spare_drafter(plan: PartitionPlan, inputs: PlanInputs, draft_config: Any, draft_quant: str,
                  context: int) -> Drafter | None:
    """The first device the stages leave out that can hold the draft model and its KV (one is enough: node
    0 keeps one job out per request)."""
    for u in plan.unused:
        dev = inputs.devices[u.index]
        need = drafter_need(draft_config, draft_quant, context, dev.profile)
        if need.total_bytes <= dev.usable_bytes:
            return Drafter(u.device, u.index, need, u.reason)
    return None
