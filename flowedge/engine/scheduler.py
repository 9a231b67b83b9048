"""The request scheduler on node 0, sans-IO: one copy that the simulated cluster and the daemon's head
both drive (events in, actions out, time passed in: virtual on the simulator, wall on the daemon).

Lifecycle: queued -> running -> done | failed | cancelled, with a pause (`paused`) while a stage is lost.
- **Admission.** Up to `max_running` requests run at once, each with its own engine (`Head`); their
  segments interleave in the pipeline and the stages batch them. A request starts only when its worst-case
  KV (`Job.kv_tokens`: prompt + new tokens + a draft tree) fits on every stage next to what the running ones
  reserve; the queue is one capped FIFO lane per client, shared fairly (`FairQueue`), the one due next
  waits for KV (nothing overtakes it), and a request that could never fit fails at once.
- **Steps.** Pipeline segments and each engine's follow-ups (`Continue`) queue on their request; a `step`
  runs one piece per running request side by side (`run_handlers`: the `DraftBatcher` packs draft calls).
- **Stage loss.** Running requests pause; once the cluster is whole each is *replayed* on the prompt plus
  every token handed out, under a new run id and a generator seeded from (seed, tokens committed).
- **Deadlines.** A paused request, or one that arrived while the cluster was not whole, fails past
  `recovery_s` (told which stage is missing); one queued before the loss keeps its place, under its own
  `Job.deadline_s` (None: until its asker cancels it); a running one silent for `stall_s` is replayed.
"""
from __future__ import annotations

import logging
from collections.abc import Callable
from functools import partial

from flowedge.engine.engine_context import EngineContext
from flowedge.engine.events import Compute, Continue, Done, Emit, Offload, Send, Stats, WhenIdle
from flowedge.engine.fair_queue import FairQueue
from flowedge.engine.jobs import (Action, Cancelled, Emitted, Failed, Finished, FromEngine, Job, KvBudget,
                                  Limits, Request, RequestEngine, ResetStages, State, not_whole, replay_params)
from flowedge.errors import ConfigError, FlowedgeError

log = logging.getLogger(__name__)

ENDED_REMEMBERED = 256   # finished requests kept for inspection (tests, reports)

Handlers = Callable[[list[Callable[[], list]]], list]


def run_in_turn(handlers: list[Callable[[], list]]) -> list:
    """`run_handlers` without a draft batcher: one after another."""
    return [h() for h in handlers]


class Scheduler:
    """`make_engine(request, context)` builds a request's engine (a `Head`) that reads the scheduler's load
    through `context` (engine/engine_context.py; the time goes with each call); `accept(item)` turns
    what came back from the pipeline into its event (None: dropped; the daemon decodes wire segments there);
    `kv_budget()` is the tightest stage's budget now (None: no limit known). `batcher`: node 0's
    `DraftBatcher`, whose `run_step` runs a step's handlers side by side (`run_handlers` overrides it).
    `contain_errors`: an engine error fails its request only (the daemon) instead of propagating (the
    simulator, tests)."""

    def __init__(self, make_engine: Callable[[Request, EngineContext], RequestEngine], limits: Limits = Limits(),
                 kv_budget: Callable[[], KvBudget | None] = lambda: None,
                 accept: Callable[..., object] = lambda item: item,
                 batcher=None, run_handlers: Handlers | None = None, contain_errors: bool = True,
                 keep_ended_engines: bool = False) -> None:
        """`keep_ended_engines`: the simulator inspects the engines of ended requests (its reports and
        tests); a daemon drops them (`_release_ended`)."""
        self.make_engine, self.limits, self.kv_budget, self.accept = make_engine, limits, kv_budget, accept
        self.keep_ended_engines, self.batcher = keep_ended_engines, batcher
        self.run_handlers = run_handlers or (batcher.run_step if batcher is not None else run_in_turn)
        self.contain_errors = contain_errors
        self.queue = FairQueue(lambda: self.running.values())   # the running and paused hold slots
        self.running: dict[int, Request] = {}     # key -> running or paused request
        self.by_run: dict[int, Request] = {}      # run id -> running request
        self.ended: dict[int, Request] = {}       # recently ended (bounded)
        self.releasing: list[Request] = []        # ended since the last call: their engines still held
        self.now_s = 0.0                          # the latest time passed in: the engines' clock
        self.context = EngineContext(running_requests=self.running_count)   # time goes with each call
        self.ever_ready = False
        self.lost_why = ""

    @classmethod
    def single(cls, engine) -> "Scheduler":
        """One request at a time through an existing engine (the single-request drivers; its load is one)."""
        return cls(lambda req, context: engine, Limits(max_running=1), contain_errors=False)

    # ---- events in --------------------------------------------------------------------------------
    def submit(self, key: int, job: Job, now: float, ready: bool = True) -> list[Action]:
        """Queue a job under `key` (unique among live requests); it starts at a `tick` (`ready` False: at
        most `recovery_s` from now, unless the cluster is whole by then)."""
        self.now_s = now
        if key in self.running or self.queue.get(key) is not None:
            raise ConfigError(f"request id {key} is already in use")
        req = Request(key, job, now)
        out: list[Action] = []
        if (busy := self.queue.full(job.client, self.limits.max_queued_per_client)) is not None:
            self._forget(req)
            req.state = State.FAILED
            return [Failed(key, busy)]
        if self._can_ever_fit(req, out):
            req.deadline_s = None if ready else now + self.limits.recovery_s
            self.queue.append(req)
        return out

    def running_engine(self, run_id: int):
        """The engine of run `run_id` while it runs; None for a cancelled, paused, replayed or ended one."""
        req = self.by_run.get(run_id)
        return req.engine if req is not None and req.state is State.RUNNING else None

    def add_work(self, run_id: int, item, now: float) -> None:
        """Something back from the pipeline for engine run `run_id`, queued until a `step` takes it."""
        req = self.by_run.get(run_id)
        if req is None or req.state is not State.RUNNING:
            return   # output of a cancelled, paused, replayed or finished run
        req.last_progress_s = now
        req.work.append((False, item))

    def step(self, now: float) -> list[Action]:
        """One piece of work per running request, their handlers side by side; actions request by request."""
        self._release_ended()
        self.now_s = now
        batch = [(req, ev) for req in list(self.running.values()) if (ev := self._next_event(req)) is not None]
        out: list[Action] = []
        if batch:
            results = self.run_handlers([partial(_guarded, partial(req.live_engine().receive, now=now), ev)
                                         for req, ev in batch])
            for (req, _), result in zip(batch, results):
                if req.state is State.RUNNING:
                    out += self._run(req, partial(_reraise, result))
        return out

    def deliver(self, key: int, event) -> None:
        """An answer to work the engine sent off node 0 (a drafter's pre-draft), queued as its follow-up;
        not pipeline progress. The engine ignores one that is no longer its current job."""
        req = self.running.get(key)
        if req is not None and req.state is State.RUNNING:
            req.work.append((True, event))

    def has_idle_work(self) -> bool:
        """Work the engines asked to run only when node 0 has nothing else (pre-drafting)."""
        return any(r.idle is not None for r in self.running.values() if r.state is State.RUNNING)

    def idle_step(self, now: float) -> list[Action]:
        """One request's idle work; call it only when `has_work()` is False, so it never delays a segment
        that is already back. Only while one request runs: an engine knows when its own segments are due,
        not the others'."""
        self.now_s = now
        if self.running_count() != 1:
            for req in self.running.values():
                req.idle = None
            return []
        for req in self.running.values():
            if req.state is State.RUNNING and req.idle is not None:
                event, req.idle = req.idle, None
                return self._run(req, partial(req.live_engine().receive, event, now=self.now_s))
        return []

    def cancel(self, key: int, why: str = "cancelled by its client") -> list[Action]:
        return self.stop(key, State.CANCELLED, why)

    def stop(self, key: int, state: State, why: str) -> list[Action]:
        """End a live request early: CANCELLED (its client), or FAILED (the driver could not carry out one
        of its actions, a bug met by one request; every other request goes on)."""
        req = self.running.get(key) or self.queue.get(key)
        return [] if req is None else self._end(req, state, why, prefix="")

    def end(self, key: int) -> list[Action]:
        """Its asker ended the answer (a stop string): the stages drop its KV; no further action for it."""
        req = self.running.get(key)
        if req is None:
            return []
        out: list[Action] = [ResetStages(key, req.run_id)] if req.state is State.RUNNING else []
        self._forget(req)
        req.state = State.DONE
        return out

    def stage_lost(self, why: str, now: float) -> list[Action]:
        """A stage left: running requests pause under the recovery deadline; queued ones keep their place."""
        self.now_s, self.lost_why = now, why
        out: list[Action] = []
        for req in list(self.running.values()):
            if req.state is State.RUNNING:
                out += self._pause(req, why)
            if req.deadline_s is None:
                req.deadline_s = now + self.limits.recovery_s
        return out

    def tick(self, now: float, ready: bool, missing: str = "") -> list[Action]:
        """Deadlines and stalls; with a ready cluster resume paused requests, then start queued ones.
        `missing`: what the cluster waits for while not ready ("stage 2"), named to those it fails."""
        self._release_ended()
        self.now_s = now
        self.ever_ready |= ready
        for req in self.queue if ready else ():   # the cluster is whole: a queued request waits for its turn only
            req.deadline_s = None
        out = self._expire(now, ready, missing)
        if not ready:
            return out
        for req in [r for r in self.running.values() if r.state is State.PAUSED]:
            out += self._replay(req, now)
        while (due := self.queue.first()) is not None and len(self.running) < self.limits.max_running:
            if not self._can_ever_fit(due, out):
                continue
            if not self._fits_now(due):
                self._note_kv_wait(due)
                break   # waits for running requests to free KV; nothing behind it overtakes
            out += self._start(self.queue.popleft(), now)
        return out

    def _expire(self, now: float, ready: bool, missing: str = "") -> list[Action]:
        out: list[Action] = []
        late = [r for r in self.running.values() if r.deadline_s is not None and now > r.deadline_s]
        late += [r for r in self.queue if r.deadline_s is not None and now > r.deadline_s]
        for req in late:
            out += self._end(req, State.FAILED, not_whole(self.lost_why, missing, self.limits.recovery_s), prefix="")
        for req in [r for r in self.queue if r.job.deadline_s is not None and now > r.job.deadline_s]:
            out += self._end(req, State.FAILED, "it waited in the queue past its deadline")
        for req in list(self.running.values()):
            if req.state is State.RUNNING and now - req.last_progress_s > self.limits.stall_s:
                out += self._pause(req, f"the pipeline returned nothing for {self.limits.stall_s:g} s")
                req.deadline_s = None if ready else now + self.limits.recovery_s
        return out

    # ---- queries ----------------------------------------------------------------------------------
    def get(self, key: int) -> Request | None:
        """A live or recently ended request."""
        return self.running.get(key) or self.queue.get(key) or self.ended.get(key)

    def has_work(self) -> bool:
        return any(r.work for r in self.running.values() if r.state is State.RUNNING)

    def pending(self) -> int:
        return len(self.queue) + len(self.running)

    def running_count(self) -> int:
        """Requests sharing the pipeline now (strategy `auto` weighs its predictions by it)."""
        return sum(1 for r in self.running.values() if r.state is State.RUNNING)

    def kv_reserved(self) -> int:
        """KV tokens the running (and paused) requests reserve on every stage."""
        return sum(r.job.kv_tokens for r in self.running.values())

    def next_deadline(self) -> float | None:
        """The earliest recovery or queue deadline (stalls are checked on every tick)."""
        times = [r.deadline_s for r in [*self.running.values(), *self.queue] if r.deadline_s is not None]
        times += [r.job.deadline_s for r in self.queue if r.job.deadline_s is not None]
        return min(times, default=None)

    # ---- admission --------------------------------------------------------------------------------
    def _can_ever_fit(self, req: Request, out: list) -> bool:
        budget = self.kv_budget()
        if budget is None or req.job.kv_tokens <= budget.tokens:
            return True
        out += self._end(req, State.FAILED, f"the request needs {req.job.kv_tokens} KV tokens on every stage "
                                            f"(prompt + max_tokens + a draft tree); stage {budget.stage} can hold "
                                            f"{budget.tokens} ({budget.why}): shorten the prompt or lower "
                                            f"max_tokens", prefix="", rejected=True)
        return False

    def _fits_now(self, req: Request) -> bool:
        budget = self.kv_budget()
        return budget is None or self.kv_reserved() + req.job.kv_tokens <= budget.tokens

    def _note_kv_wait(self, req: Request) -> None:
        if not req.kv_waited and (budget := self.kv_budget()) is not None:
            req.kv_waited = True
            log.info("request %d waits for KV: needs %d tokens per stage, %d of %d held by %d running", req.key,
                     req.job.kv_tokens, self.kv_reserved(), budget.tokens, len(self.running))

    # ---- transitions ------------------------------------------------------------------------------
    def _start(self, req: Request, now: float) -> list[Action]:
        req.started_s = now
        self.running[req.key] = req
        return self._launch(req, now)

    def _launch(self, req: Request, now: float) -> list[Action]:
        """Start (or restart, for a replay) the engine on the prompt plus what was already handed out."""
        try:
            req.engine = self.make_engine(req, self.context)
        except FlowedgeError as err:
            return self._end(req, State.FAILED, str(err), prefix="")
        req.run_id = req.next_run_id()
        req.work.clear()   # a replay: whatever the old run had queued is void
        req.idle = None
        self.by_run[req.run_id] = req
        req.state, req.deadline_s, req.last_progress_s = State.RUNNING, None, now
        job = req.job
        left = job.max_new_tokens - len(req.emitted)
        log.info("request %d: %d prompt tokens + %d committed, strategy %s, %d new to go (head request %d%s)",
                 req.run_id, len(job.prompt_ids), len(req.emitted), job.strategy or "-", left, req.key,
                 f", replay {req.replays}" if req.replays else "")   # tools/fault_inject.py checks FIFO on it
        ids, params = list(job.prompt_ids) + req.emitted, replay_params(job.params, len(req.emitted))
        return self._run(req, lambda: req.live_engine().start(req.run_id, ids, left, params, now=self.now_s))

    def _replay(self, req: Request, now: float) -> list[Action]:
        if req.replays >= self.limits.max_replays:
            return self._end(req, State.FAILED, f"gave up after {req.replays} replays")
        req.replays += 1
        log.warning("request %d: replaying %d committed tokens to rebuild the stages' KV caches", req.key,
                    len(req.job.prompt_ids) + len(req.emitted))
        return self._launch(req, now)

    def _pause(self, req: Request, why: str) -> list[Action]:
        log.warning("request %d paused after %d tokens: %s", req.key, len(req.emitted), why)
        self.by_run.pop(req.run_id, None)
        req.work.clear()
        req.idle = None
        req.state = State.PAUSED
        return [ResetStages(req.key, req.run_id)]

    def _end(self, req: Request, state: State, why: str, prefix: str = "request failed: ",
             rejected: bool = False) -> list[Action]:
        """End a request that did not complete: its stages reset, its asker told (not for a cancel)."""
        out: list[Action] = [ResetStages(req.key, req.run_id)] if req.state is State.RUNNING else []
        stats = getattr(req.engine, "stats", None) or Stats()
        self._forget(req)
        req.state = state
        if state is State.CANCELLED:
            log.info("request %d %s", req.key, why)
            return out + [Cancelled(req.key, Done(list(req.emitted), stats, req.key, cancelled=True))]
        log.log(logging.INFO if rejected else logging.ERROR, "request %d ended: %s", req.key, why)
        return out + [Failed(req.key, prefix + why, rejected)]

    def _release_ended(self) -> None:
        for req in self.releasing:
            req.engine = None
        self.releasing.clear()

    def _forget(self, req: Request) -> None:
        """Out of every list; kept in `ended`, its engine only until the driver has read the actions
        that end it (`_release_ended`, at the next call): 256 ended engines (trees, draft caches) held
        ~150 KB each on the tiny pair, far more on a real one, for nothing but inspection."""
        req.work.clear()
        req.idle = None
        if not self.keep_ended_engines:
            self.releasing.append(req)
        self.running.pop(req.key, None)
        self.by_run.pop(req.run_id, None)
        self.queue.discard(req)
        self.ended[req.key] = req
        while len(self.ended) > ENDED_REMEMBERED:
            self.ended.pop(next(iter(self.ended)))

    # ---- engine steps -----------------------------------------------------------------------------
    def _next_event(self, req: Request):
        """The request's next engine event: its oldest follow-up, else its oldest item that `accept` turns
        into an event (checked against the engine as it is now, after the work before it)."""
        if req.state is not State.RUNNING:
            req.work.clear()
            req.idle = None
            return None
        while req.work:
            follow_up, item = req.work.popleft()
            event = item if follow_up else self.accept(item)
            if event is not None:
                return event
        return None

    def _run(self, req: Request, step) -> list[Action]:
        """One engine step and its actions; an unexpected error fails this request only (if contained)."""
        if not self.contain_errors:
            return self._absorb(req, step())
        try:
            return self._absorb(req, step())
        except FlowedgeError as err:
            return self._end(req, State.FAILED, str(err), prefix="")
        except Exception as err:  # noqa: BLE001 - a bug met by one request must not take the head down
            log.exception("request %d: engine error", req.key)
            return self._end(req, State.FAILED, f"internal error: {type(err).__name__}: {err}", prefix="")

    def _absorb(self, req: Request, actions: list) -> list[Action]:
        """An engine step's actions as the scheduler's; its follow-ups go first in the request's work."""
        out: list[Action] = []
        follow_ups = []
        for a in actions:
            if req.state is not State.RUNNING:
                break
            if isinstance(a, (Send, Compute, Offload)):
                out.append(FromEngine(req.key, a))
            elif isinstance(a, WhenIdle):
                req.idle = a.event
            elif isinstance(a, Emit):
                req.emitted += a.tokens
                out.append(Emitted(req.key, list(a.tokens)))
            elif isinstance(a, Continue):
                follow_ups.append((True, a.event))
            elif isinstance(a, Done):
                self._forget(req)
                req.state = State.DONE
                out.append(Finished(req.key, Done(list(req.emitted), a.stats, req.key)))
            else:
                log.warning("unhandled engine action %r", a)
        if req.state is State.RUNNING:
            req.work.extendleft(reversed(follow_ups))
        return out


def _guarded(receive, event):
    """One request's engine step; an exception comes back as the result (`_run` deals with it)."""
    try:
        return receive(event)
    except Exception as err:  # noqa: BLE001 - re-raised by _reraise inside Scheduler._run
        return err


def _reraise(result):
    if isinstance(result, Exception):
        raise result
    return result
