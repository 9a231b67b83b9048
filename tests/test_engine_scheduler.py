"""The request scheduler alone (engine/scheduler.py), fed events with fake engines, checked on its actions.
Its drivers have their own tests: the daemon's in test_node_lifecycle.py, the simulator's in
test_engine_batching.py and test_sim_stage_loss.py."""
from __future__ import annotations

import pytest

from flowedge.core.config import SpecConfig
from flowedge.core.sampling import SamplingParams
from flowedge.engine.events import Done, Emit, Send, Stats
from flowedge.engine.jobs import (REPLAY_ID_SHIFT, Cancelled, Emitted, Failed, Finished, FromEngine, Job, KvBudget,
                                  Limits, RequestEngine, ResetStages, State, kv_need, tree_reserve)
from flowedge.engine.scheduler import Scheduler
from flowedge.errors import ConfigError


class Echo(RequestEngine):
    """Emits the token each event carries; done after max_new tokens. Records its start."""

    def __init__(self, log: list) -> None:
        self.log, self.times = log, []

    def start(self, run_id, prompt_ids, max_new_tokens, params, now=None):
        self.times.append(now)
        self.log.append((run_id, list(prompt_ids), max_new_tokens, params))
        self.left, self.stats = max_new_tokens, Stats()
        return [Send(1, f"prefill-{run_id}")]

    def receive(self, event, now=None):
        self.times.append(now)
        if event == "boom":
            raise IndexError("bad node id")
        self.left -= 1
        return [Emit([event])] + ([Done([event], self.stats)] if self.left == 0 else [])


def sched(**limits) -> tuple[Scheduler, list]:
    starts: list = []
    return Scheduler(lambda req, context: Echo(starts), Limits(**limits)), starts


def test_a_job_runs_and_its_whole_answer_comes_back_in_order():
    s, starts = sched()
    assert s.submit(7, Job((1, 2), 2), 0.0) == []   # admitted on a tick, not before
    (prefill,) = s.tick(0.0, True)
    assert prefill == FromEngine(7, Send(1, "prefill-7")) and starts[0][:3] == (7, [1, 2], 2)
    s.add_work(7, 11, 0.1)
    s.add_work(7, 12, 0.1)
    assert s.step(0.2) == [Emitted(7, [11])]
    out = s.step(0.3)
    assert out[0] == Emitted(7, [12]) and isinstance(out[1], Finished) and out[1].done.token_ids == [11, 12]
    assert s.pending() == 0 and s.get(7).state is State.DONE and not s.has_work()


def test_a_replay_restarts_on_the_committed_tokens_under_a_new_run_id_and_the_old_run_is_ignored():
    s, starts = sched(recovery_s=10.0)
    s.submit(1, Job((5,), 4, SamplingParams(0.7, seed=3)), 0.0)
    s.tick(0.0, True)
    s.add_work(1, 21, 0.1)
    s.step(0.1)
    assert s.stage_lost("stage 2 lost", 0.2) == [ResetStages(1, 1)]
    assert s.next_deadline() == pytest.approx(10.2)
    s.add_work(1, 99, 0.3)            # a late segment of the paused run
    assert s.tick(1.0, False) == [] and not s.has_work()
    s.tick(2.0, True)
    run_id, ids, left, params = starts[1]
    assert run_id == 1 + (1 << REPLAY_ID_SHIFT) and ids == [5, 21] and left == 3
    assert params.seed != 3 and params.temperature == 0.7   # a fresh generator, seeded from (seed, committed)
    s.add_work(1, 55, 2.1)            # the old run's id: dropped
    assert not s.has_work()
    for t in (22, 23, 24):
        s.add_work(run_id, t, 2.2)
        out = s.step(2.2)
    assert out[-1].done.token_ids == [21, 22, 23, 24] and s.get(1).replays == 1


def test_past_the_recovery_deadline_a_paused_request_fails_but_a_queued_one_waits():
    s, _ = sched(recovery_s=1.0)
    s.submit(1, Job((5,), 4), 0.0)
    s.submit(2, Job((5,), 4), 0.0)
    s.tick(0.0, True)
    s.stage_lost("stage 1 lost", 0.5)
    (failed,) = s.tick(1.6, False)
    assert failed == Failed(1, "cluster not ready: stage 1 lost, and no node took its place within 1 s")
    assert [r.key for r in s.queue] == [2] and s.tick(100.0, False) == []


def test_a_queued_job_fails_past_its_own_deadline():
    s, _ = sched()
    s.submit(1, Job((5,), 4), 0.0)
    s.submit(2, Job((5,), 4, deadline_s=3.0), 0.0)
    s.tick(0.0, True)
    assert s.next_deadline() == 3.0
    assert s.tick(3.5, True) == [Failed(2, "request failed: it waited in the queue past its deadline")]


def test_kv_admission_is_first_come_first_served_and_a_job_that_never_fits_fails_at_once():
    starts: list = []
    s = Scheduler(lambda req, context: Echo(starts), Limits(max_running=4), lambda: KvBudget(100, 2, "test"))
    (failed,) = s.submit(1, Job((5,), 4, kv_tokens=101), 0.0)
    assert isinstance(failed, Failed) and "needs 101 KV tokens" in failed.message
    assert "stage 2 can hold 100" in failed.message
    for key, need in ((2, 60), (3, 50), (4, 30)):
        s.submit(key, Job((5,), 4, kv_tokens=need), 0.0)
    s.tick(0.0, True)
    assert list(s.running) == [2] and [r.key for r in s.queue] == [3, 4]   # 4 would fit, but does not overtake 3
    with pytest.raises(ConfigError, match="in use"):
        s.submit(3, Job((5,), 4), 0.0)


def test_cancel_end_and_a_contained_engine_error():
    s, _ = sched(max_running=3)
    for key in (1, 2, 3):
        s.submit(key, Job((5,), 4), 0.0)
    s.submit(4, Job((5,), 4), 0.0)
    s.tick(0.0, True)
    reset, cancelled = s.cancel(1)
    assert reset == ResetStages(1, 1) and isinstance(cancelled, Cancelled) and cancelled.done.cancelled
    (queued,) = s.cancel(4)
    assert isinstance(queued, Cancelled) and queued.done.token_ids == []
    assert s.end(2) == [ResetStages(2, 2)] and s.end(2) == []   # a stop string: no more actions for it
    s.add_work(3, "boom", 0.1)
    reset, failed = s.step(0.1)
    assert reset == ResetStages(3, 3) and failed == Failed(3, "internal error: IndexError: bad node id")


def test_an_uncontained_engine_error_propagates():
    s = Scheduler(lambda req, context: Echo([]), contain_errors=False)
    s.submit(1, Job((5,), 4), 0.0)
    s.tick(0.0, True)
    s.add_work(1, "boom", 0.1)
    with pytest.raises(IndexError):
        s.step(0.1)


def test_the_engines_read_the_scheduler_s_time():
    """Strategy `auto` measures its rates on the driver's time (virtual under simulation): every call into an
    engine carries it, the idle work's and the follow-ups' too."""
    engines: list = []

    def make(req, context):
        engines.append(Echo([]))
        return engines[-1]

    s = Scheduler(make)
    s.submit(1, Job((5,), 4), 0.0)
    s.tick(2.5, True)
    s.add_work(1, 11, 3.0)
    s.step(4.0)
    s.deliver(1, 12)
    s.step(4.5)
    assert engines[0].times == [2.5, 4.0, 4.5]


def test_the_kv_need_is_the_context_plus_the_largest_tree_in_flight():
    spec = SpecConfig(tree_nodes=24, exp_nodes=12, se_nodes=4, pipedec_width=16)
    assert tree_reserve(spec) == 24 + 16 and kv_need(spec, 10, 5) == 10 + 5 + 40
    with pytest.raises(ConfigError, match="max-concurrent"):
        Limits(max_running=0)
