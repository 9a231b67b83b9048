"""How many KV-cache tokens each stage can hold for all the requests it serves at once, and what one
request needs: the head admits a request only when it fits on every stage next to the running ones.

A stage's budget comes from what it reported when it joined (its Hello's free memory, taken before it
loaded anything) less its shard's weights, the runtime's own footprint and a safety margin, divided by
the bytes one token's K and V take over the stage's layers (in the dtype the stages compute in). The
`kv_budget_tokens` setting caps it (and is the whole budget where a stage reported no free memory).
What one request needs (its prompt, every token it may generate and the largest draft tree it can have
in flight on a stage) is `engine.jobs.kv_need`, the same for the simulator and the daemon.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from flowedge.engine.jobs import KvBudget
from flowedge.plan.memory import RUNTIME_OVERHEAD_BYTES, kv_bytes_per_token

MARGIN_FRACTION = 0.1   # of a stage's free memory, kept back: allocator slack, activations, other tenants


@dataclass(frozen=True, slots=True)
class StageMemory:
    """What the head knows about one stage's memory."""
    stage: int
    layers: int
    free_memory_bytes: int   # reported in its Hello; 0 = unknown
    weights_bytes: int       # its shard files


def stage_budget(base_config: Any, stage: StageMemory, dtype_bytes: int, cap_tokens: int = 0) -> KvBudget | None:
    """One stage's KV budget in tokens; None when neither its free memory nor a cap is known."""
    cap = KvBudget(cap_tokens, stage.stage, f"kv_budget_tokens = {cap_tokens}") if cap_tokens else None
    per_token = kv_bytes_per_token(base_config, stage.layers, dtype_bytes)
    if not stage.free_memory_bytes or per_token <= 0:
        return cap
    spare = stage.free_memory_bytes * (1 - MARGIN_FRACTION) - stage.weights_bytes - RUNTIME_OVERHEAD_BYTES
    tokens = max(0, int(spare // per_token))
    derived = KvBudget(tokens, stage.stage, (
        f"{stage.free_memory_bytes / 1e9:.2f} GB free when it joined, less {MARGIN_FRACTION:.0%}, "
        f"{stage.weights_bytes / 1e9:.2f} GB of weights and {RUNTIME_OVERHEAD_BYTES / 1e9:.2f} GB of runtime, "
        f"at {per_token / 1024:.1f} KiB per token over its {stage.layers} layers"))
    return derived if cap is None or derived.tokens < cap.tokens else cap


def tightest(base_config: Any, stages: list[StageMemory], dtype_bytes: int, cap_tokens: int = 0) -> KvBudget | None:
    """The smallest stage budget (every request holds KV on every stage); None: no limit known."""
    budgets = [b for s in stages if (b := stage_budget(base_config, s, dtype_bytes, cap_tokens)) is not None]
    return min(budgets, key=lambda b: b.tokens) if budgets else None


def with_budgets(rows: list[dict], budgets: dict[int, int]) -> list[dict]:
    """Status rows with each stage's KV budget in tokens (`kv_budget_tokens`) where the head knows it."""
    for row in rows:
        if row.get("role") == "stage" and row.get("stage") in budgets:
            row["kv_budget_tokens"] = budgets[row["stage"]]
    return rows
