"""What the request scheduler (engine/scheduler.py) schedules and what it says back: jobs and their state,
the limits it keeps, the KV footprint arithmetic, and its actions.

One copy for both drivers: the simulated cluster (virtual time) and the daemon's head (wall time) submit
`Job`s and carry out the actions; neither keeps a lifecycle of its own. Each request runs on its own
engine (`RequestEngine`: the `Head`, or a test's fake that subclasses it).
"""
from __future__ import annotations

import hashlib
import math
from collections import deque
from dataclasses import dataclass, field, replace
from enum import Enum
from typing import Any, Protocol

from flowedge.core.config import SpecConfig
from flowedge.core.sampling import SamplingParams
from flowedge.engine.events import Compute, Done, Offload, Send
from flowedge.errors import ClusterNotReady, ConfigError

REPLAY_ID_SHIFT = 32   # a replay's run id: key + (replay << 32), never another request's first id


class State(Enum):
    QUEUED = "queued"
    RUNNING = "running"
    PAUSED = "paused"
    DONE = "done"
    FAILED = "failed"
    CANCELLED = "cancelled"


@dataclass(frozen=True, slots=True)
class Job:
    """A request to run: its tokens, how many to generate, how to sample, and what it may hold.

    `kv_tokens`: KV entries it may hold on every stage (`kv_need`); `deadline_s`: while still queued, it
    fails past this time (None: it waits until its client cancels it). `client`: whose it is, for the
    fair queue (engine/fair_queue.py: one lane per client, `weight` starts per round)."""
    prompt_ids: tuple[int, ...]
    max_new_tokens: int
    params: SamplingParams = SamplingParams()
    strategy: str = ""
    kv_tokens: int = 0
    deadline_s: float | None = None
    client: str = ""
    weight: float = 1.0

    def __post_init__(self) -> None:
        if self.max_new_tokens < 1:
            raise ConfigError(f"max new tokens must be >= 1 (got {self.max_new_tokens})")
        if not (self.weight > 0 and math.isfinite(self.weight)):
            raise ConfigError(f"a client's weight must be > 0 (got {self.weight})")


class RequestEngine(Protocol):
    """One request's speculative decoding, sans I/O: events in, actions out (engine/events.py)."""

    def start(self, run_id: int, prompt_ids: list[int], max_new_tokens: int,
              params: SamplingParams, now: float | None = None) -> list[Any]:
        """Begin run `run_id` (a replay begins a new one) on `prompt_ids`: the first actions, usually prefill sends.
        `now`: the driver's time (virtual under simulation; None: wall time), here and in `receive`."""
        ...

    def receive(self, event: Any, now: float | None = None) -> list[Any]:
        """A pipeline segment back, or a follow-up the engine queued (`Continue`): the next actions."""
        ...


@dataclass
class Request:
    """A job as the scheduler holds it; `emitted` is every token handed out so far (kept across replays).
    `key` is the scheduler's request key (unique on this head); `run_id` the current engine run's."""
    key: int
    job: Job
    submitted_s: float
    state: State = State.QUEUED
    deadline_s: float | None = None   # paused: the recovery deadline for a lost stage's slot
    engine: RequestEngine | None = None   # set while it runs (`Scheduler._launch`), dropped once it ended
    run_id: int = 0                   # the engine run's id on the wire (a replay gets a new one)
    emitted: list[int] = field(default_factory=list)
    started_s: float = 0.0
    last_progress_s: float = 0.0
    replays: int = 0
    work: deque = field(default_factory=deque)   # (is_follow_up, item): the engine's next events
    idle: object = None               # the engine's work for when node 0 has nothing else (`WhenIdle`)
    kv_waited: bool = False           # has waited in the queue for KV (logged once)

    def next_run_id(self) -> int:
        """The first run keeps the key (what the stages and tests see); each replay a fresh id."""
        return self.key + (self.replays << REPLAY_ID_SHIFT)

    def live_engine(self) -> RequestEngine:
        """The engine of a request the scheduler runs: only a running request gets events."""
        if self.engine is None:
            raise RuntimeError(f"request {self.key} has no engine (not running)")
        return self.engine


@dataclass(frozen=True, slots=True)
class Limits:
    max_running: int = 1              # requests whose segments share the pipeline at once
    recovery_s: float = 30.0          # a paused request waits this long for a lost stage's slot to be filled
    stall_s: float = 60.0             # a running request with no pipeline output this long is replayed
    max_replays: int = 3
    max_queued_per_client: int = 0   # queued requests one client may have; past it `Busy` (0: no cap)

    def __post_init__(self) -> None:
        if self.max_running < 1:
            raise ConfigError(f"max-concurrent must be >= 1 (got {self.max_running})")
        if self.max_queued_per_client < 0:
            raise ConfigError(f"max_queued_per_client must be >= 0 (got {self.max_queued_per_client})")


@dataclass(frozen=True, slots=True)
class KvBudget:
    """The KV tokens every stage can hold for all requests; `why` says how it was worked out (for the error a
    client sees)."""
    tokens: int
    stage: int = 0
    why: str = ""


def tree_reserve(spec: SpecConfig) -> int:
    """Draft entries one request can hold on a stage at once: its initial tree plus the largest growth."""
    return spec.tree_nodes + max(spec.exp_nodes, spec.se_nodes, spec.pipedec_width)


def kv_need(spec: SpecConfig, prompt_tokens: int, max_new_tokens: int) -> int:
    """KV tokens one request can hold on a stage: its whole context plus a draft tree in flight."""
    return prompt_tokens + max_new_tokens + tree_reserve(spec)


def replay_params(params: SamplingParams, committed: int) -> SamplingParams:
    """Sampling params of a replay after `committed` output tokens: greedy stays greedy; sampling draws
    from a generator seeded from (seed, committed), so the tokens after the fault are fresh draws from the
    same conditional distribution (reusing the seed's stream would correlate them with those before)."""
    if params.greedy or params.seed is None or committed == 0:
        return params
    digest = hashlib.sha256(f"{params.seed}:{committed}".encode()).digest()
    return replace(params, seed=int.from_bytes(digest[:7], "big"))


def not_whole(lost_why: str, missing: str, recovery_s: float) -> str:
    """What a request that waited `recovery_s` for a whole cluster is told: the missing stage(s), the last
    loss, and the deadline (a `ClusterNotReady` for its client)."""
    why = lost_why or "a stage is missing"
    if missing:
        why = f"waiting for {missing}" + (f" ({lost_why})" if lost_why else "")
    return f"{ClusterNotReady.PREFIX}{why}, and no node took its place within {recovery_s:g} s"


# ---- actions ------------------------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class FromEngine:
    """An engine's own action for its request: a `Send` to the stages, a `Compute` to charge or an
    `Offload` for a drafter."""
    key: int
    action: Send | Compute | Offload


@dataclass(frozen=True, slots=True)
class Emitted:
    """Tokens newly accepted for the request's asker, in order."""
    key: int
    tokens: list[int]


@dataclass(frozen=True, slots=True)
class Finished:
    """The request completed; `done.token_ids` is its whole answer (replays included)."""
    key: int
    done: Done


@dataclass(frozen=True, slots=True)
class Failed:
    """The request ended without completing; `message` is what its asker is told. `rejected`: for what it
    asked (it can never fit), not for a fault of the cluster."""
    key: int
    message: str
    rejected: bool = False


@dataclass(frozen=True, slots=True)
class Cancelled:
    """The request was cancelled; `done` holds what it had produced (`cancelled=True`)."""
    key: int
    done: Done


@dataclass(frozen=True, slots=True)
class ResetStages:
    """Every stage drops engine run `run_id` and its KV cache (a cancel, a pause, an early stop)."""
    key: int
    run_id: int


Action = FromEngine | Emitted | Finished | Failed | Cancelled | ResetStages
