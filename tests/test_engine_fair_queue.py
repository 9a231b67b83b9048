"""The scheduler's fair queue (engine/fair_queue.py): one lane per client, weighted round-robin starts, a
cap per lane; alone, and under the scheduler (engine/scheduler.py) with fake engines."""
from __future__ import annotations

import pytest

from flowedge.engine.events import Done, Emit, Send, Stats
from flowedge.engine.fair_queue import FairQueue
from flowedge.engine.jobs import Failed, FromEngine, Job, Limits, Request, RequestEngine, State
from flowedge.engine.scheduler import Scheduler
from flowedge.errors import Busy, ConfigError, refusal


def req(key: int, client: str, weight: float = 1.0) -> Request:
    return Request(key, Job((1,), 1, client=client, weight=weight), 0.0)


def drain(q: FairQueue) -> list[int]:
    return [q.popleft().key for _ in range(len(q))]


def test_one_client_is_first_come_first_served():
    q = FairQueue()
    for key in (3, 1, 2):
        q.append(req(key, ""))
    assert [r.key for r in q] == [3, 1, 2] and q.first().key == 3 and drain(q) == [3, 1, 2]
    assert not q.lanes and len(q) == 0 and q.first() is None


def test_with_one_slot_clients_take_turns():
    q = FairQueue()
    for key in range(1, 6):
        q.append(req(key, "flood"))
    assert q.popleft().key == 1 and q.popleft().key == 2   # the flood alone: in order
    q.append(req(10, "polite"))
    q.append(req(11, "polite"))
    # the newcomer brings no credit for the time it had nothing queued: it waits one turn of the flood
    assert drain(q) == [3, 10, 4, 11, 5]


def test_a_client_with_nothing_running_goes_before_one_that_holds_slots():
    running: list[Request] = []
    q = FairQueue(lambda: running)
    for key in range(1, 9):
        q.append(req(key, "flood"))
    running += [q.popleft(), q.popleft()]
    q.append(req(10, "polite"))
    assert q.first().key == 10   # at the next free slot, whatever the flood's pass and age
    running.append(q.popleft())
    assert q.first().key == 3    # now one running each: by turn (the flood's pass is 2, the polite's 2.5)
    running.clear()
    q.append(req(11, "polite"))
    assert drain(q)[:3] == [3, 11, 4]


def test_a_stream_of_new_clients_cannot_starve_an_old_one():
    """One slot, the flood's lane never empties, and a new client arrives at every start (faster than it is
    served): the global pass moves on at each start, so the flood waits at most one turn of each client
    queued, as every other client does."""
    q = FairQueue()
    for key in range(100):
        q.append(req(key, "flood"))
    gaps, since, lanes = [], 0, 0
    for k in range(60):
        q.append(req(1000 + k, f"new-{k}"))
        lanes = max(lanes, len(q.lanes))
        if q.popleft().job.client == "flood":
            gaps.append(since)
            since = 0
        else:
            since += 1
    assert len(gaps) >= 8 and max(gaps) <= lanes, (gaps, lanes)


def test_weights_share_the_starts():
    q = FairQueue()
    for key in range(20):
        q.append(req(key, "heavy", weight=3))
        q.append(req(100 + key, "light"))
    first = drain(q)[:16]
    assert sum(k < 100 for k in first) == 12   # 3 : 1
    with pytest.raises(ConfigError, match="weight"):
        Job((1,), 1, weight=0)


def test_discard_keeps_the_lanes_and_the_order_whole():
    q = FairQueue()
    a, b, c = req(1, "a"), req(2, "a"), req(3, "b")
    for r in (a, b, c):
        q.append(r)
    q.discard(a)
    q.discard(a)   # already gone: nothing
    assert a not in q and b in q and [r.key for r in q] == [2, 3] and q.counts() == {"a": 1, "b": 1}
    q.discard(c)
    assert q.counts() == {"a": 1} and q.get(3) is None and q.get(2) is b


def test_the_cap_refuses_past_it_with_a_busy_message_and_counts_who():
    q = FairQueue()
    for key in range(2):
        q.append(req(key, "a"))
    assert q.full("a", 0) is None and q.full("b", 2) is None   # 0: no cap; b has nothing queued
    why = q.full("a", 2)
    assert why.startswith(Busy.PREFIX) and "queue is full" in why and "max_queued_per_client = 2" in why
    assert isinstance(refusal(why), Busy) and q.refused == {"a": 1}
    table = q.table()
    assert table == [{"client": "a", "weight": 1.0, "queued": 2, "running": 0, "refused": 1}]


class Echo(RequestEngine):
    """Emits one token per event; done after max_new."""

    def start(self, run_id, prompt_ids, max_new_tokens, params, now=None):
        self.left, self.stats = max_new_tokens, Stats()
        return [Send(1, run_id)]

    def receive(self, event, now=None):
        self.left -= 1
        return [Emit([event])] + ([Done([event], self.stats)] if self.left == 0 else [])


def finish(s: Scheduler, key: int, now: float) -> None:
    """Run request `key` to its end (one token)."""
    s.add_work(key, 7, now)
    s.step(now)
    assert s.get(key).state is State.DONE


def test_under_the_scheduler_a_flood_is_capped_and_a_second_client_starts_at_the_next_free_slot():
    s = Scheduler(lambda r, context: Echo(), Limits(max_running=2, max_queued_per_client=5))
    refused = [a for key in range(1, 21) for a in s.submit(key, Job((1,), 1, client="flood"), 0.0)]
    assert len(refused) == 15 and all(isinstance(a, Failed) and a.message.startswith(Busy.PREFIX) for a in refused)
    assert s.get(20).state is State.FAILED and len(s.queue) == 5
    started = s.tick(0.0, True)
    assert [a.key for a in started if isinstance(a, FromEngine)] == [1, 2]
    s.submit(100, Job((1,), 1, client="polite"), 0.1)
    finish(s, 1, 0.2)
    assert [a.key for a in s.tick(0.2, True)] == [100]   # not the flood's 3, queued long before
    assert s.queue.table()[0] == {"client": "flood", "weight": 1.0, "queued": 3, "running": 1,
                                                     "refused": 15}
    assert s.submit(21, Job((1,), 1, client="flood"), 0.3) == []   # room again under the cap
