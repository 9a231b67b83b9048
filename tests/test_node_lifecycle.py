"""The head's parts without sockets: its requests (head_requests.py, the driver of engine/scheduler.py) and
membership (membership.py), fed events, checked on the actions they take."""
from __future__ import annotations

import pytest

from flowedge.core.sampling import SamplingParams
from flowedge.engine.events import Continue, Done, Emit, Send, Stats
from flowedge.engine.jobs import KvBudget
from flowedge.engine.jobs import Limits, RequestEngine, replay_params
from flowedge.errors import ContextOverflow, FlowedgeError
from flowedge.node.head_requests import EnginePort, HeadRequests, OutPort, Prepared
from flowedge.node.kv_budget import StageMemory, stage_budget, tightest
from flowedge.node.membership import ClientGone, Membership, StageLost
from flowedge.node.node_config import NodeConfig
from flowedge.plan.memory import kv_bytes_per_token
from flowedge.transport import protocol as proto

PROMPT = [5, 6, 7]


class FakeEngine(RequestEngine):
    """Emits the token each event carries; done after max_new tokens. Records every start."""

    def __init__(self) -> None:
        self.starts: list[tuple[int, list[int], int, SamplingParams]] = []

    def start(self, run_id, prompt_ids, max_new_tokens, params, now=None):
        self.starts.append((run_id, list(prompt_ids), max_new_tokens, params))
        self.left = max_new_tokens
        return [Send(1, f"prefill-{run_id}")]

    def receive(self, event, now=None):
        if event == "boom":
            raise IndexError("node id 99 out of range")   # what a bogus returned segment did
        self.left -= 1
        return [Emit([event])] + ([Done([event], Stats())] if self.left == 0 else [])


class Text:
    def __init__(self, sink) -> None:
        self.sink = sink

    def __call__(self, tokens) -> None:
        self.sink("".join(chr(96 + t % 26) for t in tokens))

    def flush(self) -> None:
        pass


class FakePort(EnginePort, OutPort):
    """Both of the head's ports: engines from a FakeEngine, every message out recorded."""

    def __init__(self) -> None:
        self.engine_ = FakeEngine()
        self.client: list[tuple[bytes, proto.Message]] = []
        self.stages: list = []
        self.resets: list[int] = []
        self.offloads: list[tuple[int, object]] = []
        self.budget: KvBudget | None = None

    def kv_budget(self):
        return self.budget

    def kv_need(self, prepared, max_new_tokens):
        return len(prepared.prompt_ids) + max_new_tokens

    def prepare(self, msg):
        if msg.strategy == "bad":
            raise FlowedgeError("unknown strategy 'bad'")
        return Prepared(list(PROMPT), SamplingParams(msg.temperature, seed=msg.seed), msg.strategy or "flowspec")

    def engine(self, strategy, context):
        self.context = context   # the scheduler's clock and load, as every engine gets them
        return self.engine_

    def accept(self, msg):
        return msg

    def text_stream(self, sink):
        return Text(sink)

    def to_client(self, identity, msg):
        self.client.append((identity, msg))

    def to_stages(self, action):
        self.stages.append(action)

    def reset_stages(self, run_id):
        self.resets.append(run_id)

    def offload(self, key, action):
        self.offloads.append((key, action))

    def finish_stats(self, req, done):
        return {"new_tokens": len(req.emitted), "replays": req.replays}

    def answers(self, owner: bytes) -> list:
        return [m for o, m in self.client if o == owner]

    def tokens(self, owner: bytes) -> list[int]:
        return [t for m in self.answers(owner) if isinstance(m, proto.TokenChunk) for t in m.token_ids]

    def done(self, owner: bytes) -> bool:
        return any(isinstance(m, proto.TokenChunk) and m.done for m in self.answers(owner))

    def errors(self, owner: bytes) -> list[str]:
        return [m.message for m in self.answers(owner) if isinstance(m, proto.ErrorReply)]


def prompt(rid: int = 1, max_new: int = 4, **kw) -> proto.PromptRequest:
    return proto.PromptRequest(request_id=rid, text="hi", max_new_tokens=max_new, **kw)


def book(**limits) -> tuple[HeadRequests, FakePort]:
    port = FakePort()
    return HeadRequests(port, port, Limits(**limits)), port


def test_a_prompt_before_the_cluster_was_ever_ready_is_refused_at_once():
    b, port = book()
    b.submit(b"c", prompt(), 0.0, False, ["stage 2"])
    assert port.errors(b"c") == ["cluster not ready: waiting for stage 2"] and b.pending() == 0


def test_a_request_runs_to_done_and_streams_every_token_once():
    b, port = book()
    b.tick(0.0, True)
    b.submit(b"c", prompt(max_new=3), 0.0, True, [])
    b.tick(0.1, True)
    (run_id, ids, max_new, _), = port.engine_.starts
    assert ids == PROMPT and max_new == 3 and port.stages == [Send(1, f"prefill-{run_id}")]
    for t in (11, 12, 13):
        b.on_segment(run_id, t, 0.2)
    assert port.tokens(b"c") == [11, 12, 13] and port.done(b"c") and b.pending() == 0
    assert b.served["requests"] == 1 and b.served["tokens"] == 3


def test_status_counts_tokens_while_the_answer_streams():
    """tokens/s in `status --watch` and the dashboard comes from `served` while the answer runs
    (before: tokens were counted only when an answer ended, so a long answer showed 0 tokens/s)."""
    b, port = book(recovery_s=10.0)
    b.tick(0.0, True)
    b.submit(b"c", prompt(max_new=5), 0.0, True, [])
    b.submit(b"d", prompt(rid=2), 0.0, True, [])
    b.tick(1.0, True)
    run_id = port.engine_.starts[0][0]
    b.on_segment(run_id, 21, 1.5)
    b.on_segment(run_id, 22, 1.5)
    assert b.served["tokens"] == 2 and b.served["requests"] == 0
    live = b.live(3.0, lambda owner: owner.decode())
    assert (live["queued"], live["running"], live["paused"]) == (1, 1, 0)
    assert live["active"] == [{"id": live["active"][0]["id"], "state": "running", "tokens": 2, "elapsed_s": 2.0,
                               "tokens_per_s": 1.0, "client": "c", "mean_accept_len": None}]
    b.stage_lost("stage 2 (s2) disconnected", 3.5)
    assert (b.live(4.0)["running"], b.live(4.0)["paused"]) == (0, 1)
    b.tick(5.0, True)   # resumed: the replay's tokens are counted once, as they are sent
    for t in (23, 24, 25):
        b.on_segment(port.engine_.starts[-1][0], t, 5.5)
    assert b.served["tokens"] == 5 and b.served["requests"] == 1


def test_status_has_a_live_token_rate_while_the_answer_streams_and_none_after():
    """`flowedge status` once said `tokens/s -` during an answer: one reply had no rate of its own."""
    b, port = book()
    b.tick(0.0, True)
    b.submit(b"c", prompt(max_new=10), 0.0, True, [])
    b.tick(0.1, True)
    run_id = port.engine_.starts[0][0]
    for k, t in enumerate((0.5, 1.0, 1.5, 2.0, 2.5, 3.0)):
        b.on_segment(run_id, 11 + k, t)
    assert b.live(3.0)["tokens_per_s"] == pytest.approx(2.0)   # 6 tokens in the last 3 s
    assert b.live(10.0)["tokens_per_s"] == 0.0


def test_client_mistakes_are_counted_rejected_and_cluster_faults_failed():
    """A context overflow once showed as "1 failed" on the dashboard, as if the cluster had failed."""
    b, port = book()
    b.submit(b"c", prompt(rid=1), 0.0, False, ["stage 1"])    # never ready yet: the cluster's fault
    b.tick(0.0, True)
    port.prepare = lambda msg: (_ for _ in ()).throw(ContextOverflow("This model's maximum context length is 8 "
                                                                     "tokens. However, you requested 9 tokens"))
    b.submit(b"c", prompt(rid=2), 0.1, True, [])
    port.prepare = FakePort.prepare.__get__(port)
    port.budget = KvBudget(5, 1, "test")
    b.submit(b"c", prompt(rid=3, max_new=10), 0.2, True, [])   # can never fit the stages' KV
    assert len(port.errors(b"c")) == 3
    assert (b.served["rejected"], b.served["failed"]) == (2, 1)


def test_an_engine_sees_how_many_requests_are_running():
    """Strategy `auto` weighs its predictions by the requests sharing the pipeline (engine/auto_policy.py)."""
    b, port = book(max_running=2)
    b.tick(0.0, True)
    for rid, owner in ((1, b"a"), (2, b"b"), (3, b"c")):
        b.submit(owner, prompt(rid, max_new=1), 0.0, True, [])
    b.tick(0.1, True)
    assert port.context.running_requests() == 2   # the third waits in the queue: not counted
    first = port.engine_.starts[0][0]
    b.on_segment(first, 11, 0.2)   # the first one's single token: done
    assert port.done(b"a") and port.context.running_requests() == 1
    b.tick(0.3, True)              # the third starts in its place
    assert port.context.running_requests() == 2
    b.stage_lost("stage 1 died", 0.4)   # paused requests wait for a stage, they do not run
    assert port.context.running_requests() == 0


def test_a_lost_stage_pauses_the_request_and_the_replay_continues_from_the_committed_tokens():
    b, port = book(recovery_s=10.0)
    b.tick(0.0, True)
    b.submit(b"c", prompt(max_new=5), 0.0, True, [])
    b.tick(0.0, True)
    first = port.engine_.starts[0][0]
    b.on_segment(first, 21, 0.1)
    b.on_segment(first, 22, 0.2)
    b.stage_lost("stage 2 (s2) disconnected", 0.3)
    assert port.resets == [first]                       # the survivors drop the request's KV cache
    b.on_segment(first, 99, 0.4)                        # a late segment of the paused run: ignored
    b.tick(5.0, False)                                  # still waiting, within the recovery deadline
    assert port.tokens(b"c") == [21, 22] and not port.errors(b"c")
    b.tick(6.0, True)                                   # the slot is filled again: replay
    second, ids, max_new, _ = port.engine_.starts[1]
    assert second != first and ids == PROMPT + [21, 22] and max_new == 3
    for t in (23, 24, 25):
        b.on_segment(second, t, 6.5)
    assert port.tokens(b"c") == [21, 22, 23, 24, 25] and port.done(b"c") and not port.errors(b"c")


def test_past_the_recovery_deadline_every_request_in_flight_gets_one_clear_error():
    b, port = book(recovery_s=10.0, max_running=3)
    b.tick(0.0, True)
    for i, owner in enumerate([b"a", b"b", b"c"]):
        b.submit(owner, prompt(rid=i + 1), 0.0, True, [])
    b.tick(0.0, True)
    b.stage_lost("stage 1 (s1) silent for 2.0 s (missed heartbeats)", 1.0)
    b.submit(b"d", prompt(), 2.0, False, ["stage 1"])   # arrives during the outage: queued, not refused
    b.tick(10.9, False, ["stage 1"])
    assert not any(port.errors(o) for o in (b"a", b"b", b"c", b"d"))
    b.tick(11.1, False, ["stage 1"])
    for owner in (b"a", b"b", b"c"):
        (err,) = port.errors(owner)
        assert err.startswith("cluster not ready: waiting for stage 1 (stage 1 (s1) silent") and "within 10 s" in err
    assert b.pending() == 1 and not port.errors(b"d") and b.served["failed"] == 3   # d waits its own 10 s
    b.tick(12.1, False, ["stage 1"])
    (err,) = port.errors(b"d")
    assert err.startswith("cluster not ready: waiting for stage 1") and b.pending() == 0


def test_queued_requests_keep_their_place_through_an_outage_longer_than_the_recovery_deadline():
    """7 of 8 queued requests once failed with the running one. Requests in flight time out at
    `recovery_s`, and so does one that arrived during the outage; one queued before it waits under its
    own deadline (its client's timeout, which cancels it)."""
    b, port = book(recovery_s=10.0, max_running=1)
    b.tick(0.0, True)
    owners = [f"c{i}".encode() for i in range(5)]
    for o in owners:
        b.submit(o, prompt(max_new=2), 0.0, True, [])
    b.tick(0.0, True)
    (first,) = b.running.values()
    b.on_segment(first.run_id, 1, 0.5)
    b.stage_lost("stage 2 (s2) disconnected", 1.0)
    b.submit(b"late", prompt(max_new=2), 2.0, False, ["stage 2"])
    b.tick(11.5, False)
    (err,) = port.errors(b"c0")                          # the request in flight: one clear error
    assert "within 10 s" in err
    b.cancel(b"c3", 1)                                   # a client that stops waiting takes its request away
    b.tick(600.0, False)                                 # a long outage: the queue holds
    assert not any(port.errors(o) for o in owners[1:])
    (late,) = port.errors(b"late")                       # it came during the outage: told after recovery_s
    assert late.startswith("cluster not ready") and "stage 2" in late
    assert [r.owner for r in b.queue] == [b"c1", b"c2", b"c4"]
    order, t = [], 601.0
    while b.pending():                                    # the slot is filled again: served in order
        b.tick(t, True)
        (req,) = b.running.values()
        order.append(req.owner)
        b.on_segment(req.run_id, 1, t)
        b.on_segment(req.run_id, 2, t)
        t += 0.1
    assert order == [b"c1", b"c2", b"c4"]
    assert all(port.done(o) and port.tokens(o) == [1, 2] and not port.errors(o) for o in order)


def test_a_request_arriving_while_a_slot_is_empty_waits_at_most_recovery_s_and_runs_if_the_stage_returns():
    """It once waited out its client's timeout (300 s) with no word, the head knowing the slot was empty."""
    b, port = book(recovery_s=3.0)
    b.tick(0.0, True)
    b.stage_lost("stage 2 (s2) disconnected", 1.0)
    b.submit(b"a", prompt(max_new=1), 1.5, False, ["stage 2"])
    b.submit(b"b", prompt(max_new=1), 2.0, False, ["stage 2"])
    b.tick(4.0, True)        # back within 3 s of each: a runs, b keeps its place behind it
    b.tick(9.0, True)        # b waits for its turn now, not for the cluster: no deadline left
    assert not port.errors(b"a") and not port.errors(b"b")
    b.on_segment(port.engine_.starts[0][0], 7, 9.5)
    b.tick(9.6, True)
    b.on_segment(port.engine_.starts[1][0], 8, 9.7)
    assert port.done(b"a") and port.done(b"b")
    b.stage_lost("stage 2 (s2) disconnected", 20.0)
    b.submit(b"c", prompt(), 20.5, False, ["stage 2"])
    b.tick(23.4, False, ["stage 2"])
    assert not port.errors(b"c")
    b.tick(23.6, False, ["stage 2"])
    assert port.errors(b"c") == ["cluster not ready: waiting for stage 2 (stage 2 (s2) disconnected), and no node "
                                 "took its place within 3 s"]
    assert b.pending() == 0 and b.served["failed"] == 1


def test_queued_requests_keep_their_place_across_an_outage_and_all_are_answered():
    """8 clients, 24 requests, a stage lost half-way: every request is answered, none silent."""
    b, port = book(recovery_s=30.0)
    b.tick(0.0, True)
    owners = [f"c{i}".encode() for i in range(8)]
    for rid in range(1, 4):
        for o in owners:
            b.submit(o, prompt(rid=rid, max_new=2), 0.0, True, [])
    order = []
    t = 0.0
    while b.pending():
        t += 0.1
        b.tick(t, True)
        (req,) = b.running.values()
        order.append((req.owner, req.request_id))
        b.on_segment(req.run_id, 1, t)
        if len(order) == 10:   # the stage dies with this request half done and 14 queued behind it
            b.stage_lost("stage 2 (s2) disconnected", t)
            b.tick(t + 1, False)
            t += 2
            b.tick(t, True)    # back: the paused request is replayed before any queued one starts
            assert [r.request_id for r in b.running.values()] == [req.request_id]
        b.on_segment(req.run_id, 2, t)
    assert order == [(o, rid) for rid in range(1, 4) for o in owners]
    assert all(sum(isinstance(m, proto.TokenChunk) and m.done for m in port.answers(o)) == 3 for o in owners)
    assert all(port.tokens(o) == [1, 2] * 3 and not port.errors(o) for o in owners)


def test_a_departed_client_s_requests_are_dropped_and_their_kv_freed():
    b, port = book()
    b.tick(0.0, True)
    b.submit(b"gone", prompt(rid=1), 0.0, True, [])
    b.submit(b"gone", prompt(rid=2), 0.0, True, [])
    b.submit(b"stays", prompt(rid=1, max_new=1), 0.0, True, [])
    b.tick(0.0, True)
    running = port.engine_.starts[0][0]
    b.client_gone(b"gone", "disconnected")
    assert port.resets == [running] and not port.answers(b"gone") and b.served["cancelled"] == 2
    b.tick(0.1, True)   # the next request runs at once: no time spent on the departed client's work
    (req,) = b.running.values()
    assert req.owner == b"stays"


def test_cancel_drops_only_the_named_request():
    b, port = book()
    b.tick(0.0, True)
    b.submit(b"c", prompt(rid=1), 0.0, True, [])
    b.submit(b"c", prompt(rid=2, max_new=1), 0.0, True, [])
    b.tick(0.0, True)
    b.cancel(b"c", 1)
    b.tick(0.1, True)
    (req,) = b.running.values()
    assert req.request_id == 2 and not port.errors(b"c")


def test_an_engine_error_fails_that_request_only_and_the_head_serves_on():
    """Regression: a returned segment for an unknown node id ended the head."""
    b, port = book()
    b.tick(0.0, True)
    b.submit(b"c", prompt(rid=1), 0.0, True, [])
    b.submit(b"c", prompt(rid=2, max_new=1), 0.0, True, [])
    b.tick(0.0, True)
    b.on_segment(port.engine_.starts[0][0], "boom", 0.1)
    assert port.errors(b"c") == ["internal error: IndexError: node id 99 out of range"]
    b.tick(0.2, True)
    b.on_segment(port.engine_.starts[1][0], 7, 0.3)
    assert port.done(b"c")


def test_a_bad_request_fails_with_its_error_and_a_stalled_one_is_replayed():
    b, port = book(stall_s=5.0)
    b.tick(0.0, True)
    b.submit(b"c", prompt(rid=1, strategy="bad"), 0.0, True, [])
    b.tick(0.0, True)
    assert port.errors(b"c") == ["unknown strategy 'bad'"]
    b.submit(b"c", prompt(rid=2, max_new=2), 1.0, True, [])
    b.tick(1.0, True)
    b.tick(6.5, True)   # nothing came back for 5 s: replay on the same (empty) committed tokens
    assert len(port.engine_.starts) == 2 and port.resets == [port.engine_.starts[0][0]]


class ChainEngine(RequestEngine):
    """A segment n leads to follow-ups n.1 and n.2, n.1 to n.1.1; the leaves (n.1.1, n.2) emit a token."""

    def __init__(self, log: list) -> None:
        self.log, self.left = log, 0

    def start(self, run_id, prompt_ids, max_new_tokens, params, now=None):
        self.id, self.left = run_id, max_new_tokens
        return []

    def receive(self, event, now=None):
        self.log.append((self.id, event))
        if event.count(".") < (1 if event.endswith(".2") else 2):
            return [Continue(event + ".1")] + ([Continue(event + ".2")] if "." not in event else [])
        self.left -= 1
        return [Emit([7])] + ([Done([7], Stats())] if self.left == 0 else [])


def test_each_step_takes_one_piece_of_work_per_request_follow_ups_first():
    work: list = []
    steps: list[list] = []

    def side_by_side(handlers):   # what the draft batcher's run_step sees
        before = len(work)
        out = [h() for h in handlers]
        steps.append(work[before:])
        return out

    port = FakePort()
    port.engine = lambda strategy, context: ChainEngine(work)
    b = HeadRequests(port, port, Limits(max_running=2), run_handlers=side_by_side)
    b.tick(0.0, True)
    b.submit(b"a", prompt(1, max_new=3), 0.0, True, [])
    b.submit(b"b", prompt(2, max_new=3), 0.0, True, [])
    b.tick(0.0, True)
    b.add_segment(1, "s", 0.1)
    b.add_segment(2, "t", 0.1)
    b.add_segment(1, "u", 0.1)
    assert b.has_work()
    while b.step(0.2):
        pass
    assert steps[:3] == [[(1, "s"), (2, "t")], [(1, "s.1"), (2, "t.1")], [(1, "s.1.1"), (2, "t.1.1")]]
    # per request: the order of work it has alone (depth-first follow-ups, then the next segment)
    assert [e for i, e in work if i == 1] == ["s", "s.1", "s.1.1", "s.2", "u", "u.1", "u.1.1"]
    assert port.tokens(b"a") == [7, 7, 7] and port.done(b"a") and port.tokens(b"b") == [7, 7]
    assert not b.has_work()


def test_admission_waits_for_kv_on_every_stage_first_come_first_served():
    b, port = book(max_running=4)
    port.budget = KvBudget(100, 2, "test")
    b.tick(0.0, True)
    b.submit(b"big", prompt(1, max_new=200), 0.0, True, [])     # 3 + 200 > 100: can never fit
    assert port.errors(b"big") == ["the request needs 203 KV tokens on every stage (prompt + max_tokens + a "
                                   "draft tree); stage 2 can hold 100 (test): shorten the prompt or lower max_tokens"]
    for owner, max_new in ((b"a", 57), (b"b", 47), (b"c", 27)):   # needs 60, 50, 30
        b.submit(owner, prompt(1, max_new=max_new), 0.0, True, [])
    b.tick(0.1, True)
    assert [r.owner for r in b.running.values()] == [b"a"] and b.kv_reserved() == 60
    assert [r.owner for r in b.queue] == [b"b", b"c"]   # c would fit, but does not overtake b
    a = next(iter(b.running.values()))
    for t in range(57):
        b.on_segment(a.run_id, t, 0.2)
    assert port.done(b"a")
    b.tick(0.3, True)
    assert sorted(r.owner for r in b.running.values()) == [b"b", b"c"] and b.kv_reserved() == 80


def test_a_stage_s_kv_budget_comes_from_its_free_memory_less_weights_capped_by_the_setting():
    from types import SimpleNamespace

    cfg = SimpleNamespace(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, intermediate_size=128,
                          num_hidden_layers=4, vocab_size=100, head_dim=16)
    per_token = kv_bytes_per_token(cfg, 2, 4)
    assert per_token == 2 * 2 * (2 * 16) * 4   # layers x (K, V) x kv width x fp32
    free, weights = 2_000_000_000, 100_000_000
    stage = StageMemory(stage=1, layers=2, free_memory_bytes=free, weights_bytes=weights)
    derived = stage_budget(cfg, stage, 4)
    assert derived.tokens == int((free * 0.9 - weights - 0.75 * (1 << 30)) // per_token) and "GB free" in derived.why
    assert stage_budget(cfg, stage, 4, cap_tokens=1000) == KvBudget(1000, 1, "kv_budget_tokens = 1000")
    assert stage_budget(cfg, StageMemory(2, 2, 0, weights), 4) is None   # nothing known: no limit
    poor = StageMemory(2, 2, 900_000_000, weights)                        # less free than weights + runtime
    assert tightest(cfg, [stage, poor], 4).tokens == 0 and tightest(cfg, [stage, poor], 4).stage == 2


def test_replay_params_keep_greedy_and_reseed_sampling():
    greedy = SamplingParams()
    assert replay_params(greedy, 5) is greedy
    hot = SamplingParams(0.8, seed=3)
    assert replay_params(hot, 0) == hot
    again = replay_params(hot, 5)
    assert again.seed != 3 and again == replay_params(hot, 5) and again.temperature == 0.8
    assert replay_params(hot, 6).seed != again.seed


# ---- membership -------------------------------------------------------------------------------------
class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def stage_hello(node_id: str, want: int = 0) -> proto.Hello:
    return proto.Hello(node_id=node_id, role="stage", device="x86-cpu", free_memory_bytes=1,
                       capabilities={"data_addr": f"tcp://127.0.0.1:{7000 + want}", "want_stage": want})


def ready_stage(m: Membership, identity: bytes, node_id: str, slot: int) -> None:
    m.register(identity, stage_hello(node_id, slot))
    m.on_ready(m.peers[identity], proto.Ready(stage_index=slot))


def tick(m: Membership, busy_clients: set[bytes]) -> list:
    """One turn of the head's liveness work, as its poll loop does it: ping, retry refused slots, judge."""
    m.ping(busy_clients)
    m.retry_refused()
    return m.judge(busy_clients)


def members(**cfg) -> tuple[Membership, list, Clock]:
    sent: list = []
    clock = Clock()
    config = NodeConfig(stages=2, heartbeat_ms=500, stage_timeout_s=2.0, **cfg)
    return Membership(config, lambda i, m: sent.append((i, m)), clock), sent, clock


def test_a_live_stage_s_slot_is_not_handed_to_a_second_connection_with_its_node_id():
    m, _, clock = members()
    m.register(b"conn-1", stage_hello("edge-1", 1))
    reason = m.admit(stage_hello("edge-1", 1))
    assert reason is not None and "live connection" in reason
    clock.now += 1.5   # silent, but within its liveness: still refused
    assert m.admit(stage_hello("edge-1", 1)) is not None
    assert m.on_disconnect(b"conn-1") == [StageLost(1, "edge-1", "disconnected")]
    assert m.admit(stage_hello("edge-1", 1)) is None
    m.register(b"conn-2", stage_hello("edge-1", 1))
    assert m.slots == [b"conn-2", None]


def test_a_stage_of_an_older_data_plane_is_refused_at_hello_naming_both_versions():
    from dataclasses import replace

    m, _, _ = members()
    reason = m.admit(replace(stage_hello("edge-1", 1), version=(1, 8)))
    assert reason is not None and reason.startswith("stage speaks flowedge protocol 1.8, this node speaks 1.9")
    assert "upgrade the stage" in reason and m.admit(stage_hello("edge-1", 1)) is None


def test_a_silent_stage_may_be_replaced_under_its_node_id_before_the_tick_notices():
    m, _, clock = members()
    ready_stage(m, b"conn-1", "edge-1", 1)
    clock.now += 2.5
    assert m.admit(stage_hello("edge-1", 1)) is None
    events = m.register(b"conn-2", stage_hello("edge-1", 1))
    assert [type(e) for e in events] == [StageLost] and m.slots[0] == b"conn-2"


def test_missed_heartbeats_drop_a_stage_and_pings_go_out_every_interval():
    m, sent, clock = members()
    ready_stage(m, b"s1", "a", 1)
    ready_stage(m, b"s2", "b", 2)
    m.register(b"cl", proto.Hello(node_id="c", role="client", device="client", free_memory_bytes=0,
                                  capabilities={"heartbeat": True}))
    m.register(b"old", proto.Hello(node_id="o", role="client", device="client", free_memory_bytes=0))
    assert tick(m, {b"cl"}) == []
    assert sorted(i for i, msg in sent if isinstance(msg, proto.Heartbeat)) == [b"cl", b"s1", b"s2"]
    assert tick(m, {b"old"}) == []
    clock.now += 1.0
    m.seen(b"s1")
    m.seen(b"cl")
    clock.now += 1.5   # s2 silent 2.5 s > 2 s; s1 1.5 s
    assert tick(m, {b"cl"}) == [StageLost(2, "b", "silent for 2.5 s (missed heartbeats)")]
    assert m.slots == [b"s1", None] and not m.cluster_ready()
    clock.now += 9.0   # the client was silent 10.5 s while its request was in progress
    events = tick(m, {b"cl", b"old"})
    assert ClientGone(b"cl", "silent for 10.5 s") in events
    assert b"old" in m.peers   # a client that does not answer heartbeats is judged by its connection


def test_a_stage_loading_its_layers_is_not_dropped_for_silence_but_is_for_a_closed_connection():
    m, _, clock = members()
    m.register(b"s1", stage_hello("a", 1))
    clock.now += 60
    assert tick(m, set()) == [] and m.slots[0] == b"s1"
    assert m.on_disconnect(b"s1") == [StageLost(1, "a", "disconnected")]


def test_an_idle_client_is_not_dropped_for_silence():
    m, _, clock = members()
    m.register(b"cl", proto.Hello(node_id="c", role="client", device="client", free_memory_bytes=0))
    clock.now += 60
    assert tick(m, set()) == [] and b"cl" in m.peers


@pytest.mark.parametrize("field", ["client_timeout_s", "recovery_s", "stall_timeout_s"])
def test_liveness_settings_are_checked(field):
    from flowedge.errors import ConfigError

    with pytest.raises(ConfigError, match=field):
        NodeConfig(**{field: 0.1})



def test_a_stage_holding_another_model_s_layers_is_refused_at_join_and_status_shows_each_model():
    from dataclasses import replace
    from pathlib import Path
    from types import SimpleNamespace

    from flowedge.node import model_check
    from flowedge.node.shard_fetch import ShardFile
    from flowedge.launch.status_view import node_table

    served, other = "a" * 64, "b" * 64
    m, sent, _ = members(lm_head_at="head")
    m.plan = SimpleNamespace(shards=[ShardFile(Path(f"/s/{k}"), f"{k}" * 64, 10, {}) for k in (1, 2)],
                             ranges=[(0, 2), (2, 4)], head_file=None, split_dir=Path("/s"), model_sha256=served)

    def holding(node_id: str, slot: int, model: str) -> proto.Hello:
        hello = stage_hello(node_id, slot)
        return replace(hello, capabilities={**hello.capabilities, **model_check.held(model)})

    reason = m.admit(holding("edge-1", 1, other))
    assert reason is not None and model_check.is_mismatch(reason) and "b" * 12 in reason and "a" * 12 in reason
    assert m.admit(holding("edge-1", 1, served)) is None and m.admit(stage_hello("edge-1", 1)) is None
    m.register(b"s1", holding("edge-1", 1, served))   # its layers are of the head's model (a rejoin)
    m.register(b"s2", stage_hello("edge-2", 2))       # it holds none
    assert {msg.model_sha256 for _, msg in sent if isinstance(msg, proto.Assign)} == {served}
    m.on_heartbeat(m.peers[b"s1"], proto.Heartbeat(node_id="edge-1", load=0.0, rss_bytes=0,
                                                   stats={model_check.HELD_KEY: served}))
    rows = [{"node_id": "head", "role": "head", "model_sha256": served}, *m.status_rows()]
    table = node_table(rows)
    assert "a" * 12 in table[1] and "a" * 12 in table[2] and "a" * 12 not in table[3]


def test_a_stage_that_refuses_its_assignment_keeps_its_slot_and_is_assigned_again_later():
    from flowedge.node.membership import ASSIGN_RETRY_S
    from flowedge.launch.status_view import node_table

    from pathlib import Path
    from types import SimpleNamespace

    from flowedge.node.shard_fetch import ShardFile

    m, sent, clock = members(lm_head_at="head")
    shards = [ShardFile(Path(f"/s/{k}"), f"{k}" * 64, 10, {}) for k in (1, 2)]
    m.plan = SimpleNamespace(shards=shards, ranges=[(0, 2), (2, 4)], head_file=None, split_dir=Path("/s"),
                             model_sha256="")
    m.register(b"s1", stage_hello("a", 1))
    m.register(b"s2", stage_hello("b", 2))
    assert [type(msg) for i, msg in sent if i == b"s2"] == [proto.Assign]
    m.on_ready(m.peers[b"s1"], proto.Ready(stage_index=1))
    m.on_refuse(m.peers[b"s2"], proto.Refuse(reason="assignment failed: ChecksumError: fetched shard hashes to 00"))
    assert m.slots == [b"s1", b"s2"] and not m.cluster_ready()
    row = m.status_rows()[1]
    assert "ChecksumError" in row["error"] and "ChecksumError" in node_table([row])[1]
    sent.clear()

    def assigns_after(seconds: float) -> list[bytes]:
        for _ in range(int(seconds / 0.5)):   # both stages heartbeat meanwhile: nobody is lost
            clock.now += 0.5
            m.seen(b"s1"), m.seen(b"s2")
            assert tick(m, set()) == []
        return [i for i, msg in sent if isinstance(msg, proto.Assign)]

    assert assigns_after(ASSIGN_RETRY_S - 1) == []
    assert assigns_after(1.5) == [b"s2"]   # again, to the refused stage only
    m.on_ready(m.peers[b"s2"], proto.Ready(stage_index=2))
    assert m.cluster_ready() and "error" not in m.status_rows()[1]


def test_a_node_joining_a_full_plan_takes_the_slot_of_a_stage_that_refused_its_assignment():
    from pathlib import Path
    from types import SimpleNamespace

    from flowedge.node.shard_fetch import ShardFile

    m, sent, _ = members(lm_head_at="head")
    shards = [ShardFile(Path(f"/s/{k}"), f"{k}" * 64, 10, {}) for k in (1, 2)]
    m.plan = SimpleNamespace(shards=shards, ranges=[(0, 2), (2, 4)], head_file=None, split_dir=Path("/s"),
                             model_sha256="")
    ready_stage(m, b"s1", "a", 1)
    m.register(b"s2", stage_hello("b", 2))
    assert "the plan is full" in m.admit(stage_hello("spare"))   # every stage serving: no room
    m.on_refuse(m.peers[b"s2"], proto.Refuse(reason="assignment failed: out of memory"))
    assert m.admit(stage_hello("spare")) is None
    sent.clear()
    events = m.register(b"spare", stage_hello("spare"))
    assert events == [StageLost(2, "b", "refused its assignment; a joining node takes the slot")]
    assert m.slots == [b"s1", b"spare"] and b"s2" not in m.peers
    told = [msg for i, msg in sent if i == b"s2"]
    assert len(told) == 1 and isinstance(told[0], proto.Refuse) and "out of memory" in told[0].reason
    assigns = {i: msg for i, msg in sent if isinstance(msg, proto.Assign)}
    assert assigns[b"spare"].stage_index == 2   # and stage 1 learns its new next hop
    assert assigns[b"s1"].next_addr == m.peers[b"spare"].data_addr
    assert "the plan is full" in m.admit(stage_hello("another"))   # the newcomer has not refused anything
